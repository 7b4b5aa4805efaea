"""Security with real processes: principals from an auth file, server-side tenancy, StoreAdmin
on its own port, mTLS, engine <-> store over TLS with a token, exposure refused, SIGHUP reload.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from tandem_client import Checkpoint, EngineClient, StoreClient, Tensor
from tandem_client.aio import AsyncEngineClient, AsyncStoreClient
from tandem_client.credentials import tls_credentials
from tandem_client.errors import TandemError
from tandem_client.store_client import bulk_methods, put_messages
from tandem_wire.auth import token_sha256
from tandem_wire.pb import engine_pb2, engine_pb2_grpc, store_pb2, store_pb2_grpc
from tests.pki import Pair, issue, make_ca
from tests.servers import ROOT, ServiceProcess, free_port, run_module, start_engine

TOKENS = {name: secrets.token_urlsafe(24) for name in ("acme", "beta", "ops", "engine", "gen")}
PRINCIPALS: dict[str, dict[str, Any]] = {
    "acme": {"namespaces": ["acme", "acme-*"], "roles": ["generate", "store"]},
    "beta": {"namespaces": ["beta"], "roles": ["generate", "store"]},
    "ops": {"namespaces": ["*"], "roles": ["admin", "store"]},
    "engine": {"namespaces": ["*"], "roles": ["store"]},
    "gen": {"namespaces": ["acme"], "roles": ["generate"]},  # no store role
}
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED


def write_auth_file(path: Path, names: list[str], extra: Sequence[dict[str, Any]] = ()) -> Path:
    principals = [
        {"name": n, "token_sha256": token_sha256(TOKENS[n]), **PRINCIPALS[n]} for n in names
    ]
    path.write_text(json.dumps({"principals": [*principals, *extra]}))
    return path


def bearer(name: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {TOKENS[name]}")]


WRONG = [("authorization", "Bearer not-a-token")]


def code_of(call: Callable[[], Any]) -> grpc.StatusCode:
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def status(
    call: Callable[[list[tuple[str, str]]], Any], metadata: list[tuple[str, str]]
) -> grpc.StatusCode:
    """The status of one call made with this metadata."""
    return code_of(lambda: call(metadata))


def _wait_for(what: str, done: Callable[[], bool], timeout: float = 30.0) -> None:
    """Polls an observable condition until it holds; fails naming it after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout:g} s"
        time.sleep(0.02)


def _record(key: bytes, namespace: str = "") -> Checkpoint:
    data = b"secret of " + key
    return Checkpoint(
        key=key,
        namespace=namespace,
        kind="object",
        tensors=[Tensor("t", "uint8", (len(data),), data)],
    )


def _put_request(key: bytes, namespace: str) -> list[store_pb2.PutRequest | bytes]:
    return list(put_messages(_record(key, namespace), False, 0, "", 1 << 20))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pair]:
    d = tmp_path_factory.mktemp("pki")
    ca, other_ca = make_ca(d, "test-ca"), make_ca(d, "other-ca")
    return {
        "ca": ca,
        "server": issue(ca, d, "server", "localhost", "IP:127.0.0.1,DNS:localhost"),
        "engine-7": issue(ca, d, "engine-7", "engine-7"),
        "intruder": issue(other_ca, d, "intruder", "engine-7"),
    }


def _store(tmp_path: Path, *args: str, tls_root: bytes | None = None) -> ServiceProcess:
    proc = ServiceProcess(
        "store_service",
        ["--data-dir", str(tmp_path / "store"), *args],
        "tandem-store listening on",
        tmp_path / "store.log",
    )
    proc.tls_root = tls_root
    return proc


