"""The order test files start in: the longest first.

`make test` runs two pytest-xdist workers, a file to each at a time (`--dist loadfile`),
taking files in collection order (`--no-loadscope-reorder`: xdist would otherwise start
with the files of the most tests). Started longest first, the last files to finish are
short ones, so neither worker waits long for the other at the end (the LPT rule).

The seconds are one file's setup + calls + teardown in a suite run on 2 cores
(`pytest --durations=0`, 2026-12-03); a file not listed counts as short. They only order
the run: a stale figure costs seconds of wall time, never a result.
"""

from __future__ import annotations

import pytest

SECONDS = {
    "test_checkpoints.py": 111,
    "test_engine_backpressure.py": 58,
    "test_docs_examples.py": 55,
    "test_speculative_rows.py": 42,
    "test_model_zoo.py": 38,
    "test_engine_zoo_processes.py": 34,
    "test_quantized_kv.py": 33,
    "test_turboquant_rows.py": 32,
    "test_tier.py": 30,
    "test_security.py": 30,
    "test_quantized_ring.py": 30,
    "test_model_zoo_more.py": 27,
    "test_cli.py": 27,
    "test_gateway_failover.py": 26,
    "test_gateway_pair.py": 25,
    "test_cli_up.py": 60,
    "test_prefix_reuse_recurrent.py": 24,
    "test_engine_core.py": 24,
    "test_speculative_batch.py": 23,
    "test_speculative.py": 23,
    "test_structured_output.py": 21,
    "test_packaging.py": 21,
    "test_engine_control.py": 20,
    "test_tier_nodes.py": 18,
    "test_registry.py": 18,
    "test_faults.py": 18,
    "test_restore_faults.py": 17,
    "test_metrics.py": 16,
    "test_gateway.py": 16,
    "test_engine_models.py": 14,
    "test_architecture.py": 14,
    "test_gateway_backpressure.py": 13,
    "test_store_regions.py": 12,
    "test_node_client.py": 12,
    "test_engine_turns.py": 12,
    "test_gateway_health.py": 19,
    "test_openai_surface.py": 14,
    "test_tool_calls.py": 16,
    "test_sampling_penalties.py": 11,
}


def heaviest_first(items: list[pytest.Item]) -> None:
    """Reorders items in place: files by their seconds, longest first; a file's own tests
    keep their order (the sort is stable)."""
    items.sort(key=lambda item: -SECONDS.get(item.path.name, 0))
