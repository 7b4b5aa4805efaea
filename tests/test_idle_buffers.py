"""The engine loop's idle release (loop/idle_buffers.py): MLX's cached buffers, then the
device pool's kept memory, go back once the loop has been idle a while; not while busy."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine_service.loop import idle_buffers
from engine_service.loop.idle_buffers import IdleBuffers


def test_the_device_pool_is_trimmed_after_mlx_buffers_when_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    released: list[str] = []
    monkeypatch.setattr(mx, "clear_cache", lambda: released.append("mlx"))
    monkeypatch.setattr(idle_buffers, "IDLE_RELEASE_S", 0.0)
    buffers = IdleBuffers(lambda: released.append("pool"))
    assert not buffers.tick(idle=False)
    assert buffers.tick(idle=True)  # the turn it became idle: nothing goes back yet
    assert released == []
    buffers.tick(idle=True)
    assert released == ["mlx", "pool"]
    buffers.tick(idle=True)  # once per idle spell
    assert released == ["mlx", "pool"]
    buffers.tick(idle=False)
    buffers.tick(idle=True)
    buffers.tick(idle=True)
    assert released == ["mlx", "pool", "mlx", "pool"]