def test_store_rpcs_refuse_missing_wrong_foreign_and_roleless_credentials(
    tmp_path: Path,
) -> None:
    auth = write_auth_file(tmp_path / "auth.json", list(PRINCIPALS))
    admin_port = free_port()
    store = _store(
        tmp_path, "--auth-file", str(auth), "--admin-listen", f"127.0.0.1:{admin_port}"
    ).start()
    try:
        data = grpc.insecure_channel(store.address)
        admin = grpc.insecure_channel(f"127.0.0.1:{admin_port}")
        st, ad = store_pb2_grpc.StoreStub(data), store_pb2_grpc.StoreAdminStub(admin)
        raw_put, _, _ = bulk_methods(data)  # Put's chunks are hand-encoded bytes
        with StoreClient(store.address, token=TOKENS["acme"]) as acme:
            acme.put(_record(b"k1"))  # "" = acme's first namespace
            assert acme.get(b"k1", "acme").tensors[0].data == b"secret of k1"
        key, ns = b"k1", "acme"
        calls: dict[str, Callable[[list[tuple[str, str]]], Any]] = {
            "Put": lambda md: raw_put(iter(_put_request(key, ns)), metadata=md),
            "Get": lambda md: st.Get(store_pb2.GetRequest(namespace=ns, key=key), metadata=md),
            "Lookup": lambda md: st.Lookup(
                store_pb2.LookupRequest(
                    namespace=ns,
                    model_id="m",
                    layout=["kv:plain"],
                    block_size=16,
                    block_hashes=[b"\0" * 32],
                    token_count=16,
                ),
                metadata=md,
            ),  # fmt: skip
            "Pin": lambda md: st.Pin(store_pb2.PinRequest(namespace=ns, key=key), metadata=md),
            "Unpin": lambda md: st.Unpin(
                store_pb2.UnpinRequest(namespace=ns, key=key, lease_id="x"), metadata=md
            ),
        }
        admin_calls: dict[str, Callable[[list[tuple[str, str]]], Any]] = {
            "List": lambda md: ad.List(store_pb2.ListRequest(), metadata=md),
            "Inspect": lambda md: ad.Inspect(
                store_pb2.InspectRequest(namespace=ns, key=key), metadata=md
            ),
            "Delete": lambda md: ad.Delete(
                store_pb2.DeleteRequest(namespace=ns, key=key, force=True), metadata=md
            ),
            "Purge": lambda md: ad.Purge(store_pb2.PurgeRequest(include_pinned=True), metadata=md),
            "Stats": lambda md: ad.Stats(store_pb2.StatsRequest(), metadata=md),
            "Flush": lambda md: ad.Flush(store_pb2.FlushRequest(), metadata=md),
            "Compact": lambda md: ad.Compact(store_pb2.CompactRequest(), metadata=md),
        }
        for rpc, call in calls.items():
            assert status(call, []) == UNAUTHENTICATED, rpc
            assert status(call, WRONG) == UNAUTHENTICATED, rpc
            assert status(call, bearer("beta")) == DENIED, rpc  # another tenant
            assert status(call, bearer("gen")) == DENIED, rpc  # no store role
        flush = store_pb2.FlushRequest()  # data plane, no namespace: the store role is enough
        assert code_of(lambda: st.Flush(flush)) == UNAUTHENTICATED
        assert code_of(lambda: st.Flush(flush, metadata=WRONG)) == UNAUTHENTICATED
        assert code_of(lambda: st.Flush(flush, metadata=bearer("gen"))) == DENIED
        for rpc, call in admin_calls.items():
            assert status(call, []) == UNAUTHENTICATED, rpc
            assert status(call, WRONG) == UNAUTHENTICATED, rpc
            assert status(call, bearer("acme")) == DENIED, rpc  # no admin role
        # StoreAdmin is not served on the data port at all.
        admin_on_data = store_pb2_grpc.StoreAdminStub(data)
        listing = store_pb2.ListRequest()
        unserved = code_of(lambda: admin_on_data.List(listing, metadata=bearer("ops")))
        assert unserved == grpc.StatusCode.UNIMPLEMENTED

        # Nothing changed: the record is intact, its namespace the only one.
        with StoreClient(f"127.0.0.1:{admin_port}", token=TOKENS["ops"]) as ops:
            listed = ops.list_all()
            assert [(r.namespace, r.key) for r in listed] == [("acme", b"k1")]
            assert ops.stats().auth_failures >= 2 * (len(calls) + len(admin_calls)) + 2
        with StoreClient(store.address, token=TOKENS["ops"]) as ops_data:
            assert ops_data.get(b"k1", "acme").tensors[0].data == b"secret of k1"
        # The same key in beta's own namespace is simply not there (nothing says whether
        # acme has one).
        with StoreClient(store.address, token=TOKENS["beta"]) as beta:
            with pytest.raises(TandemError) as missing:
                beta.get(b"k1")
            assert missing.value.code == grpc.StatusCode.NOT_FOUND
            with pytest.raises(TandemError) as denied:
                beta.get(b"nonexistent", "acme")
            assert denied.value.code == DENIED

        # SIGHUP: a new principal is let in and a removed one shut out, live.
        TOKENS["new"] = secrets.token_urlsafe(24)
        PRINCIPALS["new"] = {"namespaces": ["new"], "roles": ["store"]}
        write_auth_file(auth, ["acme", "ops", "new"])
        assert store.proc is not None
        store.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while code_of(lambda: st.Get(store_pb2.GetRequest(key=b"x"), metadata=bearer("new"))) != (
            grpc.StatusCode.NOT_FOUND
        ):
            assert time.monotonic() < deadline, "the reload never took"
            time.sleep(0.1)
        get = store_pb2.GetRequest(key=b"x")
        assert code_of(lambda: st.Get(get, metadata=bearer("beta"))) == UNAUTHENTICATED
        # The same connection that held calls before the reload goes on working.
        k1 = store_pb2.GetRequest(key=b"k1")
        assert code_of(lambda: st.Get(k1, metadata=bearer("acme"))) == grpc.StatusCode.OK

        # A guesser is throttled past the failure budget; a good token is still let in.
        for _ in range(100):
            code_of(lambda: st.Get(get, metadata=WRONG))
        refused = st.Get(get, metadata=WRONG)
        with pytest.raises(grpc.RpcError) as throttled:
            list(refused)
        assert throttled.value.code() == UNAUTHENTICATED
        assert "too many failed" in (throttled.value.details() or "")
        assert code_of(lambda: st.Get(get, metadata=bearer("acme"))) == grpc.StatusCode.NOT_FOUND
        data.close()
        admin.close()
        assert TOKENS["acme"] not in store.log_path.read_text()
    finally:
        store.stop()


