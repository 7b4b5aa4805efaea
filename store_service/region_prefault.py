"""A registered region's pages mapped into the store's address space ahead of its first
copies, on a thread of their own (tandem_wire/pages.py says why).

The store maps a caller's region (regions.py) with no page of it mapped yet, and a fresh
engine (a resume after a crash) always brings a fresh region: its first copies paid a page
fault a page (docs/performance.md, eighth session).
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable

from tandem_wire import pages

log = logging.getLogger(__name__)


def start(
    mapping: mmap.mmap, size: int, name: str, hold: Callable[[], bool], done: Callable[[], None]
) -> None:
    """Maps the region's pages on a daemon thread. hold(): whether the region is still
    registered, and if so keeps its mapping from being closed until done()."""
    threading.Thread(
        target=_populate,
        args=(mapping, size, name, hold, done),
        name="region-prefault",
        daemon=True,
    ).start()


def _populate(
    mapping: mmap.mmap, size: int, name: str, hold: Callable[[], bool], done: Callable[[], None]
) -> None:
    if not hold():
        return
    try:
        base = pages.address_of(mapping)
    finally:
        done()
    problem = pages.populate_in_steps(base, size, hold, done)
    if problem:
        log.debug("region %r: its pages fault in as they are copied into (%s)", name, problem)
