"""Structured output: a request's constraint (JSON Schema, regex, Lark, GBNF, a choice of
strings) compiled by llguidance, and the per-row logits processor that keeps each sampled
token inside it.

llguidance does the grammar work (matchers, token masks); we only wire it into mlx-lm's
BatchGenerator, whose rows each take their own logits processors, so unconstrained rows pay
nothing. A matcher has no serialized state, so a resumed row rebuilds it by replaying the
tokens generated before the checkpoint (consume_tokens: microseconds per token).
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from engine_service.errors import InvalidRequest

log = logging.getLogger(__name__)

MAX_CONSTRAINT_CHARS = 256 * 1024
# JSON without free whitespace between tokens (`{"a":1,"b":[2]}`): fewer tokens, and no model
# can spend its max_tokens on blanks. A schema may ask otherwise through "x-guidance".
COMPACT_JSON: Any = {"whitespace_flexible": False}


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

    def grammar(self) -> str:
        """llguidance's grammar for it (InvalidRequest where the text cannot be read)."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

        try:
            if self.kind is ConstraintKind.JSON_SCHEMA:
                json.loads(self.source)  # a clear message for text that is not JSON
                return str(LLMatcher.grammar_from_json_schema(self.source, COMPACT_JSON))
            if self.kind is ConstraintKind.JSON_OBJECT:
                return str(LLMatcher.grammar_from_json_schema({"type": "object"}, COMPACT_JSON))
            if self.kind is ConstraintKind.REGEX:
                return str(LLMatcher.grammar_from_regex(self.source))
            if self.kind is ConstraintKind.LARK:
                return str(LLMatcher.grammar_from_lark(self.source))
            if self.kind is ConstraintKind.GBNF:
                return str(LLMatcher.grammar_from_lark(gbnf_to_lark(self.source)))
            # A choice: a Lark alternation of JSON-quoted literals (Lark reads them as such).
            options = " | ".join(json.dumps(c) for c in self.choices)
            return str(LLMatcher.grammar_from_lark(f"start: {options}\n"))
        except (ValueError, RuntimeError, GbnfToLarkError) as exc:  # the library's, json's
            raise InvalidRequest(f"constraint ({self.kind.value}): {exc}") from None


def check_constraint(constraint: Constraint) -> None:
    """Shape checks the front can make without a tokenizer."""
    if constraint.kind is ConstraintKind.CHOICE:
        if not constraint.choices or any(not c for c in constraint.choices):
            raise InvalidRequest("constraint choice needs at least one non-empty string")
    elif constraint.kind is not ConstraintKind.JSON_OBJECT and not constraint.source:
        raise InvalidRequest(f"constraint {constraint.kind.value} is empty")
    size = len(constraint.source) + sum(len(c) for c in constraint.choices)
    if size > MAX_CONSTRAINT_CHARS:
        raise InvalidRequest(f"the constraint is {size} characters; at most {MAX_CONSTRAINT_CHARS}")


