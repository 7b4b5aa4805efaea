"""Structured output: a request's constraint (JSON Schema, regex, Lark, GBNF, a choice of
strings) compiled by llguidance, and each constrained row's matcher.

llguidance does the grammar work (matchers, token masks); we wire it into mlx-lm's
BatchGenerator: a row's first step through its per-row logits processor, every later step
through BatchMasks (sampling/masks.py), all constrained rows of the batch together. A
matcher has no serialized state, so a resumed row rebuilds it by replaying the tokens
generated before the checkpoint (consume_tokens: microseconds per token).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import OrderedDict
from typing import Any

import mlx.core as mx
import numpy as np

from engine_service.errors import InvalidRequest
from engine_service.model import mlx_compat
from engine_service.protocol.constraint import Constraint, ConstraintKind, short_error
from engine_service.sampling.constraint_compiler import CompileBudget

log = logging.getLogger(__name__)

MAX_CACHED = 256  # compiled grammars and prepared matchers kept, by constraint
MAX_FORCED_PROBE = 256  # forced tokens a compile walks through (a self-requiring schema fails)
# JSON without free whitespace between tokens (`{"a":1,"b":[2]}`): fewer tokens, and no model
# can spend its max_tokens on blanks. A schema may ask otherwise through "x-guidance".
COMPACT_JSON: Any = {"whitespace_flexible": False}


def grammar_of(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint (InvalidRequest where the text cannot be read)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

    try:
        if constraint.kind is ConstraintKind.JSON_SCHEMA:
            json.loads(constraint.source)  # a clear message for text that is not JSON
            return str(LLMatcher.grammar_from_json_schema(constraint.source, COMPACT_JSON))
        if constraint.kind is ConstraintKind.JSON_OBJECT:
            return str(LLMatcher.grammar_from_json_schema({"type": "object"}, COMPACT_JSON))
        if constraint.kind is ConstraintKind.REGEX:
            return str(LLMatcher.grammar_from_regex(constraint.source))
        if constraint.kind is ConstraintKind.LARK:
            return str(LLMatcher.grammar_from_lark(constraint.source))
        if constraint.kind is ConstraintKind.GBNF:
            return str(LLMatcher.grammar_from_lark(gbnf_to_lark(constraint.source)))
        # A choice: a Lark alternation of JSON-quoted literals (Lark reads them as such).
        options = " | ".join(json.dumps(c) for c in constraint.choices)
        return str(LLMatcher.grammar_from_lark(f"start: {options}\n"))
    except (ValueError, RuntimeError, GbnfToLarkError) as exc:  # the library's, json's
        raise constraint.refusal(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - gbnf_to_lark raises bare Exception too
        raise constraint.refusal(f"{type(exc).__name__}: {exc}") from None


@functools.cache
def parser_limits() -> Any:
    """llguidance's default limits, without its verbose errors (they dump the grammar and the
    parser's state: user data, tens of KB)."""
    from llguidance import LLParserLimits

    return LLParserLimits(verbose_errors=False)


class Grammars:
    """The engine's llguidance tokenizer (built once, ~1 s) and its compiled constraints.

    The core compiles and checks each constraint when its request arrives (compile: within
    the budget) and prepares a matcher for it (prepare), both on its planning pool; on the
    batch loop a row only copies that matcher (row), so no grammar is ever compiled there. A
    batch of requests under one schema compiles it once. The front only checks a
    constraint's shape and size (protocol/constraint.py).
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        budget: CompileBudget | None = None,
    ) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.budget = budget  # compiles wait at most its timeout
        self._lock = threading.Lock()
        self._llg_tokenizer: Any = None
        self._grammars: dict[Constraint, tuple[str, bool]] = {}  # grammar, start checked
        self._templates: OrderedDict[Constraint, Any] = OrderedDict()  # fresh matchers
        self.built_on_loop = 0  # rows whose matcher was not prepared (evicted meanwhile)

    @classmethod
    def for_model(cls, loaded: Any, budget: CompileBudget | None = None) -> Grammars:
        """For a LoadedModel: its Hugging Face tokenizer, token ids and EOS."""
        return cls(
            mlx_compat.hf_tokenizer(loaded.tokenizer),
            loaded.vocab_size,
            loaded.eos_token_ids,
            budget,
        )

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._llg_tokenizer is None:
                import llguidance.hf

                self._llg_tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._llg_tokenizer

    def compile(self, constraint: Constraint, check_start: bool = True) -> str:
        """The checked grammar (InvalidRequest with the library's message): it compiles
        within llguidance's limits (and the budget's time), and (check_start) a matcher on it
        can start. Blocking: call it off the event loop."""
        if self.budget is None:
            return self._compile(constraint, check_start)
        return self.budget.run(
            constraint.digest(),
            f"constraint ({constraint.kind.value})",
            lambda: self._compile(constraint, check_start),
        )

    def _compile(self, constraint: Constraint, check_start: bool) -> str:
        from llguidance import LLMatcher

        grammar, started = self._grammars.get(constraint, ("", False))
        if not grammar:
            grammar = grammar_of(constraint)
            error = LLMatcher.validate_grammar(grammar, self.tokenizer, limits=parser_limits())
            if error and not error.startswith("WARNING"):
                raise constraint.refusal(error)
        if check_start and not started:
            self._check_start(constraint, grammar)
            started = True
        with self._lock:
            if len(self._grammars) > MAX_CACHED:
                self._grammars.clear()
            self._grammars[constraint] = (grammar, started)
        return grammar

    def _check_start(self, constraint: Constraint, grammar: str) -> None:
        """Refuses a grammar nothing satisfies, as far as its start shows: the first mask
        allows nothing (regex `[^\\s\\S]`), or the tokens it forces fail (a schema that
        requires itself forces `{"a":{"a":...` past the parser's limits; a row past
        MAX_ITEMS_IN_ROW fails on its first token). What only a later choice reaches ends
        the row at generation time, flagged constraint_incomplete."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=parser_limits())
        allowed = False
        if not matcher.is_error():
            allowed = any(matcher.compute_bitmask())
        if not matcher.is_error():
            forced = matcher.compute_ff_tokens()[:MAX_FORCED_PROBE]
            if forced:
                matcher.consume_tokens(forced)
        if matcher.is_error():
            raise constraint.refusal(matcher.get_error(), " cannot be matched")
        if not allowed and not matcher.is_accepting():
            raise constraint.refusal("no token can start it", " cannot be matched")

    def prepare(self, constraint: Constraint) -> None:
        """A fresh matcher for the constraint, kept for its rows (blocking: the core calls it
        on its planning pool, before the request reaches the batch loop)."""
        with self._lock:
            if constraint in self._templates:
                self._templates.move_to_end(constraint)
                return
        template = self._matcher(constraint)
        with self._lock:
            self._templates[constraint] = template
            while len(self._templates) > MAX_CACHED:
                self._templates.popitem(last=False)

    def _matcher(self, constraint: Constraint) -> Any:
        from llguidance import LLMatcher

        grammar = self._grammars.get(constraint, ("", False))[0] or grammar_of(constraint)
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise constraint.refusal(matcher.get_error())
        return matcher

    def row(self, constraint: Constraint, generated: list[int]) -> ConstrainedRow:
        """A row's processor, its matcher past the tokens the row generated already: a copy
        of the prepared one (microseconds), or built here when it was not prepared."""
        with self._lock:
            template = self._templates.get(constraint)
        if template is None:
            self.built_on_loop += 1
            matcher = self._matcher(constraint)
        else:
            matcher = template.deep_copy()
        if generated and not matcher.consume_tokens(generated):
            error = short_error(matcher.get_error())
            raise InvalidRequest(f"the generated tokens do not fit the constraint: {error}")
        return ConstrainedRow(matcher, self.vocab_size, len(generated))


