"""Who is calling, and what they may do: principals from an auth file, for both servers.

`--auth-file PATH` names a JSON file of principals (docs/security.md):

    {"principals": [
      {"name": "acme", "token_sha256": "<hex>", "namespaces": ["acme", "acme-*"],
       "roles": ["generate", "store"]},
      {"name": "engine-7", "tls_subject": "CN=engine-7", "namespaces": ["*"], "roles": ["store"]}
    ]}

A caller proves who it is with `authorization: Bearer <token>` metadata (the file holds only
the token's sha256) or with a client certificate (mTLS) whose subject or a SAN names a
principal. Each RPC needs a role; a request's namespace must be one the principal may use.
The file is read again on SIGHUP (`Authenticator.reload`); a file that does not parse keeps
the principals in force and says why. Tokens never reach a log or an error message.
"""

from __future__ import annotations

import contextvars
import enum
import hashlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Failed authentications a peer host may make per window; beyond them its failed attempts are
# answered "too many" until the host stays under the limit for a window. Valid credentials are
# always let in: many principals can share one address (a host, a proxy, a NAT), and one
# client's wrong tokens must not lock the others out. Tokens are long random strings: the
# entropy makes guessing hopeless, this bounds a guesser's noise and names it.
FAILURES_PER_WINDOW = 100
FAILURE_WINDOW_S = 60.0


class Role(enum.Enum):
    GENERATE = "generate"  # the engine's Generate, Cancel, Tokenize, Detokenize, ModelInfo
    STORE = "store"  # the store's data plane: Put, Get, Lookup, Pin, Unpin
    ADMIN = "admin"  # StoreAdmin, and the engine's Stats and Flush


class AuthError(Exception):
    """Base of the two refusals; `status` names the gRPC code."""

    status = "UNAUTHENTICATED"


class Unauthenticated(AuthError):
    status = "UNAUTHENTICATED"


class PermissionDenied(AuthError):
    status = "PERMISSION_DENIED"


class AuthFileError(ValueError):
    """The auth file cannot be used (the message names the file and the problem)."""


@dataclass(frozen=True)
class Principal:
    name: str
    namespaces: tuple[str, ...]  # exact names, or prefixes ending in "*"
    roles: frozenset[Role]
    token_sha256: str = ""  # lowercase hex
    tls_subject: str = ""  # e.g. "CN=engine-7", or a SAN such as "engine-7.internal"

    def may_use(self, namespace: str) -> bool:
        return any(
            namespace.startswith(p[:-1]) if p.endswith("*") else namespace == p
            for p in self.namespaces
        )

    @property
    def sees_everything(self) -> bool:
        return "*" in self.namespaces

    def namespace(self, requested: str) -> str:
        """The namespace a request acts in: the requested one if allowed, the principal's
        first namespace when none is given. Raises PermissionDenied."""
        if not requested:
            first = self.namespaces[0]
            requested = "" if first.endswith("*") else first
        if not self.may_use(requested):
            raise PermissionDenied(f"principal {self.name!r} may not use namespace {requested!r}")
        return requested

    def require(self, role: Role) -> None:
        if role not in self.roles:
            raise PermissionDenied(f"principal {self.name!r} lacks the {role.value!r} role")


