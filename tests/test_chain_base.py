"""A generation's checkpoint chain resting on its prompt's prefix record (chain_policy.rest_on):
the chain stores only the positions after the record, the generation pins the record while it
runs and gives the lease back when it ends, and a resume reads the record first. A real
in-process store and the embedded model; every resume is checked against the uninterrupted
generation."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from engine_service.checkpoints.generation_meta import BASED_CODEC_VERSION, segment_key
from engine_service.checkpoints.manager import CheckpointManager, CheckpointSettings
from engine_service.core.planner import Planner
from engine_service.errors import NotFound
from engine_service.loop.limits import Limits
from engine_service.loop.scheduler import Scheduler
from engine_service.model.loaded import LoadedModel
from engine_service.model.loading import load_model
from engine_service.protocol.kv_codec import Scheme
from engine_service.protocol.requests import EXACT_RECORD, DraftSupport, RecordFormat
from tandem_client import StoreClient
from tandem_client.identity import prefix_key
from tests.generation_rows import Collector, continues_exactly, kept_generation, request_for

PROMPT = [(j * 53) % 700 + 3 for j in range(300)]


@pytest.fixture(scope="module")
def tiny(engine_data_dir: Path) -> LoadedModel:
    return load_model("", engine_data_dir)


def _run_to_end(
    tiny: LoadedModel,
    checkpoints: CheckpointManager,
    tokens: int,
    interval: int = 0,
    record: RecordFormat = EXACT_RECORD,
    planned: bool = False,
) -> Collector:
    """A generation of PROMPT run to its end (a checkpointed one's checkpoint is deleted):
    every `interval` tokens checkpointed, its prefix kept as `record`, planned as the core
    plans it (a stored prefix restored) or prefilled whole."""
    scheduler = Scheduler(tiny, Limits(max_running=2), checkpoints=checkpoints)
    scheduler.start()
    try:
        request = request_for(tiny, "to-the-end", PROMPT, tokens)
        request.checkpoint_interval = interval
        request.prefix_record = record
        sink = Collector()
        plan = Planner(checkpoints, DraftSupport()).plan(request) if planned else None
        scheduler.submit(request, sink, plan)
        sink.wait()
        return sink
    finally:
        scheduler.shutdown()


def test_a_chain_rests_on_its_prompts_prefix_record(
    tiny: LoadedModel, inprocess_store: str
) -> None:
    """The first generation of a prompt saves the prompt's prefix record and its chain
    starts after it, the record pinned for it; the next generation of the same prompt
    restores all but the prompt's last position from that record and its chain rests on
    those. Both resume exactly. A finished generation gives its lease back; a resume whose
    base is gone is NOT_FOUND."""
    checkpoints = CheckpointManager(tiny, CheckpointSettings(store=inprocess_store))
    gens = checkpoints.generations
    base = prefix_key(checkpoints.prefixes.scope("default", list(tiny.layout)), PROMPT)
    try:
        request, key = kept_generation(tiny, checkpoints, PROMPT, tokens=40, rid="first")
        _, again_key = kept_generation(tiny, checkpoints, PROMPT, tokens=40, rid="again")
        with StoreClient(inprocess_store) as store:
            for generation, rests_on in ((key, len(PROMPT)), (again_key, len(PROMPT) - 1)):
                meta = store.get_header(generation).metadata
                assert meta.get("chain_base") == base.hex(), (rests_on, meta)
                assert meta["base_tokens"] == str(rests_on)
                # Engines that predate bases find no chain here and refuse the codec.
                assert meta["codec"] == BASED_CODEC_VERSION
                assert "chain_first" not in meta and "chain_parts" not in meta
                first = store.get_header(segment_key(generation, 0))
                assert int(first.metadata["start"]) == rests_on  # the prompt is not stored again
            leases = store.inspect(base).leases
            assert len(leases) == 2 and all(x.holder.startswith("engine/") for x in leases)

            for generation in (key, again_key):
                plan = gens.loads.load(generation, "default", request.prompt, request.layout)
                assert plan.base is not None and plan.base.key == base
                assert plan.parts[0].key == base
                continues_exactly(tiny, gens, plan, PROMPT)

            _run_to_end(tiny, checkpoints, 40, interval=8)
            assert checkpoints.flush().durable
            assert store.inspect(base).leases == leases  # its own lease given back

            store.admin_delete(base, force=True)
            with pytest.raises(NotFound, match="prefix record"):
                gens.loads.load(key, "default", request.prompt, request.layout)
    finally:
        checkpoints.close()


def test_a_chain_whose_base_cannot_be_pinned_starts_over_at_position_0(
    tiny: LoadedModel, inprocess_store: str
) -> None:
    """A generation whose caches came from a prefix record the store no longer holds (here:
    a local hit of a record deleted from the store) cannot pin it: the run resting on it is
    not sent, and the chain starts over with a whole snapshot from position 0, which
    resumes exactly."""
    checkpoints = CheckpointManager(tiny, CheckpointSettings(store=inprocess_store))
    gens = checkpoints.generations
    base = prefix_key(checkpoints.prefixes.scope("default", list(tiny.layout)), PROMPT)
    try:
        kept_generation(tiny, checkpoints, PROMPT, tokens=20, rid="first")
        with StoreClient(inprocess_store) as store:
            store.admin_delete(base, force=True)
            request, key = kept_generation(
                tiny, checkpoints, PROMPT, tokens=60, rid="after", all_sent=False
            )
            meta = store.get_header(key).metadata
            assert "chain_base" not in meta and int(meta["chain_first"]) > 0
            whole = store.get_header(segment_key(key, int(meta["chain_first"])))
            assert int(whole.metadata["start"]) == 0
            (missing,) = store.get_headers([segment_key(key, 0)])
            assert missing.checkpoint is None  # the run on the base was never sent
        plan = gens.loads.load(key, "default", request.prompt, request.layout)
        assert plan.base is None
        continues_exactly(tiny, gens, plan, PROMPT)
    finally:
        checkpoints.close()


def test_a_chain_does_not_rest_on_another_engines_record_of_its_prompt(
    tiny: LoadedModel, inprocess_store: str
) -> None:
    """Two engines on one store prefill the same new prompt: the store keeps the first
    one's prefix record (if_absent), which does not hold the second row's bytes. The second
    engine's chain therefore starts over at position 0 rather than rest on it, and resumes
    exactly."""
    first = CheckpointManager(tiny, CheckpointSettings(store=inprocess_store))
    second = CheckpointManager(tiny, CheckpointSettings(store=inprocess_store))
    try:
        kept_generation(tiny, first, PROMPT, tokens=20, rid="first")
        request, key = kept_generation(
            tiny, second, PROMPT, tokens=60, rid="second", all_sent=False, planned=False
        )
        with StoreClient(inprocess_store) as store:
            meta = store.get_header(key).metadata
            assert "chain_base" not in meta and int(meta["chain_first"]) > 0
            (never,) = store.get_headers([segment_key(key, 0)])
            assert never.checkpoint is None  # the run resting on the other record
        gens = second.generations
        plan = gens.loads.load(key, "default", request.prompt, request.layout)
        assert plan.base is None
        continues_exactly(tiny, gens, plan, PROMPT)
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize(
    "record",
    [RecordFormat(bits=8), RecordFormat(bits=3, scheme=Scheme.TURBOQUANT)],
    ids=["affine8", "turboquant3"],
)
def test_a_chain_rests_on_a_compressed_record_it_restored_from_the_store(
    tiny: LoadedModel, inprocess_store: str, record: RecordFormat
) -> None:
    """A request keeping its prefix as a compressed record: the first engine's row computed the
    prompt's caches itself, which the compressed record does not hold, so its chain starts at
    position 0. A fresh engine's row restores the prompt from that record and holds its
    expansion bit for bit: its chain rests on the record, and the resume continues as the
    row did."""
    first = CheckpointManager(tiny, CheckpointSettings(store=inprocess_store))
    fresh = CheckpointManager(tiny, CheckpointSettings(store=inprocess_store))
    try:
        _, computed = kept_generation(tiny, first, PROMPT, tokens=20, rid="first", record=record)
        emitted: list[int] = []
        request, key = kept_generation(
            tiny, fresh, PROMPT, tokens=40, rid="again", record=record, emitted=emitted
        )
        base = prefix_key(fresh.prefixes.scope("default", request.layout, record), PROMPT)
        with StoreClient(inprocess_store) as store:
            assert "chain_base" not in store.get_header(computed).metadata
            meta = store.get_header(key).metadata
            assert meta["chain_base"] == base.hex()
            assert meta["base_tokens"] == str(len(PROMPT) - 1)
            assert int(store.get_header(segment_key(key, 0)).metadata["start"]) == len(PROMPT) - 1
        gens = fresh.generations
        plan = gens.loads.load(key, "default", request.prompt, request.layout)
        assert plan.base is not None and plan.base.key == base
        caches = gens.loads.materialize(plan)
        assert caches[0].offset == len(PROMPT) + len(plan.generated)
        assert plan.replay == emitted[: len(plan.replay)]
        # Not a cold prefill's continuation (the prefix is compressed): an uninterrupted row's
        # that restored the same record on a third engine.
        reference = CheckpointManager(tiny, CheckpointSettings(store=inprocess_store))
        try:
            ran = _run_to_end(tiny, reference, len(plan.replay) + 1, record=record, planned=True)
        finally:
            reference.close()
        assert ran.started.cached_prompt_tokens == len(PROMPT) - 1  # restored, as the row was
        assert ran.started.prefix_source.startswith("store")
        want = ran.tokens
        assert want[:-1] == plan.replay
        logits = tiny.model(mx.array([[plan.pending]]), cache=caches)
        assert mx.argmax(logits[0, -1]).item() == want[-1]
    finally:
        first.close()
        fresh.close()
