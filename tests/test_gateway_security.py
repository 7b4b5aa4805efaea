"""The gateway with authentication: it checks callers itself, forwards their token so each
engine decides tenancy, keeps callers' request ids apart, and never logs a token."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from tandem_client import EngineClient
from tandem_client.errors import TandemError
from tandem_wire.auth import token_sha256
from tests.servers import GatewayProcess, ServiceProcess, start_engine
from tests.test_security import TOKENS, write_auth_file


@pytest.fixture(scope="module")
def secured(
    tmp_path_factory: pytest.TempPathFactory, engine_data_dir: Path
) -> Iterator[tuple[GatewayProcess, ServiceProcess, Path]]:
    root = tmp_path_factory.mktemp("gateway-auth")
    gateway_token = secrets.token_urlsafe(24)
    auth = write_auth_file(
        root / "auth.json",
        ["acme", "beta", "ops"],
        [
            {
                "name": "gateway",
                "token_sha256": token_sha256(gateway_token),
                "namespaces": ["*"],
                "roles": ["generate", "admin"],
            }
        ],
    )
    (root / "gateway.token").write_text(gateway_token)
    engine = start_engine(engine_data_dir, "--auth-file", str(auth), log_dir=root)
    gateway = None
    try:
        gateway = GatewayProcess(
            [engine.address],
            root / "gateway.log",
            "--auth-file",
            str(auth),
            "--engine-token-file",
            str(root / "gateway.token"),
            "--poll-interval",
            "0.2",
        )
        gateway.wait_engines(1)
        yield gateway, engine, root
    finally:
        if gateway is not None:
            gateway.stop()
        engine.stop()


def test_callers_need_a_valid_token(secured: tuple[GatewayProcess, ServiceProcess, Path]) -> None:
    gateway = secured[0]
    with EngineClient(gateway.grpc) as anonymous:
        with pytest.raises(TandemError) as refused:
            anonymous.generate("hi", max_tokens=2)
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    with openai.OpenAI(base_url=gateway.http + "/v1", api_key="wrong", max_retries=0) as sdk:
        with pytest.raises(openai.AuthenticationError):
            sdk.completions.create(model="tandem-tiny", prompt="hi", max_tokens=2)
    with openai.OpenAI(
        base_url=gateway.http + "/v1", api_key=TOKENS["acme"], max_retries=0
    ) as acme:
        reply = acme.completions.create(model="tandem-tiny", prompt="hi", max_tokens=3, seed=1)
    assert reply.usage is not None and reply.usage.completion_tokens == 3


def test_the_engine_decides_tenancy_from_the_forwarded_token(
    secured: tuple[GatewayProcess, ServiceProcess, Path],
) -> None:
    gateway = secured[0]
    with (
        openai.OpenAI(base_url=gateway.http + "/v1", api_key=TOKENS["acme"], max_retries=0) as acme,
        pytest.raises(openai.PermissionDeniedError),
    ):
        acme.completions.create(
            model="tandem-tiny",
            prompt="hi",
            max_tokens=2,
            extra_body={"tandem": {"namespace": "beta"}},
        )
    with EngineClient(gateway.grpc, token=TOKENS["acme"]) as client:
        assert client.generate("hi", max_tokens=2, namespace="acme-x").usage is not None
        with pytest.raises(TandemError) as denied:
            client.stats()  # admin only, on the engine as on the gateway
        assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_one_caller_cannot_cancel_anothers_request(
    secured: tuple[GatewayProcess, ServiceProcess, Path],
) -> None:
    gateway = secured[0]
    received: list[str] = []

    def run() -> None:
        with EngineClient(gateway.grpc, token=TOKENS["acme"]) as client:
            for chunk in client.stream(
                "go", max_tokens=4000, request_id="shared-id", ignore_eos=True
            ):
                received.append(chunk.finish_reason)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while not received and time.monotonic() < deadline:
        time.sleep(0.02)
    with EngineClient(gateway.grpc, token=TOKENS["beta"]) as beta:
        with pytest.raises(TandemError) as unknown:
            beta.cancel("shared-id")
        assert unknown.value.code == grpc.StatusCode.NOT_FOUND
    with EngineClient(gateway.grpc, token=TOKENS["acme"]) as acme:
        acme.cancel("shared-id")
    thread.join(30)
    assert received[-1] == "cancelled"


def test_tokens_stay_out_of_the_gateway_log(
    secured: tuple[GatewayProcess, ServiceProcess, Path],
) -> None:
    root = secured[2]
    log = (root / "gateway.log").read_text()
    secret = (root / "gateway.token").read_text()
    assert log and not any(token in log for token in [*TOKENS.values(), secret])