def parse_auth_file(path: Path) -> list[Principal]:
    """The principals of an auth file. Raises AuthFileError naming what is wrong."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AuthFileError(f"{path}: cannot read it as JSON ({exc})") from None
    entries = doc.get("principals") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise AuthFileError(f'{path}: needs a non-empty "principals" list')
    principals, names, tokens = [], set(), set()
    for i, e in enumerate(entries):
        where = f"{path}: principals[{i}]"
        if not isinstance(e, dict):
            raise AuthFileError(f"{where} is not an object")
        name = e.get("name")
        if not isinstance(name, str) or not name or name in names:
            raise AuthFileError(f"{where}: needs a unique non-empty name")
        token = e.get("token_sha256", "")
        subject = e.get("tls_subject", "")
        if not isinstance(token, str) or not isinstance(subject, str) or not (token or subject):
            raise AuthFileError(f"{where} ({name}): needs token_sha256 or tls_subject")
        token = token.lower()
        if token and (len(token) != 64 or any(c not in "0123456789abcdef" for c in token)):
            raise AuthFileError(f"{where} ({name}): token_sha256 must be 64 hex digits")
        if token and token in tokens:
            raise AuthFileError(f"{where} ({name}): the same token as another principal")
        namespaces = e.get("namespaces")
        if not isinstance(namespaces, list) or not namespaces:
            raise AuthFileError(f"{where} ({name}): needs a non-empty namespaces list")
        if any(not isinstance(n, str) or "*" in n[:-1] for n in namespaces):
            raise AuthFileError(f"{where} ({name}): a namespace is a name or a prefix ending in *")
        try:
            roles = frozenset(Role(r) for r in e.get("roles", []))
        except ValueError:
            raise AuthFileError(
                f"{where} ({name}): roles are from {[r.value for r in Role]}"
            ) from None
        if not roles:
            raise AuthFileError(f"{where} ({name}): needs at least one role")
        names.add(name)
        tokens.add(token)
        principals.append(Principal(name, tuple(namespaces), roles, token, subject))
    return principals


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


# The principal of the call being served (set by the servers' guard, read by the RPCs).
_current: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "tandem_principal", default=None
)


def current() -> Principal | None:
    """The calling principal; None when the server runs without --auth-file."""
    return _current.get()


def set_current(principal: Principal | None) -> contextvars.Token[Principal | None]:
    return _current.set(principal)


def reset_current(token: contextvars.Token[Principal | None]) -> None:
    try:
        _current.reset(token)
    except ValueError:  # set in another context (a generator resumed elsewhere)
        _current.set(None)


def namespace_for(requested: str) -> str:
    """The namespace a request acts in (unchanged without auth). Raises PermissionDenied."""
    principal = current()
    return requested if principal is None else principal.namespace(requested)


class Authenticator:
    """The principals in force (swapped whole on reload) and the failure counts."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._by_token: dict[str, Principal] = {}
        self._by_subject: dict[str, Principal] = {}
        self._failures: dict[str, deque[float]] = {}  # peer host -> recent failure times
        self.failures_total = 0
        self._install(parse_auth_file(path))

    def _install(self, principals: list[Principal]) -> None:
        by_token = {p.token_sha256: p for p in principals if p.token_sha256}
        by_subject = {p.tls_subject: p for p in principals if p.tls_subject}
        with self._lock:
            self._by_token, self._by_subject = by_token, by_subject

    def reload(self) -> bool:
        """Reads the file again (SIGHUP); on error the principals in force stay."""
        try:
            principals = parse_auth_file(self.path)
        except AuthFileError as exc:
            log.error("auth file not reloaded, the previous principals stay: %s", exc)
            return False
        self._install(principals)
        log.info("auth file reloaded: %d principals", len(principals))
        return True

    def authenticate(
        self, metadata: Any, identities: Callable[[], list[str]], peer: str
    ) -> Principal:
        """The caller's principal from its bearer token, else its certificate identities.

        Raises Unauthenticated, counted against the peer's host. A host past the failure limit
        has its failed attempts answered "too many failed authentications"; a credential that
        names a principal is let in regardless, so other callers' failures from the same
        address never lock a principal out.
        """
        with self._lock:
            by_token, by_subject = self._by_token, self._by_subject
        token, names = _bearer(metadata), []
        if token is not None:
            # A dict lookup by the token's sha256: its timing depends on the hash, which says
            # nothing about the token.
            found = by_token.get(token_sha256(token))
            if found is not None:
                return found
        else:
            names = identities()
            for identity in names:
                if identity in by_subject:
                    return by_subject[identity]
        if self._count_failure(peer_host(peer)):
            raise Unauthenticated("too many failed authentications from this peer; wait")
        if token is not None:
            raise Unauthenticated("the bearer token is not valid")
        if names:
            raise Unauthenticated("the client certificate names no principal")
        raise Unauthenticated("credentials needed: authorization: Bearer <token>, or mTLS")

    def _count_failure(self, host: str) -> bool:
        """Records a failure from `host`; True when it already had the limit's worth within
        the window (a sliding window over its latest failures, bounded in memory)."""
        now = time.monotonic()
        with self._lock:
            self.failures_total += 1
            recent = self._failures.get(host)
            if recent is None:
                recent = self._failures[host] = deque(maxlen=FAILURES_PER_WINDOW)
            while recent and now - recent[0] > FAILURE_WINDOW_S:
                recent.popleft()
            throttled = len(recent) >= FAILURES_PER_WINDOW
            recent.append(now)
            return throttled


def peer_host(peer: str) -> str:
    """ "ipv4:127.0.0.1:50312" -> "ipv4:127.0.0.1": a client's port changes per connection."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        return f"{kind}:{rest.rsplit(':', 1)[0]}"
    return peer


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def tls_identities(auth_context: Any) -> list[str]:
    """A verified client certificate's subject and SANs, as principals name them."""
    identities = []
    for key in ("x509_subject", "x509_common_name", "x509_subject_alternative_name"):
        for value in (auth_context or {}).get(key, []):
            text = value.decode() if isinstance(value, bytes) else str(value)
            identities.append(f"CN={text}" if key == "x509_common_name" else text)
    return identities
