"""A registered region's pages mapped into the store's address space ahead of its first
copies, on a thread of their own (tandem_wire/pages.py says why).

The store maps a caller's region (regions.py) with no page of it mapped yet, and a fresh
engine (a resume after a crash) always brings a fresh region: its first copies paid a page
fault a page (docs/performance.md, eighth session).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from tandem_wire import pages

if TYPE_CHECKING:
    from store_service.regions import Region

log = logging.getLogger(__name__)


def start(region: Region, hold: Callable[[Region], bool], done: Callable[[Region], None]) -> None:
    """Maps region's pages on a daemon thread. hold(region): whether it is still registered,
    and if so keeps it from being closed until done(region)."""
    if region.map is not None:
        threading.Thread(
            target=_populate, args=(region, hold, done), name="region-prefault", daemon=True
        ).start()


def _populate(
    region: Region, hold: Callable[[Region], bool], done: Callable[[Region], None]
) -> None:
    assert region.map is not None
    base = pages.address_of(region.map)
    for offset in range(0, region.size, pages.STEP):
        if not hold(region):
            return  # released meanwhile
        try:
            problem = pages.populate(base + offset, min(pages.STEP, region.size - offset))
        finally:
            done(region)
        if problem:
            log.debug(
                "region %r: its pages fault in as they are copied into (%s)", region.name, problem
            )
            return