def test_mtls_identity_from_the_right_ca_only(tmp_path: Path, pki: dict[str, Pair]) -> None:
    extra = [
        {"name": "engine-7", "tls_subject": "CN=engine-7", "namespaces": ["*"], "roles": ["store"]}
    ]
    auth = write_auth_file(tmp_path / "auth.json", ["ops"], extra)
    server, ca = pki["server"], pki["ca"]
    store = _store(
        tmp_path,
        "--auth-file", str(auth),
        "--tls-cert", str(server.cert), "--tls-key", str(server.key),
        "--tls-client-ca", str(ca.cert),
        tls_root=ca.cert.read_bytes(),
    )  # fmt: skip
    good = pki["engine-7"]
    store.tls_client = (good.key.read_bytes(), good.cert.read_bytes())
    store.start()
    try:
        creds = tls_credentials(str(ca.cert), str(good.cert), str(good.key))
        with StoreClient(store.address, credentials=creds) as client:
            client.put(_record(b"m1", "fleet"))
            assert client.get(b"m1", "fleet").tensors[0].data == b"secret of m1"
        bad = pki["intruder"]  # the same name, signed by another CA
        creds = tls_credentials(str(ca.cert), str(bad.cert), str(bad.key))
        with StoreClient(store.address, credentials=creds, timeout=10) as client:
            with pytest.raises(TandemError) as refused:
                client.get(b"m1", "fleet")
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE  # the handshake fails
        no_cert = tls_credentials(str(ca.cert))
        with StoreClient(store.address, credentials=no_cert, timeout=10) as client:
            with pytest.raises(TandemError):
                client.get(b"m1", "fleet")
    finally:
        store.stop()


