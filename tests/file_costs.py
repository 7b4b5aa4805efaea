"""The order test files start in: the longest first.

`make test` runs two pytest-xdist workers, a file to each at a time (`--dist loadfile`),
taking files in collection order (`--no-loadscope-reorder`: xdist would otherwise start
with the files of the most tests). Started longest first, the last files to finish are
short ones, so neither worker waits long for the other at the end (the LPT rule).

The seconds are one file's setup + calls + teardown in a suite run on 2 cores
(`pytest --durations=0`, 2026-12-06, 649 tests); a file not listed counts as short. They
only order the run: a stale figure costs seconds of wall time, never a result.
"""

from __future__ import annotations

import pytest

SECONDS = {
    "test_checkpoints.py": 73,
    "test_docs_examples.py": 50,
    "test_determinism.py": 49,
    "test_tier.py": 41,
    "test_cli_up.py": 38,
    "test_engine_backpressure.py": 37,
    "test_model_zoo.py": 37,
    "test_model_zoo_more.py": 33,
    "test_quantized_kv.py": 31,
    "test_turboquant_rows.py": 30,
    "test_engine_zoo_processes.py": 30,
    "test_cuda_kernels.py": 29,
    "test_speculative_rows.py": 29,
    "test_cli.py": 26,
    "test_quantized_ring.py": 24,
    "test_packaging.py": 22,
    "test_speculative_batch.py": 22,
    "test_speculative.py": 22,
    "test_tier_nodes.py": 21,
    "test_security.py": 21,
    "test_gateway_failover.py": 19,
    "test_registry.py": 18,
    "test_gateway_pair.py": 17,
    "test_tool_calls.py": 16,
    "test_structured_output.py": 15,
    "test_store_regions.py": 15,
    "test_faults.py": 14,
    "test_restore_faults.py": 14,
    "test_engine_core.py": 14,
    "test_engine_domain.py": 14,
    "test_engine_turns.py": 13,
    "test_prefix_reuse_recurrent.py": 13,
    "test_gateway.py": 12,
    "test_metrics.py": 12,
    "test_store_memory.py": 11,
    "test_openai_surface.py": 10,
    "test_training_ranks.py": 10,
    "test_engine_control.py": 10,
    "test_node_client.py": 10,
    "test_checkpoint_codec.py": 10,
    "test_gateway_backpressure.py": 9,
    "test_engine_models.py": 9,
    "test_store_domain.py": 9,
    "test_architecture.py": 8,
    "test_chain_base.py": 8,
    "test_store_recovery.py": 7,
    "test_store_direct_reads.py": 7,
    "test_sampling_penalties.py": 7,
    "test_store_data.py": 7,
    "test_store_integrity.py": 7,
    "test_logs.py": 6,
    "test_constraint_masks.py": 6,
    "test_gateway_health.py": 6,
    "test_store_region_restart.py": 6,
    "test_turboquant.py": 6,
    "test_transformers_import.py": 6,
    "test_store_region_trust.py": 5,
    "test_store_writer_role.py": 5,
    "test_store_put_records.py": 5,
    "test_engine_generate.py": 5,
}


def heaviest_first(items: list[pytest.Item]) -> None:
    """Reorders items in place: files by their seconds, longest first; a file's own tests
    keep their order (the sort is stable)."""
    items.sort(key=lambda item: -SECONDS.get(item.path.name, 0))
