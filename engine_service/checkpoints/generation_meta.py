"""What a generation checkpoint says about itself: its metadata strings (`GenerationMeta`),
the digest of the options a resume must share, the keys and rules of segment chains, and the
refusals a record's own fields decide (checkpoints/generations.py has the policy that uses
them)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from engine_service.errors import Corrupt, GenerationEnded, Precondition
from engine_service.protocol.sampling_options import SamplingOptions
from tandem_client.records import Checkpoint

# A chain's run holds at most this many segments; the next starts over after the chain's
# settled parts (checkpoints/generations.py).
MAX_CHAIN = 16
# Settled parts of one level that merge into one of the next (a log-structured merge: each
# position is stored again once a level, and a resume reads at most MERGE_FANOUT - 1 parts a
# level), and the most a chain keeps before it starts over with a whole snapshot.
MERGE_FANOUT = 8
MAX_PARTS = 40
# The metadata key of an ended generation's tombstone: how it ended.
ENDED = "tandem.ended"
# What a manifest whose chain rests on a prompt's prefix record says it needs to be read: an
# engine that predates bases finds no chain under its keys and refuses this codec by name.
BASED_CODEC_VERSION = "tandem.chain.v3"


@dataclass(frozen=True)
class ChainBase:
    """A prompt's prefix record a chain rests on: the chain holds positions from `tokens` on,
    the record the first `tokens` (it may hold more: a record is trimmed to what the row
    restored from it). The generation pins it while it runs; it is never deleted with it."""

    key: bytes
    tokens: int


@dataclass
class BaseLease:
    """A lease on a chain's base record, taken (and renewed) by the spill thread, given back
    when the generation ends."""

    key: bytes
    namespace: str
    lease_id: str = ""  # "" until the store granted it


@dataclass(frozen=True)
class GenerationMeta:
    """A generation checkpoint's state, as its record's metadata strings."""

    prompt_tokens: int
    generated: int
    pending: int
    seed: int
    max_tokens: int
    options: str  # options_digest(...).hex()
    # Chains only: the live run's segments are first .. next - 1, after the chain's settled
    # parts when it has them (their segment indices, in position order).
    chain_first: int | None = None
    chain_next: int | None = None
    chain_parts: tuple[int, ...] = ()
    chain_base: ChainBase | None = None

    @property
    def next_step(self) -> int:
        return self.generated + 1

    def to_metadata(self) -> dict[str, str]:
        meta = {
            "prompt_tokens": str(self.prompt_tokens),
            "generated": str(self.generated),
            "pending": str(self.pending),
            "seed": str(self.seed),
            "next_step": str(self.next_step),
            "max_tokens": str(self.max_tokens),
            "options": self.options,
        }
        if self.chain_first is not None and self.chain_next is not None:
            if self.chain_base is not None:
                # Other names again: an engine that knows parts but not bases would read
                # this run from position 0; it finds no chain and refuses the codec.
                meta["chain_base"] = self.chain_base.key.hex()
                meta["base_tokens"] = str(self.chain_base.tokens)
                meta["base_parts"] = ",".join(map(str, self.chain_parts))
                meta["run_first"] = str(self.chain_first)
                meta["run_next"] = str(self.chain_next)
            elif not self.chain_parts:
                meta["chain_first"] = str(self.chain_first)
                meta["chain_next"] = str(self.chain_next)
            else:
                # Other names: an engine that predates settled parts would read this run as
                # a chain from position 0; it finds no chain here and refuses the record.
                meta["chain_parts"] = ",".join(map(str, self.chain_parts))
                meta["run_first"] = str(self.chain_first)
                meta["run_next"] = str(self.chain_next)
        return meta

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> GenerationMeta:
        if "segments_first" in meta:
            raise Precondition(
                "this checkpoint chain was written by an older engine (no segment list); "
                "it cannot be resumed by this one"
            )
        try:
            base = _base_of(meta)
            listed = meta.get("chain_parts") if base is None else meta["base_parts"]
            based = listed is not None
            first, next_ = ("run_first", "run_next") if based else ("chain_first", "chain_next")
            chained = first in meta
            parts = tuple(int(i) for i in listed.split(",")) if listed else ()
            if based and not (0 if base else 1) <= len(parts) <= MAX_PARTS:
                raise ValueError(f"{len(parts)} settled parts")
            return cls(
                prompt_tokens=int(meta["prompt_tokens"]),
                generated=int(meta["generated"]),
                pending=int(meta["pending"]),
                seed=int(meta["seed"]),
                max_tokens=int(meta["max_tokens"]),
                options=meta["options"],
                chain_first=int(meta[first]) if chained else None,
                chain_next=int(meta[next_]) if chained else None,
                chain_parts=parts,
                chain_base=base,
            )
        except (KeyError, ValueError) as exc:
            raise Corrupt(f"generation checkpoint metadata is malformed ({exc!r})") from exc


def _base_of(meta: dict[str, str]) -> ChainBase | None:
    """The prefix record a chain's metadata says it rests on (ValueError: malformed)."""
    if "chain_base" not in meta:
        return None
    key, tokens = bytes.fromhex(meta["chain_base"]), int(meta["base_tokens"])
    if len(key) != 32 or tokens <= 0:
        raise ValueError("a malformed chain base")
    return ChainBase(key, tokens)


