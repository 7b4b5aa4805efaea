"""`tandem up` (what `make run` runs): both services start, a demo streams, both stop cleanly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.servers import ROOT, ServiceProcess


def _up(tmp_path: Path, engine_data_dir: Path) -> list[str]:
    """`tandem up` on free ports in a data directory of this test's own, reusing the models
    the session's engine built (so the test doesn't rebuild them)."""
    data_dir = tmp_path / "up"
    data_dir.mkdir()
    (data_dir / "models").symlink_to(engine_data_dir / "models", target_is_directory=True)
    return [
        sys.executable,
        "-u",
        "-m",
        "tandem_client.cli",
        "up",
        "--data-dir",
        str(data_dir),
        "--store-port",
        "0",
        "--engine-port",
        "0",
    ]


def test_tandem_up_streams_a_demo_and_stops_cleanly(
    tmp_path: Path, engine_data_dir: Path, engine: ServiceProcess
) -> None:
    result = subprocess.run(
        [
            *_up(tmp_path, engine_data_dir),
            "--exit-after-demo",
            "--demo-tokens",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("starting the store and the engine")
    assert lines[1].startswith("store  listening on 127.0.0.1:")
    assert lines[2].startswith("engine listening on 127.0.0.1:")
    assert lines[3].startswith("model  tandem-tiny@sha256:")
    assert "trained here" in lines[4] and "--model mlx-community/" in lines[5]
    assert lines[6].startswith("demo   def read_lines(path):")
    assert "[length: 12 tokens" in result.stdout
    assert lines[-1] == "stopped (engine exit 0, store exit 0)"


def test_tandem_up_with_engines_starts_the_gateway_in_front(
    tmp_path: Path, engine_data_dir: Path, engine: ServiceProcess
) -> None:
    result = subprocess.run(
        [
            *_up(tmp_path, engine_data_dir),
            "--engines",
            "2",
            "--gateway-grpc-port",
            "0",
            "--gateway-http-port",
            "0",
            "--exit-after-demo",
            "--demo-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].startswith("store  listening on 127.0.0.1:")
    assert lines[2].startswith("engine listening on 127.0.0.1:")
    assert lines[3].startswith("engine listening on 127.0.0.1:")
    assert lines[4].startswith("gateway grpc listening on 127.0.0.1:")
    assert lines[5].startswith("gateway http listening on http://127.0.0.1:")
    assert "[length: 8 tokens" in result.stdout
    assert lines[-1] == ("stopped (gateway exit 0, engine exit 0, engine exit 0, store exit 0)")


def test_ctrl_c_shows_the_drain_and_a_second_stops_at_once(
    tmp_path: Path, engine_data_dir: Path, engine: ServiceProcess
) -> None:
    import signal
    import time

    proc = subprocess.Popen(
        [
            *_up(tmp_path, engine_data_dir),
            "--demo-tokens",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("serving;"):
            break
    proc.send_signal(signal.SIGINT)
    drain = proc.stdout.readline()
    assert drain.startswith("draining (0 running, 0 queued;"), lines + [drain]
    assert "Ctrl-C again stops at once" in drain
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)  # the second: no waiting for graces
    out, _ = proc.communicate(timeout=60)
    assert time.monotonic() - started < 10
    assert out.strip().splitlines()[-1].startswith("stopped (engine exit")