def test_engine_tenancy_and_engine_to_store_over_tls_with_a_token(
    tmp_path: Path, pki: dict[str, Pair], engine_data_dir: Path, engine: ServiceProcess
) -> None:
    auth = write_auth_file(tmp_path / "auth.json", list(PRINCIPALS))
    server, ca = pki["server"], pki["ca"]
    store = _store(
        tmp_path,
        "--auth-file", str(auth),
        "--tls-cert", str(server.cert), "--tls-key", str(server.key),
        tls_root=ca.cert.read_bytes(),
    ).start()  # fmt: skip
    token_file = tmp_path / "engine.token"
    token_file.write_text(TOKENS["engine"])
    eng = start_engine(
        engine_data_dir,
        "--auth-file", str(auth),
        "--store", store.address,
        "--store-tls-ca", str(ca.cert),
        "--store-token-file", str(token_file),
        log_dir=tmp_path,
    )  # fmt: skip
    try:
        channel = grpc.insecure_channel(eng.address)
        stub = engine_pb2_grpc.EngineStub(channel)
        gen = engine_pb2.GenerateRequest(token_ids=[5, 6, 7], max_tokens=2)
        calls: dict[str, Callable[[list[tuple[str, str]]], Any]] = {
            "Generate": lambda md: stub.Generate(gen, metadata=md),
            "Tokenize": lambda md: stub.Tokenize(
                engine_pb2.TokenizeRequest(text="hi"), metadata=md
            ),
            "Detokenize": lambda md: stub.Detokenize(
                engine_pb2.DetokenizeRequest(token_ids=[5]), metadata=md
            ),
            "ModelInfo": lambda md: stub.ModelInfo(engine_pb2.ModelInfoRequest(), metadata=md),
            "Cancel": lambda md: stub.Cancel(engine_pb2.CancelRequest(request_id="x"), metadata=md),
            "Stats": lambda md: stub.Stats(engine_pb2.EngineStatsRequest(), metadata=md),
            "Flush": lambda md: stub.Flush(engine_pb2.EngineFlushRequest(), metadata=md),
        }
        for rpc, call in calls.items():
            assert status(call, []) == UNAUTHENTICATED, rpc
            assert status(call, WRONG) == UNAUTHENTICATED, rpc
        for rpc in ("Stats", "Flush"):  # operators' RPCs need the admin role
            assert status(calls[rpc], bearer("acme")) == DENIED, rpc
        for rpc in ("Generate", "Tokenize", "ModelInfo"):  # and generation the generate role
            assert status(calls[rpc], bearer("engine")) == DENIED, rpc
        foreign = engine_pb2.GenerateRequest(token_ids=[5, 6], max_tokens=2, namespace="acme")
        assert code_of(lambda: stub.Generate(foreign, metadata=bearer("beta"))) == DENIED
        refused_stats = stub.Stats(engine_pb2.EngineStatsRequest(), metadata=bearer("ops"))
        assert refused_stats.requests_total == 0  # nothing refused reached the engine loop
        assert refused_stats.auth_failures == 2 * len(calls)

        prompt = [(i * 977) % 2000 + 3 for i in range(200)]
        with (
            EngineClient(eng.address, token=TOKENS["acme"]) as acme,
            EngineClient(eng.address, token=TOKENS["beta"]) as beta,
            EngineClient(eng.address, token=TOKENS["ops"]) as ops,
        ):
            acme.generate(prompt, max_tokens=2)
            again = acme.generate(prompt, max_tokens=2)
            assert (
                again.usage is not None and again.usage.cached_prompt_tokens > 0
            )  # acme's own prefix, reused
            other = beta.generate(prompt, max_tokens=2)
            assert (
                other.usage is not None and other.usage.cached_prompt_tokens == 0
            )  # never another tenant's

            # acme's generation, interrupted: beta can neither cancel nor resume it.
            options = dict(max_tokens=48, ignore_eos=True, checkpoint_interval=8, request_id="g1")
            cancelled_before = ops.stats().cancelled_total
            stream = acme.stream_request(acme.request(prompt[:40], **options))
            first = []
            for chunk in stream:
                first.extend(chunk.token_ids)
                if len(first) >= 20:
                    with pytest.raises(TandemError) as cancel:
                        beta.cancel("g1")
                    assert cancel.value.code == grpc.StatusCode.NOT_FOUND
                    break
            stream.close()  # a disconnect keeps the checkpoint

            def disconnect_seen() -> bool:  # the row freed: its last checkpoint is queued
                stats = ops.stats()
                return stats.cancelled_total > cancelled_before and stats.running == 0

            _wait_for("the engine freeing the disconnected row", disconnect_seen)
            assert ops.flush().durable  # checkpoints reached the TLS store with the token
            with pytest.raises(TandemError) as resume:
                beta.generate(prompt[:40], resume=True, **options)
            assert resume.value.code == grpc.StatusCode.NOT_FOUND
            resumed = acme.generate(prompt[:40], resume=True, **options)
            reference = acme.generate(prompt[:40], **{**options, "request_id": "ref"})
            assert resumed.token_ids == reference.token_ids
        # SIGHUP: beta is removed live; acme goes on.
        write_auth_file(auth, ["acme", "ops", "engine", "gen"])
        assert eng.proc is not None
        eng.proc.send_signal(signal.SIGHUP)
        info = engine_pb2.ModelInfoRequest()
        deadline = time.monotonic() + 30
        while code_of(lambda: stub.ModelInfo(info, metadata=bearer("beta"))) != UNAUTHENTICATED:
            assert time.monotonic() < deadline, "the engine never reloaded its auth file"
            time.sleep(0.1)
        assert code_of(lambda: stub.ModelInfo(info, metadata=bearer("acme"))) == grpc.StatusCode.OK
        channel.close()
    finally:
        eng.stop()
        store.stop()


