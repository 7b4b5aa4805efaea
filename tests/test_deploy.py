"""The Kubernetes deployment (deploy/, docs/deploy.md), checked without a cluster.

Every overlay is rendered by kubectl's own kustomize, alone and with the Valkey tier
component; every rendered object validates against the Kubernetes JSON schemas
(kubernetes-validate, offline, strict: an unknown field fails). Then what the manifests ask
of the servers is checked against the servers: each flag is in that server's --help and its
real parser takes the args, each listen port is a containerPort and the reverse, probes and
Services name ports that exist, the engines' store and the gateways' engines are Services
that select those pods, Secrets mount the files the flags name, and the pods run as the
Dockerfile's user. No cluster runs here and the image is not built (docs/deploy.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]

from tandem_wire.auth import parse_auth_file
from tandem_wire.tls import check_exposure
from tests.deploy_objects import (
    COMPONENTS,
    DEPLOY,
    FILE_FLAGS,
    LISTEN_FLAGS,
    OLDEST,
    OVERLAYS,
    SERVERS,
    WORKLOADS,
    Obj,
    all_objects,
    container_args,
    container_port,
    help_text,
    host_port,
    one_object,
    pod_spec,
    render,
    selects,
    server_containers,
)
from tests.servers import ROOT


@pytest.fixture(scope="module")
def renders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    """Each overlay, alone and with each component: {"cpu": [...], "cpu+valkey-tier": ...}."""
    dirs = {o: DEPLOY / "overlays" / o for o in OVERLAYS}
    for overlay in OVERLAYS:
        for component in COMPONENTS:
            # A kustomization of the user's own, as docs/deploy.md shows: kustomize takes
            # only relative paths to other roots.
            d = tmp_path_factory.mktemp(f"{overlay}-{component}")
            rel = os.path.relpath(DEPLOY, d)
            (d / "kustomization.yaml").write_text(
                "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
                f"resources: [{rel}/overlays/{overlay}]\n"
                f"components: [{rel}/components/{component}]\n"
            )
            dirs[f"{overlay}+{component}"] = d
    with ThreadPoolExecutor(len(dirs)) as pool:
        return dict(zip(dirs, pool.map(render, dirs.values()), strict=True))


@pytest.fixture(scope="module")
def help_flags() -> dict[str, set[str]]:
    with ThreadPoolExecutor(len(SERVERS)) as pool:
        texts = dict(zip(SERVERS, pool.map(help_text, SERVERS), strict=True))
    return {c: set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", t)) for c, t in texts.items()}


def test_every_overlay_renders_valid_kubernetes_objects(renders: dict[str, list[Obj]]) -> None:
    versions = kubernetes_validate.utils.all_versions()
    oldest = next(v for v in versions if tuple(map(int, v.split(".")[:2])) >= OLDEST)
    distinct = {}
    for name, objects in renders.items():
        kinds = sorted(o["kind"] for o in objects)
        assert kinds == sorted(
            ["Namespace", "DaemonSet", "Deployment", "Deployment", "Service", "Service"]
            + ["Service", "PodDisruptionBudget", "PodDisruptionBudget"]
            + ["HorizontalPodAutoscaler"]
        ), name
        for o in objects:
            distinct[json.dumps(o, sort_keys=True)] = o  # the renders share most objects
            if o["kind"] != "Namespace":
                assert o["metadata"]["namespace"] == "tandem", (name, o["metadata"])
    for o in distinct.values():
        for version in (oldest, versions[-1]):
            assert kubernetes_validate.validate(o, version, strict=True)
    # The validator does refuse a misspelled field, so the passes above mean something.
    store = one_object(renders["cpu"], "DaemonSet", "tandem-store")
    broken = json.loads(json.dumps(store))
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, oldest, strict=True)


def test_every_flag_is_the_servers_own(
    renders: dict[str, list[Obj]], help_flags: dict[str, set[str]], tmp_path: Path
) -> None:
    # --engines-dns is the gateway's way to its engines here: it must be a real flag.
    assert "--engines-dns" in help_flags["tandem-gateway"]
    from engine_service.config import parse_args as engine_args
    from gateway_service.config import parse_args as gateway_args
    from store_service.config import parse_args as store_args

    parsers: dict[str, Callable[[list[str]], Any]] = {
        "tandem-store": store_args,
        "tandem-engine": engine_args,
        "tandem-gateway": gateway_args,
    }
    seen = set()
    for name, objects in renders.items():
        for _, c in server_containers(objects):
            command = c["command"][0]
            seen.add(command)
            assert len(c["command"]) == 1, c["command"]
            flags = container_args(c)
            unknown = set(flags) - help_flags[command]
            assert not unknown, f"{name} {command}: not in its --help: {sorted(unknown)}"
            # The real parser takes the values; the files it opens (the tier's password)
            # stand in tmp_path, where the pod has its Secrets.
            args = [_stand_in(a, tmp_path) for a in c["args"]]
            config = parsers[command](args)
            # Every listener on all interfaces (probes and Services reach the pod's IP), and
            # none without auth: what the server itself refuses (tandem_wire/tls.py).
            listens = [v for f in LISTEN_FLAGS if f != "--metrics-listen" for v in flags.get(f, [])]
            assert listens and all(host_port(a)[0] == "0.0.0.0" for a in listens), listens
            assert "--insecure-no-auth" not in flags
            assert flags["--auth-file"] == ["/etc/tandem/auth/auth.json"]
            check_exposure(command, listens, bool(config.auth_file), config.insecure_no_auth)
    assert seen == set(SERVERS)


def _stand_in(arg: str, tmp_path: Path) -> str:
    flag, eq, path = arg.partition("=")
    if flag not in FILE_FLAGS or not eq:
        return arg
    stand_in = tmp_path / path.lstrip("/")
    stand_in.parent.mkdir(parents=True, exist_ok=True)
    stand_in.write_text("stand-in")
    return f"{flag}={stand_in}"


def test_ports_probes_and_services_agree(renders: dict[str, list[Obj]]) -> None:
    for name, objects in renders.items():
        for workload, c in server_containers(objects):
            flags = container_args(c)
            listened = {host_port(v)[1] for f in LISTEN_FLAGS for v in flags.get(f, [])}
            declared = {p["containerPort"] for p in c["ports"]}
            assert listened == declared, (name, c["name"], listened, declared)
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if probe is None:
                    continue
                (how,) = {"grpc", "tcpSocket", "httpGet"} & set(probe)
                container_port(c, probe[how]["port"])
            annotations = workload["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/scrape"] == "true"
            (metrics,) = flags["--metrics-listen"]
            assert int(annotations["prometheus.io/port"]) == host_port(metrics)[1]
        for service in (o for o in objects if o["kind"] == "Service"):
            selector = service["spec"]["selector"]
            backends = [o for o in objects if o["kind"] in WORKLOADS and selects(selector, o)]
            assert len(backends) == 1, (name, service["metadata"]["name"])
            (container,) = pod_spec(backends[0])["containers"]
            for p in service["spec"]["ports"]:
                container_port(container, p["targetPort"])


def test_probes_say_what_each_server_means(renders: dict[str, list[Obj]]) -> None:
    for name, objects in renders.items():
        by_command = {c["command"][0]: c for _, c in server_containers(objects)}
        store, engine, gateway = (by_command[c] for c in SERVERS)
        assert store["readinessProbe"]["grpc"]["service"] == "tandem.v1.Store"
        assert engine["readinessProbe"]["grpc"]["service"] == "tandem.v1.Engine"
        for c in (store, engine):
            assert "service" not in c["livenessProbe"]["grpc"]  # "": the process
            assert "service" not in c["startupProbe"]["grpc"]
        # The engine binds its port only after loading its model: startup covers that, and
        # liveness waits out a core restart (NOT_SERVING meanwhile) for minutes.
        startup = engine["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, name
        live = engine["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= 120, name
        # The gateway's gRPC health is NOT_SERVING while no engine serves: right for
        # readiness, wrong for liveness (a restart brings no engine back).
        assert gateway["readinessProbe"]["grpc"]["port"] == 50050
        assert set(gateway["livenessProbe"]) & {"tcpSocket", "grpc", "httpGet"} == {"tcpSocket"}


def test_engines_find_their_store_and_gateways_their_engines(
    renders: dict[str, list[Obj]],
) -> None:
    for name, objects in renders.items():
        store = one_object(objects, "DaemonSet", "tandem-store")
        engine = one_object(objects, "Deployment", "tandem-engine")
        gateway = one_object(objects, "Deployment", "tandem-gateway")
        (engine_c,) = pod_spec(engine)["containers"]
        (store_c,) = pod_spec(store)["containers"]
        (gateway_c,) = pod_spec(gateway)["containers"]
        # The engine's --store: a Service that keeps traffic on the node, to the store pods.
        (address,) = container_args(engine_c)["--store"]
        host, port = host_port(address)
        service = one_object(objects, "Service", host)
        assert service["spec"]["internalTrafficPolicy"] == "Local"
        assert selects(service["spec"]["selector"], store)
        (sp,) = [p for p in service["spec"]["ports"] if p["port"] == port]
        assert (
            container_port(store_c, sp["targetPort"])
            == host_port(container_args(store_c)["--listen"][0])[1]
        )
        # A store on every node an engine may land on: its nodeSelector asks no more than the
        # engines', and it tolerates every taint they do.
        store_pod, engine_pod = pod_spec(store), pod_spec(engine)
        asked = store_pod.get("nodeSelector", {}).items()
        assert asked <= engine_pod.get("nodeSelector", {}).items(), name
        for toleration in engine_pod.get("tolerations", []):
            assert toleration in store_pod.get("tolerations", []), (name, toleration)
        # The gateway's --engines-dns: a headless Service of the engine pods, on their port.
        (dns,) = container_args(gateway_c)["--engines-dns"]
        host, port = host_port(dns)
        headless = one_object(objects, "Service", host)
        assert headless["spec"]["clusterIP"] == "None"
        assert not headless["spec"].get("publishNotReadyAddresses", False)
        assert selects(headless["spec"]["selector"], engine)
        assert port == host_port(container_args(engine_c)["--listen"][0])[1]
        assert not {"--engine", "--engines-file"} & set(container_args(gateway_c))
        # Gateways: 2 at least (HPA), a PDB that keeps one, both on the gateway pods.
        hpa = one_object(objects, "HorizontalPodAutoscaler", "tandem-gateway")
        assert hpa["spec"]["scaleTargetRef"]["name"] == "tandem-gateway"
        assert hpa["spec"]["minReplicas"] >= 2 and "replicas" not in gateway["spec"]
        assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
        pdb = one_object(objects, "PodDisruptionBudget", "tandem-gateway")
        assert pdb["spec"]["minAvailable"] == 1
        assert selects(pdb["spec"]["selector"]["matchLabels"], gateway)
        engine_pdb = one_object(objects, "PodDisruptionBudget", "tandem-engine")
        assert selects(engine_pdb["spec"]["selector"]["matchLabels"], engine)
        # SIGTERM drains for --grace: the kubelet must wait longer before its SIGKILL.
        for workload, c in server_containers(objects):
            grace = float(container_args(c).get("--grace", ["0"])[0])
            assert pod_spec(workload)["terminationGracePeriodSeconds"] > grace, name


def _secrets_example() -> dict[str, Obj]:
    text = (DEPLOY / "base" / "secrets.example.yaml").read_text()
    return {o["metadata"]["name"]: o for o in yaml.safe_load_all(text) if o}


def test_every_file_a_flag_names_is_mounted_from_a_secret(renders: dict[str, list[Obj]]) -> None:
    secrets = _secrets_example()
    for o in secrets.values():
        kubernetes_validate.validate(o, kubernetes_validate.latest_version(), strict=True)
    used = set()
    for name, objects in renders.items():
        for workload, c in server_containers(objects):
            volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
            flags = container_args(c)
            for flag in FILE_FLAGS:
                for path in flags.get(flag, []):
                    mounts = [
                        m for m in c["volumeMounts"] if Path(path).parent == Path(m["mountPath"])
                    ]
                    assert len(mounts) == 1, (name, c["name"], flag, path)
                    assert mounts[0].get("readOnly") is True
                    secret = volumes[mounts[0]["name"]]["secret"]["secretName"]
                    assert Path(path).name in secrets[secret]["stringData"], (secret, path)
                    used.add(secret)
            # Each workload mounts its own Secret only (and the tier's, with the tier).
            for v in volumes.values():
                if "secret" in v:
                    assert v["secret"]["secretName"] in secrets
    assert used == set(secrets)  # no example Secret nobody mounts


def test_make_secrets_writes_what_the_secrets_hold(tmp_path: Path) -> None:
    out = tmp_path / "secrets"
    script = [sys.executable, str(DEPLOY / "make-secrets.py"), str(out)]
    ran = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    example = _secrets_example()
    for folder in ("store", "engine", "gateway"):
        keys = sorted(p.name for p in (out / folder).iterdir())
        assert keys == sorted(example[f"tandem-{folder}-auth"]["stringData"]), folder
        assert f"tandem-{folder}-auth --from-file={out / folder}/" in ran.stdout
        for p in (out / folder).iterdir():
            assert p.stat().st_mode & 0o777 == 0o600
    assert (out / "engine" / "auth.json").read_text() == (out / "gateway" / "auth.json").read_text()

    def token(path: Path) -> str:
        return hashlib.sha256(path.read_text().strip().encode()).hexdigest()

    def roles(auth: Path) -> dict[str, set[str]]:
        return {p.token_sha256: {r.value for r in p.roles} for p in parse_auth_file(auth)}

    store, api = roles(out / "store" / "auth.json"), roles(out / "engine" / "auth.json")
    assert store[token(out / "engine" / "store.token")] == {"store"}  # nothing more
    assert api[token(out / "gateway" / "engine.token")] == {"generate", "admin"}
    assert api[token(out / "client.token")] == {"generate"}
    assert "admin" in store[token(out / "ops.token")] and "admin" in api[token(out / "ops.token")]
    tokens = [p.read_text() for p in out.rglob("*.token")]
    assert len(set(tokens)) == 4 and all(len(t) >= 43 for t in tokens)
    again = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "exists" in again.stderr  # never replaces tokens in use


def test_pods_are_locked_down_and_run_as_the_images_user(renders: dict[str, list[Obj]]) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    (uid,) = re.findall(r"^USER (\d+):\d+$", dockerfile, re.M)
    for name, o in all_objects(renders):
        labels = o["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "tandem", (name, o["kind"])
        assert labels["app.kubernetes.io/component"], (name, o["kind"])
        if o["kind"] not in WORKLOADS:
            continue
        template = o["spec"]["template"]
        assert (
            template["metadata"]["labels"]["app.kubernetes.io/component"]
            == labels["app.kubernetes.io/component"]
        )
        pod = template["spec"]
        assert pod["automountServiceAccountToken"] is False
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True and str(ctx["runAsUser"]) == uid
        assert ctx["seccompProfile"]["type"] == "RuntimeDefault"
        for c in pod.get("initContainers", []) + pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
            assert "memory" in c["resources"]["limits"], c["name"]
            if c["name"] == "store-data-owner":
                # The one root container: chowns the node's store directory, nothing else.
                assert sc["capabilities"]["add"] == ["CHOWN", "FOWNER"]
                assert f"chown {uid}:{uid} /var/lib/tandem/store" in c["command"][-1]
            else:
                assert "add" not in sc["capabilities"] and "runAsUser" not in sc, c["name"]
    # No hostNetwork, hostPort or privileged container; the store's hostPath is the one.
    text = json.dumps(renders)
    assert "hostNetwork" not in text and "hostPort" not in text
    assert '"privileged": true' not in text
    for name, objects in renders.items():
        host_paths = [
            v["hostPath"]["path"]
            for o in objects
            if o["kind"] in WORKLOADS
            for v in pod_spec(o)["volumes"]
            if "hostPath" in v
        ]
        assert host_paths == ["/var/lib/tandem/store"], name


def test_the_overlays_pick_their_image_variant_and_hardware(renders: dict[str, list[Obj]]) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    variants = set(re.findall(r"^\s+(\w+)\) extra=", dockerfile, re.M))
    assert variants == {"cpu", "cuda"}
    assert re.search(r"^ARG VARIANT=cpu$", dockerfile, re.M)
    for name, objects in renders.items():
        variant = "cuda" if name.startswith("nvidia") else "cpu"
        images = {
            c["image"]
            for o in objects
            if o["kind"] in WORKLOADS
            for c in pod_spec(o).get("initContainers", []) + pod_spec(o)["containers"]
        }
        assert images == {f"registry.example.com/tandem:0.1.0-{variant}"}, name
        engine = one_object(objects, "Deployment", "tandem-engine")
        (c,) = pod_spec(engine)["containers"]
        gpus = c["resources"]["limits"].get("nvidia.com/gpu")
        if variant == "cuda":
            assert gpus == 1
            assert pod_spec(engine)["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            assert {
                "key": "nvidia.com/gpu",
                "operator": "Exists",
                "effect": "NoSchedule",
            } in pod_spec(engine)["tolerations"]
            assert engine["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
        else:
            assert gpus is None and "nodeSelector" not in pod_spec(engine)
            env = {e["name"]: e["value"] for e in c["env"]}
            # OpenBLAS threads: the engine's CPUs, not the node's.
            assert env["OPENBLAS_NUM_THREADS"] == c["resources"]["limits"]["cpu"]
        tiered = name.endswith("+valkey-tier")
        (store_c,) = pod_spec(one_object(objects, "DaemonSet", "tandem-store"))["containers"]
        tier = container_args(store_c).get("--tier", [])
        assert tier == (["valkey://tandem@valkey-cluster:6379"] if tiered else []), name


def test_the_docs_walk_through_what_is_deployed() -> None:
    doc = (ROOT / "docs" / "deploy.md").read_text()
    for secret in _secrets_example():
        assert secret in doc, secret
    for overlay in OVERLAYS:
        assert f"kubectl apply -k deploy/overlays/{overlay}" in doc
    for component in COMPONENTS:
        assert f"../../components/{component}" in doc
    assert "--build-arg VARIANT=cuda" in doc and "0.1.0-cuda" in doc and "0.1.0-cpu" in doc
