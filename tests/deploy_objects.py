"""The rendered deploy/ manifests as data: kubectl's kustomize, the servers' --help, and
lookups over the objects (tests/test_deploy.py checks them)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from tests.servers import ROOT

DEPLOY = ROOT / "deploy"
OVERLAYS = ["cpu", "nvidia"]
COMPONENTS = ["valkey-tier"]
# The oldest Kubernetes these manifests need (gRPC probes are GA in 1.27), and the newest
# the validator bundles.
OLDEST = (1, 27)
SERVERS = {
    "tandem-store": "store_service",
    "tandem-engine": "engine_service",
    "tandem-gateway": "gateway_service",
}
LISTEN_FLAGS = ("--listen", "--admin-listen", "--http-listen", "--grpc-listen", "--metrics-listen")
# Flags that name a file the pod must have (TLS ones too, for overlays that add TLS).
FILE_FLAGS = (
    "--auth-file",
    "--store-token-file",
    "--engine-token-file",
    "--tier-password-file",
    "--announce-password-file",
    "--discover-password-file",
    "--tls-cert",
    "--tls-key",
    "--tls-client-ca",
    "--store-tls-ca",
    "--store-tls-cert",
    "--store-tls-key",
    "--engine-tls-ca",
    "--tier-ca",
)
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet")
Obj = dict[str, Any]


def kubectl() -> str:
    """kubectl beside this interpreter (a wheel's), else on PATH. Never skipped: the
    deployment is only checked through kubectl's own kustomize."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    assert found, "kubectl is needed to render deploy/ (kubectl kustomize); none on PATH"
    return found


def render(directory: Path) -> list[Obj]:
    ran = subprocess.run(
        [kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    return [o for o in yaml.safe_load_all(ran.stdout) if o]


def help_text(command: str) -> str:
    ran = subprocess.run(
        [sys.executable, "-m", SERVERS[command], "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    return ran.stdout


def all_objects(renders: dict[str, list[Obj]]) -> Iterator[tuple[str, Obj]]:
    for name, objects in renders.items():
        for o in objects:
            yield name, o


def pod_spec(o: Obj) -> Obj:
    spec: Obj = o["spec"]["template"]["spec"]
    return spec


def server_containers(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(workload, container) for every container that runs a Tandem server."""
    for o in objects:
        if o["kind"] in WORKLOADS:
            for c in pod_spec(o)["containers"]:
                if c.get("command", [""])[0] in SERVERS:
                    yield o, c


def container_args(c: Obj) -> dict[str, list[str]]:
    """The container's flags and their values (`--flag=value` or `--flag value`)."""
    flags: dict[str, list[str]] = {}
    args = list(c.get("args", []))
    i = 0
    while i < len(args):
        assert args[i].startswith("--"), f"{c['name']}: a stray argument {args[i]!r}"
        flag, eq, value = args[i].partition("=")
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 1
        flags.setdefault(flag, []).append(value)
        i += 1
    return flags


def one_object(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def selects(selector: dict[str, str], workload: Obj) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container_port(container: Obj, ref: int | str) -> int:
    """A port named or numbered in a probe or a Service, as a containerPort of container."""
    for p in container.get("ports", []):
        if ref in (p["containerPort"], p.get("name")):
            return int(p["containerPort"])
    raise AssertionError(f"{container['name']}: no containerPort {ref!r}")


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)