def options_digest(options: SamplingOptions) -> bytes:
    """What a resumed request must share with the original besides prompt and request id."""
    fields = {
        k: getattr(options, k)
        for k in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "repetition_context_size",
            "seed",
            "stop",
            "stop_token_ids",
            "ignore_eos",
        )
    }
    if options.constraint is not None:  # absent from unconstrained keys: they stay as they were
        fields["constraint"] = options.constraint.digest()
    for name in ("presence_penalty", "frequency_penalty", "logit_bias"):  # likewise, when set
        if getattr(options, name):
            fields[name] = getattr(options, name)
    return hashlib.blake2b(
        json.dumps(fields, sort_keys=True, default=list).encode(), digest_size=16
    ).digest()


def segment_key(key: bytes, index: int) -> bytes:
    """The record key of segment `index` of a generation checkpoint's chain."""
    return hashlib.blake2b(key + index.to_bytes(4, "big"), digest_size=32).digest()


def segmentable(layout: list[str]) -> bool:
    """Plain KV caches only grow at the end, so a checkpoint can append what is new."""
    return all(codec == "kv:plain" for codec in layout)


# A deterministic engine's model id ends in this and its arithmetic (checkpoints/manager.py):
# its checkpoints and prefixes are its mode's alone, and a generation resumes in the mode
# (and under the arithmetic) it started in.
DETERMINISTIC_MARK = "/deterministic"


def deterministic_suffix(arithmetic: str) -> str:
    """The model id's ending for a deterministic engine of this arithmetic ("" when off)."""
    return f"{DETERMINISTIC_MARK} ({arithmetic})" if arithmetic else ""


def mode_of(model_id: str) -> tuple[str, str]:
    """(the model id without its mode, the mode: "" or DETERMINISTIC_MARK and arithmetic)."""
    base, mark, arithmetic = model_id.partition(DETERMINISTIC_MARK)
    return base, mark + arithmetic


def model_refusal(made_by: str, serving: str) -> str:
    """Why a checkpoint made by one model id does not resume on an engine serving another."""
    (base_made, mode_made), (base_serving, mode_serving) = mode_of(made_by), mode_of(serving)
    if base_made == base_serving:

        def described(mode: str) -> str:
            if not mode:
                return "without --deterministic"
            return "with --deterministic" + mode.removeprefix(DETERMINISTIC_MARK)

        return (
            f"this generation started {described(mode_made)} and resumes only on an engine "
            f"started so; this one runs {described(mode_serving)}"
        )
    return f"checkpoint was made by model {made_by!r}; this engine serves {serving!r}"


def refuse_ended(record: Checkpoint) -> None:
    """A tombstone: the generation ended; there is nothing to resume (GenerationEnded carries
    its tokens, for a finished one's tail)."""
    ended = record.metadata.get(ENDED)
    if ended is not None:
        count = record.metadata.get("generated", "?")
        generated = int(count) if count.isdigit() else None
        prompt = record.metadata.get("prompt_tokens", "")
        tokens = None
        if generated is not None and prompt.isdigit():
            tokens = list(record.token_ids[int(prompt) :])
            tokens = tokens if len(tokens) == generated else None
        raise GenerationEnded(
            f"this generation {ended}; {count} tokens (nothing to resume)",
            generated,
            finished=ended == "finished",
            tokens=tokens,
        )
