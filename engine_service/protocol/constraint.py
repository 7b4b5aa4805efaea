"""A request's structured-output constraint as it crosses from the front to the core, and the
shape and size checks the front makes before it goes (sampling/constraints.py compiles it, in
the core only).
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
from dataclasses import dataclass

from engine_service.errors import InvalidRequest

log = logging.getLogger("engine_service.sampling.constraints")  # one logger for constraints

MAX_CONSTRAINT_CHARS = 256 * 1024
# llguidance's parser limits (LLParserLimits; its defaults, llguidance 1.9). Past one of them a
# grammar fails to compile (refused with the library's message, which names the limit) or
# its matcher fails mid-generation. One an option list reaches at once: an Earley row holds
# at most MAX_ITEMS_IN_ROW items, so a choice of 2,000 strings fails after its first token
# ("Current row has 2001 items"): the options and the rule's own item must fit.
MAX_ITEMS_IN_ROW = 2000
MAX_CHOICES = MAX_ITEMS_IN_ROW - 1
MAX_ERROR_CHARS = 300  # of a library message: it may quote the user's grammar


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    LARK = "lark"
    GBNF = "gbnf"
    CHOICE = "choice"
    JSON_OBJECT = "json_object"


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    source: str = ""  # the schema, regex or grammar text
    choices: tuple[str, ...] = ()

    def digest(self) -> str:
        """Part of a generation's identity: a resume must carry the same constraint."""
        text = json.dumps([self.kind.value, self.source, list(self.choices)])
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    @property
    def size(self) -> int:
        return len(self.source) + sum(len(c) for c in self.choices)

    def refusal(self, error: str, what: str = "") -> InvalidRequest:
        """InvalidRequest with the library's message, cut short; logged by kind and size
        only (the text is the user's, up to 256 KiB, and messages quote it)."""
        short = short_error(error)
        log.info("constraint %s of %d characters refused: %s", self.kind.value, self.size, short)
        return InvalidRequest(f"constraint ({self.kind.value}){what}: {short}")


def short_error(error: str) -> str:
    """A library message without llguidance's trailer, at most MAX_ERROR_CHARS."""
    error = error.replace("<non-verbose/>", "").strip()
    return error if len(error) <= MAX_ERROR_CHARS else error[: MAX_ERROR_CHARS - 3] + "..."


def check_constraint(constraint: Constraint) -> None:
    """Shape and size checks the front makes before any compiling (microseconds: a
    40,000-option choice is refused here, not after seconds of grammar building)."""
    if len(constraint.choices) > MAX_CHOICES:
        raise InvalidRequest(
            f"constraint choice has {len(constraint.choices)} options; at most "
            f"{MAX_CHOICES} (llguidance's parser holds {MAX_ITEMS_IN_ROW} items in a row)"
        )
    size = constraint.size
    if size > MAX_CONSTRAINT_CHARS:
        raise InvalidRequest(
            f"the constraint is {size} characters (choice options counted together); "
            f"at most {MAX_CONSTRAINT_CHARS}"
        )
    if constraint.kind is ConstraintKind.CHOICE:
        if not constraint.choices or any(not c for c in constraint.choices):
            raise InvalidRequest("constraint choice needs at least one non-empty string")
    elif constraint.kind is not ConstraintKind.JSON_OBJECT and not constraint.source:
        raise InvalidRequest(f"constraint {constraint.kind.value} is empty")
