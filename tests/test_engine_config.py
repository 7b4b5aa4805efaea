"""The engine's command line: defaults, switches and refusals (in-process)."""

from __future__ import annotations

import pytest

from engine_service.config import parse_args


def test_the_compiled_decode_step_is_on_for_small_batches_by_default() -> None:
    config = parse_args([])
    assert config.compiled_decode and config.compiled_decode_max_batch == 8
    assert parse_args(["--compiled-decode-max-batch", "32"]).compiled_decode_max_batch == 32
    assert not parse_args(["--no-compiled-decode"]).compiled_decode


def test_the_environment_turns_switches_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_ENGINE_COMPILED_DECODE", "0")
    monkeypatch.setenv("TANDEM_ENGINE_COMPILED_DECODE_MAX_BATCH", "4")
    config = parse_args([])
    assert not config.compiled_decode and config.compiled_decode_max_batch == 4


def test_a_negative_bound_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--compiled-decode-max-batch", "-1"])
    assert exited.value.code == 2
    assert "--compiled-decode-max-batch must be >= 0" in capsys.readouterr().err
