"""The engine's command line: defaults, switches and refusals (in-process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_service.config import names_a_directory, parse_args
from tests.servers import run_module


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


@pytest.mark.parametrize(
    ("flag", "spec"),
    [("--model", "./my-mlx-model"), ("--model", "~/none"), ("--draft-model", "/models/a/b")],
)
def test_a_model_directory_that_is_not_there_is_one_line(
    flag: str, spec: str, tmp_path: Path
) -> None:
    """Never a hub lookup of a path: the engine exits at once with one line naming it,
    before it spawns its core."""
    ran = run_module("engine_service", flag, spec, "--data-dir", str(tmp_path))
    assert ran.returncode == 2
    assert f"{flag}: no model directory at {spec}" in ran.stderr
    assert "Traceback" not in ran.stderr


def test_what_names_a_directory() -> None:
    for path in ("./m", "../m", "/m", "~/m", ".", "a/b/c"):
        assert names_a_directory(path), path
    for name in ("mlx-community/Qwen3-0.6B-4bit", "tandem-tiny", "Qwen3"):
        assert not names_a_directory(name), name
