"""Prefix reuse for caches that cannot be trimmed (recurrent state, a wrapped sliding window):
the prompt's state at its last block boundary, kept during prefill, serves the same prompt
again and a next turn extending it, from the local tier and from the store; a prompt that
reuses nothing says why. Real store and engine processes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from engine_service.checkpoints.cache_records import CapturedCache
from engine_service.checkpoints.prefix_cache import BLOCK_SIZE, PrefixCache
from engine_service.checkpoints.prefix_snapshots import boundary
from tandem_client import EngineClient
from tandem_client.identity import block_hashes
from tests.servers import InProcessStore, ServiceProcess, serve_store, start_engine

# 300 scattered token ids: the last block boundary short of the last token is 256.
PROMPT = [(i * 977) % 2000 + 3 for i in range(300)]
NEXT_TURN = PROMPT + [(i * 131) % 2000 + 5 for i in range(80)]
TOKENS = 16


@dataclass
class Served:
    model: str
    store: InProcessStore
    engine: ServiceProcess
    root: Path
    engine_data: Path

    def another_engine(self) -> ServiceProcess:
        """A fresh engine on the same store: an empty local tier."""
        return start_engine(
            self.engine_data,
            "--model",
            self.model,
            "--store",
            self.store.address,
            log_dir=self.root / "second",
        )


@pytest.fixture(scope="module", params=["tandem-tiny-hybrid", "tandem-tiny-swa"])
def served(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    engine_data_dir: Path,
) -> Iterator[Served]:
    model = str(request.param)
    root = tmp_path_factory.mktemp(model)
    with serve_store(root / "store") as store:
        engine = start_engine(
            engine_data_dir, "--model", model, "--store", store.address, log_dir=root
        )
        try:
            yield Served(model, store, engine, root, engine_data_dir)
        finally:
            engine.stop()


def _greedy_alone(engine_data: Path, model: str, prompt: list[int]) -> list[int]:
    """mlx-lm's own greedy decoding of the prompt, one uninterrupted run."""
    model_dir = next((engine_data / "models").glob(f"{model}-v*"))
    loaded = load(str(model_dir))[0]
    return [int(t) for t, _ in generate_step(mx.array(prompt), loaded, max_tokens=TOKENS)]


def test_a_repeated_prompt_and_a_next_turn_reuse_the_snapshot(served: Served) -> None:
    with EngineClient(served.engine.address) as engine:
        cold = engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True)
        assert cold.usage is not None and cold.usage.cached_prompt_tokens == 0
        # Prefilled alone up to 256, then in the batch: the same tokens as one run.
        assert cold.token_ids == _greedy_alone(served.engine_data, served.model, PROMPT)
        repeat = engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True)
        assert repeat.usage is not None
        assert repeat.usage.cached_prompt_tokens == 256  # a local hit, at its exact length
        assert repeat.token_ids == cold.token_ids
        turn = engine.generate(NEXT_TURN, max_tokens=TOKENS, ignore_eos=True)
        assert turn.usage is not None and turn.usage.cached_prompt_tokens >= 256
        alone = engine.generate(NEXT_TURN, max_tokens=TOKENS, ignore_eos=True, namespace="b")
        assert alone.usage is not None and alone.usage.cached_prompt_tokens == 0
        assert turn.token_ids == alone.token_ids
        stats = engine.stats().checkpoints
        assert stats.prefix_hits_local >= 2
        assert engine.flush().durable
    # A fresh engine has an empty memory: the snapshot comes from the store.
    other = served.another_engine()
    try:
        with EngineClient(other.address) as engine:
            warm = engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True)
            assert warm.usage is not None and warm.usage.cached_prompt_tokens == 256
            assert warm.token_ids == cold.token_ids
            turn = engine.generate(NEXT_TURN, max_tokens=TOKENS, ignore_eos=True)
            assert turn.usage is not None and turn.usage.cached_prompt_tokens == 320
            assert turn.token_ids == alone.token_ids
            assert engine.stats().checkpoints.prefix_hits_store == 2
    finally:
        other.stop()


