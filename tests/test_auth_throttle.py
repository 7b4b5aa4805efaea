"""The authentication-failure limit against a real store: a guesser's wrong tokens from one
address stay throttled, while every principal that presents a valid credential from that same
address (one host, a proxy, a NAT) goes on working at once."""

from __future__ import annotations

import secrets
from pathlib import Path

import grpc
import pytest

from tandem_client import StoreClient
from tandem_wire.auth import FAILURES_PER_WINDOW
from tandem_wire.pb import store_pb2, store_pb2_grpc
from tests.servers import ServiceProcess
from tests.test_security import TOKENS, _record, write_auth_file

THROTTLED = "too many failed"


def _refusal(stub: store_pb2_grpc.StoreStub, metadata: list[tuple[str, str]]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        stub.Pin(store_pb2.PinRequest(namespace="acme", key=b"k"), metadata=metadata)
    return refused.value


def test_wrong_tokens_from_one_address_never_lock_out_valid_principals(tmp_path: Path) -> None:
    auth = write_auth_file(tmp_path / "auth.json", ["acme", "beta"])
    store = ServiceProcess(
        "store_service",
        ["--data-dir", str(tmp_path / "store"), "--auth-file", str(auth)],
        "tandem-store listening on",
        tmp_path / "store.log",
    ).start()
    try:
        with grpc.insecure_channel(store.address) as channel:
            stub = store_pb2_grpc.StoreStub(channel)
            # A guesser on this host: each wrong token is refused, the budget runs out.
            for _ in range(FAILURES_PER_WINDOW):
                guess = [("authorization", f"Bearer {secrets.token_urlsafe(24)}")]
                refused = _refusal(stub, guess)
                assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
                assert THROTTLED not in (refused.details() or "")
            # (a) Past the budget, wrong tokens and missing credentials are throttled.
            for metadata in ([("authorization", "Bearer not-a-token")], []):
                refused = _refusal(stub, metadata)
                assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
                assert THROTTLED in (refused.details() or "")

            # (b) Both principals, from the same address, are served at once: new
            # connections and the guesser's own connection alike.
            for name in ("acme", "beta"):
                with StoreClient(store.address, token=TOKENS[name]) as client:
                    client.put(_record(f"key of {name}".encode()))
                    got = client.get(f"key of {name}".encode())
                    assert got.tensors[0].data == f"secret of key of {name}".encode()
            valid = [("authorization", f"Bearer {TOKENS['acme']}")]
            missing = _refusal(stub, valid)  # authenticated: the record is simply not there
            assert missing.code() == grpc.StatusCode.NOT_FOUND

            # Their successes do not reset the guesser's count: it is still throttled.
            refused = _refusal(stub, [("authorization", "Bearer still-not-a-token")])
            assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
            assert THROTTLED in (refused.details() or "")
        for name in ("acme", "beta"):
            assert TOKENS[name] not in store.log_path.read_text()
    finally:
        store.stop()
