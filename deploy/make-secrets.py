#!/usr/bin/env python3
"""Writes the tokens and auth files the Kubernetes deployment mounts (docs/deploy.md).

    python3 deploy/make-secrets.py deploy/secrets

OUT/<secret>/ holds one file per key of the Secret `tandem-<secret>-auth`, so that
`kubectl create secret generic tandem-<secret>-auth --from-file=OUT/<secret>/` makes it:
  store/auth.json          the store's principals: the engines (role store), ops
  engine/auth.json         the engines' principals: a client, the gateways, ops
  engine/store.token       the engines' token at the store
  gateway/auth.json        the engines' auth.json again (the gateway forwards callers' tokens)
  gateway/engine.token     the gateways' token at the engines
and, kept by you: client.token (for the OpenAI API / gRPC), ops.token (tandem ckpt, Stats).
Tokens are random (secrets.token_urlsafe(32)); the auth files keep only their sha256.
Standard library only; files are 0600 in a 0700 directory. OUT must not exist yet, so a
second run never replaces tokens in use.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sys
from pathlib import Path


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _principal(name: str, token: str, roles: list[str]) -> dict[str, object]:
    return {"name": name, "token_sha256": _sha(token), "namespaces": ["*"], "roles": roles}


def _auth(*principals: dict[str, object]) -> str:
    return json.dumps({"principals": list(principals)}, indent=2) + "\n"


def make(out: Path) -> dict[str, dict[str, str]]:
    """The files written under out, by directory: {"store": {"auth.json": ...}, ...}."""
    tokens = {n: secrets.token_urlsafe(32) for n in ("client", "ops", "engine", "gateway")}
    api = _auth(
        _principal("client", tokens["client"], ["generate"]),
        _principal("gateway", tokens["gateway"], ["generate", "admin"]),
        _principal("ops", tokens["ops"], ["admin", "generate"]),
    )
    files = {
        "store": {
            "auth.json": _auth(
                _principal("engine", tokens["engine"], ["store"]),
                _principal("ops", tokens["ops"], ["admin", "store"]),
            )
        },
        "engine": {"auth.json": api, "store.token": tokens["engine"]},
        "gateway": {"auth.json": api, "engine.token": tokens["gateway"]},
        ".": {"client.token": tokens["client"], "ops.token": tokens["ops"]},
    }
    out.mkdir(mode=0o700, parents=True)
    for folder, named in files.items():
        (out / folder).mkdir(mode=0o700, exist_ok=True)
        for name, text in named.items():
            fd = os.open(out / folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
    return files


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    if out.exists():
        print(f"{out} exists: remove it first (its tokens may be in use)", file=sys.stderr)
        return 1
    make(out)
    print(f"wrote {out}; create the Secrets with:")
    for secret in ("store", "engine", "gateway"):
        source = f"--from-file={out / secret}/"
        print(f"  kubectl -n tandem create secret generic tandem-{secret}-auth {source}")
    print(f"your token for the API: {out / 'client.token'}; the operators': {out / 'ops.token'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
