"""Test certificates, made by openssl for each test run (never committed keys): a CA, a
server certificate for 127.0.0.1 it signs, and client certificates."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(d: Path, name: str) -> Pair:
    ca = Pair(d / f"{name}.pem", d / f"{name}.key")
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-keyout", str(ca.key), "-out", str(ca.cert), "-subj", f"/CN={name}",
    )  # fmt: skip
    return ca


def issue(ca: Pair, d: Path, name: str, common_name: str, san: str = "") -> Pair:
    """A certificate for common_name signed by ca (san: e.g. "IP:127.0.0.1")."""
    pair, csr, ext = (
        Pair(d / f"{name}.pem", d / f"{name}.key"),
        d / f"{name}.csr",
        d / f"{name}.ext",
    )
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pair.key),
        "-out", str(csr), "-subj", f"/CN={common_name}",
    )  # fmt: skip
    ext.write_text(f"subjectAltName={san}\n" if san else "basicConstraints=CA:FALSE\n")
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key),
        "-CAcreateserial", "-days", "1", "-out", str(pair.cert), "-extfile", str(ext),
    )  # fmt: skip
    return pair
