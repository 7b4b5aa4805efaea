"""TLS when given: servers listen with a certificate, clients connect with credentials."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from tandem_client import EngineClient, StoreClient, Unavailable
from tests.conftest import make_checkpoint
from tests.servers import ServiceProcess


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def _start_tls(
    module: str, banner: str, args: list[str], cert: Path, key: Path, log: Path
) -> ServiceProcess:
    proc = ServiceProcess(
        module, [*args, "--tls-cert", str(cert), "--tls-key", str(key)], banner, log
    )
    proc.tls_root = cert.read_bytes()
    return proc.start()


def test_store_and_engine_over_tls(
    certificate: tuple[Path, Path], tmp_path: Path, engine_data_dir: Path, engine: ServiceProcess
) -> None:
    cert, key = certificate
    credentials = grpc.ssl_channel_credentials(cert.read_bytes())
    store = _start_tls(
        "store_service",
        "tandem-store listening on",
        ["--data-dir", str(tmp_path / "store")],
        cert,
        key,
        tmp_path / "s.log",
    )
    eng = _start_tls(
        "engine_service",
        "tandem-engine listening on",
        ["--data-dir", str(engine_data_dir)],
        cert,
        key,
        tmp_path / "e.log",
    )
    try:
        with StoreClient(store.address, credentials=credentials) as client:
            client.put(make_checkpoint(b"tls", {"a_int8": 1000}))
            assert client.stats().records == 1
        with EngineClient(eng.address, credentials=credentials) as client:
            assert len(client.generate("Hello", max_tokens=4, ignore_eos=True).token_ids) == 4
        with StoreClient(store.address, timeout=3) as plaintext:
            with pytest.raises(Unavailable):
                plaintext.put(make_checkpoint(b"x", {"a_int8": 10}))
    finally:
        eng.stop()
        store.stop()
