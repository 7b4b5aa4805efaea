"""A generation request as the engine sees it (validated from its wire form by front/wire.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_service.errors import InvalidRequest
from engine_service.protocol.kv_codec import KVCodec, Scheme
from engine_service.protocol.sampling_options import SamplingOptions


@dataclass(frozen=True)
class DraftSupport:
    """What the engine offers for speculative decoding."""

    model_id: str = ""  # "" when no draft model is loaded
    default: int = 0


def stop_token_ids(sampling: SamplingOptions, eos_token_ids: list[int]) -> frozenset[int]:
    """Tokens that end a generation: the request's own, and the model's EOS unless ignored.

    The one place this is decided: the batch, the speculative lane and the text stream all
    read `GenerationRequest.stop_ids`."""
    ids = set(sampling.stop_token_ids)
    # A constraint's end is the end of sequence: a constrained row stops there, ignore_eos or not.
    if not sampling.ignore_eos or sampling.constraint is not None:
        ids.update(eos_token_ids)
    return frozenset(ids)


# Between a principal's name and its own request id: request ids are the caller's own (a
# client's id is printable, so it never holds this).
OWNER_SEPARATOR = "\x1f"


def scoped_id(owner: str, request_id: str) -> str:
    """The engine's id of a caller's request: callers never see or touch each other's."""
    return f"{owner}{OWNER_SEPARATOR}{request_id}" if owner else request_id


# What GenerateRequest.prefix_record_bits may be under each prefix_record_scheme (0: exact).
PREFIX_RECORD_BITS = {Scheme.AFFINE: (0, 4, 8), Scheme.TURBOQUANT: (0, 2, 3, 4)}


@dataclass(frozen=True)
class RecordFormat:
    """How a prompt's prefix record is kept in the store (checkpoints/record_codec.py): exact
    (bits 0), or its plain KV as codes of `bits` bits under `scheme`."""

    bits: int = 0
    scheme: Scheme = Scheme.AFFINE

    @property
    def tag(self) -> str:
        """Mixed into the records' scope: a record of another format is never restored."""
        if not self.bits:
            return ""
        name = "affine" if self.scheme is Scheme.AFFINE else "turboquant"
        return f"record:{name}{self.bits}"


EXACT_RECORD = RecordFormat()


def checked_record_format(bits: int, scheme: Scheme) -> RecordFormat:
    allowed = PREFIX_RECORD_BITS[scheme]
    if bits not in allowed:
        raise InvalidRequest(
            f"prefix_record_bits must be one of {allowed} for {scheme.name.lower()} records, "
            f"got {bits}"
        )
    return RecordFormat(bits, scheme) if bits else EXACT_RECORD


@dataclass
class GenerationRequest:
    request_id: str  # scoped_id(owner, the client's id)
    prompt: list[int]
    max_tokens: int
    sampling: SamplingOptions
    namespace: str
    stop_ids: frozenset[int] = frozenset()
    # Absolute time.monotonic() by which the client stops waiting, or None.
    deadline: float | None = None
    checkpoint_interval: int = 0
    resume: bool = False
    tokens_held: int = 0
    kv: KVCodec = KVCodec()
    layout: list[str] = field(default_factory=list)  # the model's layout under `kv`
    num_draft: int = 0  # speculative decoding: draft tokens per round (0: off)
    # How the prefix record is kept in the store (checkpoints/record_codec.py).
    prefix_record: RecordFormat = EXACT_RECORD

    @property
    def shown_id(self) -> str:
        """The request id as its client knows it."""
        return self.request_id.rpartition(OWNER_SEPARATOR)[2]

    def finished_by(self, tokens: list[int]) -> bool:
        """Whether these generated tokens already end the generation."""
        return bool(tokens) and (tokens[-1] in self.stop_ids or len(tokens) >= self.max_tokens)