def test_prompts_that_reuse_nothing_are_counted_by_reason(served: Served) -> None:
    with EngineClient(served.engine.address) as engine:
        before = dict(engine.stats().checkpoints.prefix_misses_by_reason)
        engine.generate(PROMPT[:40], max_tokens=2, ignore_eos=True)
        engine.generate(PROMPT[::-1], max_tokens=2, ignore_eos=True, namespace="counted")
        engine.generate(PROMPT[::-1], max_tokens=2, ignore_eos=True, namespace="counted")
        after = engine.stats().checkpoints.prefix_misses_by_reason
    assert after["shorter than a block"] == before.get("shorter than a block", 0) + 1
    assert after["no stored prefix"] == before.get("no stored prefix", 0) + 1  # then a hit


def test_usage_says_why_a_prompt_reused_nothing(served: Served) -> None:
    with EngineClient(served.engine.address) as engine:
        short = engine.generate(PROMPT[:40], max_tokens=2, ignore_eos=True)
        assert short.usage is not None and short.usage.cached_prompt_tokens == 0
        assert short.usage.prefix_miss_reason == "shorter than a block"
        new = engine.generate(PROMPT[::-1], max_tokens=2, ignore_eos=True, namespace="why")
        assert new.usage is not None and new.usage.prefix_miss_reason == "no stored prefix"
        again = engine.generate(PROMPT[::-1], max_tokens=2, ignore_eos=True, namespace="why")
        assert again.usage is not None and again.usage.cached_prompt_tokens == 256
        assert again.usage.prefix_miss_reason == ""


# -- the local tier: an untrimmable entry serves its exact length only -------------------------


def _captured(tokens: int) -> CapturedCache:
    return CapturedCache({}, {}, [], [], tokens)


def _lengths(prompt: list[int]) -> list[int]:
    """What prefix_reuse.find asks of each block: at most all but the prompt's last token."""
    n = -(-len(prompt) // BLOCK_SIZE)
    return [min((i + 1) * BLOCK_SIZE, len(prompt), len(prompt) - 1) for i in range(n)]


def test_the_local_tier_serves_an_exact_entry_at_its_length_only() -> None:
    local = PrefixCache(1 << 20)
    scope = b"s" * 32
    k = boundary(len(PROMPT), 0)
    assert k == 256 and boundary(len(PROMPT), 256) == 0 and boundary(BLOCK_SIZE + 1, 0) == 64
    local.add(b"exact", _captured(k), block_hashes(PROMPT[:k], BLOCK_SIZE, scope), k, exact=True)

    def match(prompt: list[int]) -> tuple[bytes, int, bool]:
        return local.match(block_hashes(prompt, BLOCK_SIZE, scope), _lengths(prompt))

    assert match(PROMPT) == (b"exact", 256, True)
    assert match(NEXT_TURN) == (b"exact", 256, True)
    assert match(PROMPT[:257]) == (b"exact", 256, True)
    # Not shorter (the state cannot be cut back), and not all of a prompt of that length
    # (one token must be fed).
    assert match(PROMPT[:200]) == (b"", 0, False)
    assert match(PROMPT[:256]) == (b"", 0, False)
    # A trimmable entry serves every block boundary up to its length, as before.
    other = [t + 1 for t in PROMPT]
    local.add(b"trim", _captured(300), block_hashes(other, BLOCK_SIZE, scope), 300)
    hashes = block_hashes(other[:200], BLOCK_SIZE, scope)
    assert local.match(hashes, _lengths(other[:200])) == (b"trim", 192, False)
    # ... and an exact entry at a hash a trimmable one serves already is not kept.
    local.add(b"late", _captured(128), block_hashes(other[:128], BLOCK_SIZE, scope), 128, True)
    assert b"late" not in local