def test_cli_against_a_tls_store_with_a_token(tmp_path: Path, pki: dict[str, Pair]) -> None:
    auth = write_auth_file(tmp_path / "auth.json", ["ops"])
    server, ca = pki["server"], pki["ca"]
    store = _store(
        tmp_path,
        "--auth-file", str(auth),
        "--tls-cert", str(server.cert), "--tls-key", str(server.key),
        tls_root=ca.cert.read_bytes(),
    ).start()  # fmt: skip
    token_file = tmp_path / "ops.token"
    token_file.write_text(TOKENS["ops"])
    try:
        with StoreClient(
            store.address, credentials=tls_credentials(str(ca.cert)), token=TOKENS["ops"]
        ) as ops:
            ops.put(_record(b"cli-key", "tools"))
        tls = ["--store", store.address, "--tls-ca", str(ca.cert)]
        listed = run_module(
            "tandem_client.cli", "ckpt", "ls", *tls, "--token-file", str(token_file), "--json"
        )
        assert listed.returncode == 0, listed.stderr
        assert b"cli-key".hex() in listed.stdout
        refused = run_module("tandem_client.cli", "ckpt", "ls", *tls, "--json")
        assert refused.returncode == 6 and "UNAUTHENTICATED" in refused.stderr
        assert TOKENS["ops"] not in refused.stderr + listed.stderr
    finally:
        store.stop()


def test_an_engine_refused_by_its_store_says_so_at_start(
    tmp_path: Path, engine_data_dir: Path, engine: ServiceProcess
) -> None:
    auth = write_auth_file(tmp_path / "auth.json", ["engine"])
    store = _store(tmp_path, "--auth-file", str(auth)).start()
    wrong = tmp_path / "wrong.token"
    wrong.write_text("not-the-engine-token")
    eng = start_engine(
        engine_data_dir, "--store", store.address, "--store-token-file", str(wrong),
        log_dir=tmp_path,
    )  # fmt: skip
    try:
        log = (tmp_path / "engine.log").read_text()
        assert f"the store at {store.address} refused or was unreachable" in log
        assert "UNAUTHENTICATED" in log and "not-the-engine-token" not in log
    finally:
        eng.stop()
        store.stop()


def test_non_loopback_listen_without_auth_is_refused(tmp_path: Path) -> None:
    for module, extra in (
        ("store_service", ["--data-dir", str(tmp_path / "s")]),
        ("engine_service", ["--data-dir", str(tmp_path / "e")]),
    ):
        out = run_module(module, "--listen", "0.0.0.0:0", *extra)
        assert out.returncode == 1, (module, out.stderr)
        assert "refusing to listen on 0.0.0.0:0 without --auth-file" in out.stderr, module


def test_node_client_with_a_token(
    tmp_path: Path, engine_data_dir: Path, engine: ServiceProcess
) -> None:
    TOKENS["all"] = secrets.token_urlsafe(24)
    PRINCIPALS["all"] = {"namespaces": ["*"], "roles": ["generate", "store", "admin"]}
    auth = write_auth_file(tmp_path / "auth.json", ["all"])
    token_file = tmp_path / "all.token"
    token_file.write_text(TOKENS["all"])
    store = _store(tmp_path, "--auth-file", str(auth)).start()
    eng = start_engine(
        engine_data_dir,
        "--auth-file", str(auth),
        "--store", store.address,
        "--store-token-file", str(token_file),
        log_dir=tmp_path,
    )  # fmt: skip
    try:
        node_dir = ROOT / "clients" / "node"
        result = subprocess.run(
            [shutil.which("node") or "node", "--test", "test-auth/"],
            cwd=node_dir,
            capture_output=True,
            text=True,
            timeout=180,
            env={
                **os.environ,
                "TANDEM_ENGINE": eng.address,
                "TANDEM_STORE": store.address,
                "TANDEM_TOKEN_FILE": str(token_file),
            },
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
        assert "# pass 2" in result.stdout and "# fail 0" in result.stdout

        async def asyncio_clients() -> None:  # the asyncio clients send the token too
            token = TOKENS["all"]
            async with AsyncEngineClient(eng.address, token=token) as e:
                assert len((await e.generate([5, 6, 7], max_tokens=3)).token_ids) == 3
            async with AsyncStoreClient(store.address, token=token) as st:
                assert await st.flush()
            async with AsyncStoreClient(store.address) as anonymous:
                with pytest.raises(TandemError) as refused:
                    await anonymous.flush()
                assert refused.value.code == UNAUTHENTICATED

        asyncio.run(asyncio_clients())
    finally:
        eng.stop()
        store.stop()