class ConstrainedRow:
    """A constrained row's matcher, and mlx-lm logits processor for its first step.

    A new row's first step runs inside mlx-lm as a batch of the new rows alone, through this
    processor; BatchMasks (sampling/masks.py) then takes the row out of mlx-lm's per-row
    processors and masks every later step with the whole batch's rows together. The first
    call's last token is a prompt token or one the matcher consumed when it was built; each
    later token fed to the row is the one sampled a step before, consumed by `advance`.
    """

    def __init__(self, matcher: Any, vocab_size: int, consumed: int) -> None:
        self.matcher = matcher
        self.uid = -1  # the batch row, once inserted
        self.vocab_size = vocab_size
        self.consumed = consumed  # generated tokens the matcher has taken
        self.first_step_done = False

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        mx.async_eval(logits)  # the device computes the step while the mask is made here
        if self.first_step_done:
            # Only where BatchMasks could not take the row over (see adopt): per row.
            last: Any = tokens[-1].item()
            self.advance(int(last))
        self.first_step_done = True
        bitmask = np.zeros((1, mask_words(self.vocab_size)), dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        return apply_bitmask(logits, bitmask, np.array([True]))

    def advance(self, token: int) -> None:
        """The token the batch fed this row (sampled under the last mask)."""
        if not self.matcher.consume_token(token):
            # The mask forbade it, or the parser hit a limit on this path (the matcher then
            # allows only EOS: the row ends, flagged constraint_incomplete).
            log.warning(
                "a constrained row left its grammar: %s", short_error(self.matcher.get_error())
            )
        self.consumed += 1

    def complete(self, generated: list[int]) -> bool:
        """Whether these generated tokens are a whole match. The batch samples a step ahead,
        so the matcher has taken all of them or all but the last."""
        probe = self.matcher.deep_copy()
        if not probe.consume_tokens(generated[self.consumed :]):
            return False
        return bool(probe.is_accepting())


def mask_words(vocab_size: int) -> int:
    """int32 words of llguidance's token bitmask for this vocabulary (bit i: token i)."""
    return (vocab_size + 31) // 32


def apply_bitmask(
    logits: mx.array, bitmask: np.ndarray[Any, Any], masked: np.ndarray[Any, Any]
) -> mx.array:
    """-inf where a row's bitmask forbids a token; rows with masked False stay as they are.

    logits: [rows, ..., width]; bitmask: [rows, words] int32, little-endian bits. The bits
    are unpacked on the device (a few kernels for the batch), so a 150k vocabulary moves
    19 KB a row to the device, not a 600 KB bias. Columns past the bitmask (a padded
    vocabulary) are forbidden to masked rows.
    """
    rows, width = logits.shape[0], logits.shape[-1]
    words = mx.array(bitmask.view(np.uint32))
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
    allowed = bits.reshape(rows, -1).astype(mx.bool_)
    if allowed.shape[1] >= width:
        allowed = allowed[:, :width]
    else:
        free = mx.array(~masked)[:, None]
        pad = mx.broadcast_to(free, (rows, width - allowed.shape[1]))
        allowed = mx.concatenate([allowed, pad], axis=1)
    allowed = allowed.reshape(rows, *([1] * (logits.ndim - 2)), width)
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))
