"""The store's region socket: where a same-host caller hands over its region's fd.

A Unix stream socket (a path, or "@name" in the abstract namespace: the default, a random
name per process, advertised in RegisterRegion's answer). A connection sends one
RegionHandover (its ticket) with the region's fd as SCM_RIGHTS ancillary data and reads one
RegionHandoverReply. The socket carries no credentials: a fd is kept only for a ticket that
an authenticated principal was issued over gRPC (regions.py), any other is closed at once.
Connections are served on threads of their own, at most MAX_CONNECTIONS at a time, each
within TIMEOUT_S, so a local process that connects and sends nothing holds nothing long.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import socketserver
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from store_service.regions import HandoverAnswer
from store_service.wire import handover_reply, parse_handover

log = logging.getLogger("tandem.store.regions")

MAX_CONNECTIONS = 16
TIMEOUT_S = 5.0
MAX_MESSAGE_BYTES = 4096

# (ticket, fd, "pid/uid" of the peer) -> whether the fd was taken (and the data file's fd).
HandOver = Callable[[bytes, int, str], HandoverAnswer]


def default_address() -> str:
    return f"@tandem-store-{os.getpid()}-{secrets.token_hex(6)}"


def sockaddr(address: str) -> str:
    """ "@name" (the abstract namespace) as the kernel takes it; a path as it is."""
    return "\0" + address[1:] if address.startswith("@") else address


class RegionSocket:
    """Serves handovers on its own threads until close()."""

    def __init__(self, address: str, hand_over: HandOver) -> None:
        self.address = address
        if not address.startswith("@"):
            Path(address).unlink(missing_ok=True)  # left by a store that was killed
        slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                _serve(self.request, hand_over)

        class Server(socketserver.ThreadingUnixStreamServer):
            daemon_threads = True

            def process_request(self, request: Any, client_address: Any) -> None:
                if not slots.acquire(blocking=False):
                    self.shutdown_request(request)  # too many at once: try again
                    return
                super().process_request(request, client_address)

            def process_request_thread(self, request: Any, client_address: Any) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    slots.release()

        self._server = Server(sockaddr(address), Handler)
        if not address.startswith("@"):
            # Any local user may connect: the ticket, issued over authenticated gRPC, is
            # what admits a fd (the directory's permissions can narrow it further).
            os.chmod(address, 0o666)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="region-socket", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if not self.address.startswith("@"):
            Path(self.address).unlink(missing_ok=True)


def _serve(conn: socket.socket, hand_over: HandOver) -> None:
    conn.settimeout(TIMEOUT_S)
    fds: list[int] = []
    try:
        data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE_BYTES, 2)
        if len(fds) != 1:
            answer = HandoverAnswer("send exactly one file descriptor with the ticket")
        else:
            fd = fds.pop()
            os.set_inheritable(fd, False)
            answer = hand_over(parse_handover(data), fd, _peer(conn))
        given = answer.data_file_fd >= 0
        reply = handover_reply(answer.error, answer.data_file_refused, given)
        if answer.data_file_fd < 0:
            conn.sendall(reply)
        else:
            try:
                socket.send_fds(conn, [reply], [answer.data_file_fd])
            finally:
                os.close(answer.data_file_fd)
    except OSError as exc:
        log.info("a region handover failed: %s", exc)
    finally:
        for fd in fds:
            os.close(fd)


def _peer(conn: socket.socket) -> str:
    with contextlib.suppress(OSError):
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _ = struct.unpack("3i", raw)
        return f"pid {pid} uid {uid}"
    return "an unknown peer"