class Grammars:
    """The engine's llguidance tokenizer (built once, ~1 s) and compiled grammars by
    constraint (a batch of requests under one schema compiles it once)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer: Any = None
        self._grammars: dict[Constraint, str] = {}

    @classmethod
    def for_model(cls, loaded: Any) -> Grammars:
        """For a LoadedModel: its Hugging Face tokenizer, token ids and EOS."""
        return cls(loaded.tokenizer._tokenizer, loaded.vocab_size, loaded.eos_token_ids)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
            )
        return self._tokenizer

    def compile(self, constraint: Constraint) -> str:
        """The checked grammar (InvalidRequest with the library's message)."""
        from llguidance import LLMatcher

        grammar = self._grammars.get(constraint)
        if grammar is None:
            grammar = constraint.grammar()
            error = LLMatcher.validate_grammar(grammar, self.tokenizer)
            if error and not error.startswith("WARNING"):
                raise InvalidRequest(f"constraint ({constraint.kind.value}): {error}")
            if len(self._grammars) > 256:
                self._grammars.clear()
            self._grammars[constraint] = grammar
        return grammar

    def row(
        self, constraint: Constraint, generated: list[int], step: StepTokens | None = None
    ) -> ConstrainedRow:
        """A row's processor, its matcher past the tokens the row generated already."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, self.compile(constraint), log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"constraint ({constraint.kind.value}): {matcher.get_error()}")
        if generated and not matcher.consume_tokens(generated):
            raise InvalidRequest(
                f"the generated tokens do not fit the constraint: {matcher.get_error()}"
            )
        return ConstrainedRow(matcher, self.vocab_size, len(generated), step)


class StepTokens:
    """The tokens the batch is fed this step, read from the device once for every constrained
    row. Each row reading its own (`tokens[-1].item()`) was a device sync a row a step, and on
    an H200 those syncs cost more than the masks. mlx-lm's BatchGenerator hands a processor
    only its row's tokens, so the step's token array is read from the generation batch itself
    (`_generation_batch`, `_current_tokens`, `uids`: mlx-lm is pinned to the version these
    are read from; a row falls back to its own read if they are not there)."""

    def __init__(self, generation_batch: Callable[[], Any]) -> None:
        self._generation_batch = generation_batch
        self._array: Any = None
        self._by_uid: dict[int, int] = {}

    def token_of(self, uid: int) -> int | None:
        try:
            batch = self._generation_batch()
            array = batch._current_tokens
            if array is not self._array:
                self._by_uid = dict(zip(batch.uids, array.tolist(), strict=True))
                self._array = array
        except (AttributeError, TypeError, ValueError):
            return None
        return self._by_uid.get(uid)


class ConstrainedRow:
    """mlx-lm logits processor for one row: masks every token the constraint forbids.

    The batch calls it once per step with the row's tokens so far. Its first call comes with
    the last fed token, which is a prompt token or one the matcher consumed when it was
    built; each later call's last token is the one sampled a step before, consumed here.
    """

    def __init__(
        self, matcher: Any, vocab_size: int, consumed: int, step: StepTokens | None = None
    ) -> None:
        self.matcher = matcher
        self.step = step
        self.uid = -1  # the batch row, once inserted
        self.vocab_size = vocab_size
        self.consumed = consumed  # generated tokens the matcher has taken
        self._first = True
        self._bitmask = np.zeros(((vocab_size + 31) // 32,), dtype=np.int32)
        self._bias: np.ndarray[Any, Any] | None = None  # 0 allowed, -inf not, logits wide

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        mx.async_eval(logits)  # the device computes the step while the mask is made here
        if self._first:
            self._first = False
        else:
            # Not the first call: the row is in the main generation batch (a new batch's
            # first step is its rows' first call).
            last = self.step.token_of(self.uid) if self.step is not None else None
            if last is None:
                own: Any = tokens[-1].item()
                last = int(own)
            self.matcher.consume_token(last)
            self.consumed += 1
        if self.matcher.is_error():  # only a bug gets here: the mask forbade that token
            log.error("a constrained row left its grammar: %s", self.matcher.get_error())
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        # The mask becomes an additive bias on the host: one transfer and one add on the
        # device (the bit arithmetic as MLX ops was ~6 kernels a row a step).
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        if self._bias is None:  # a padded vocabulary: the padding stays -inf
            self._bias = np.full((logits.shape[-1],), -np.inf, dtype=np.float32)
        width = min(self.vocab_size, logits.shape[-1])
        self._bias[:width] = np.where(allowed[:width], 0.0, -np.inf)
        return logits + mx.array(self._bias, dtype=logits.dtype)

    def complete(self, generated: list[int]) -> bool:
        """Whether these generated tokens are a whole match. The batch samples a step ahead,
        so the matcher has taken all of them or all but the last."""
        probe = self.matcher.deep_copy()
        if not probe.consume_tokens(generated[self.consumed :]):
            return False
        return bool(probe.is_accepting())
