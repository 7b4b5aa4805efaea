"""Turns under contention (docs/engine.md, "Slow readers and turns").

The engine cannot see whether a client's application reads: a gRPC client library takes
tokens up to its HTTP/2 window (megabytes once BDP probing grew it) and a gateway's HTTP
client up to its socket buffers, so a stream nobody reads can hold a slot for thousands of
tokens before its backlog shows (response_stream.RequestStream). Turns bound what any row,
reader or not, takes while others wait: when requests wait for a slot and the batch is full,
a row that has generated `turn_tokens` tokens since it got its slot gives it up. It is parked
as a slow reader's row is (loop/preemption.py: captured, out of the batch, exact on return) and
queued again at once behind the requests that waited, so it is never dropped, only made to
take turns. Rows with the longest current turn go first, at most one per waiting request;
nothing moves while nobody waits.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from engine_service.loop.jobs import Job


def due_turns(
    rows: Iterable[Job],
    waiting: int,
    free: int,
    turn_tokens: int,
    leaving: Container[str],
    already_leaving: int,
) -> list[Job]:
    """The rows that give their slot up now.

    Args:
        rows: the batch's rows.
        waiting: requests waiting for a slot; free: slots free now.
        turn_tokens: a turn's length (0: no turns).
        leaving: request ids already leaving the batch (asked on an earlier step).
        already_leaving: how many of them free a slot for the waiting.
    Returns:
        At most `waiting - already_leaving` rows whose turn reached `turn_tokens`, the
        longest turns first.
    """
    wanted = waiting - already_leaving
    if turn_tokens <= 0 or free > 0 or wanted <= 0:
        return []
    due = [job for job in rows if job.turn >= turn_tokens and job.request.request_id not in leaving]
    due.sort(key=lambda job: job.turn, reverse=True)
    return due[:wanted]
