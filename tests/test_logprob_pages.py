"""The pages of a checkpointed generation's log-probabilities (checkpoints/logprob_pages.py),
in-process: what a log writes when, a page's record read back, and what a resume is sent or
refused. The engine writing and reading them is tested in test_checkpoints.py."""

from __future__ import annotations

import pytest

from engine_service.checkpoints.logprob_pages import (
    PAGE_TOKENS,
    LogprobLog,
    PagesRead,
    entries_of,
    page_key,
    page_record,
    replay_entries,
)
from engine_service.checkpoints.spill import SpillQueue
from engine_service.checkpoints.spill_items import Put
from engine_service.errors import Precondition
from engine_service.protocol.checkpoint_stats import CheckpointCounters
from engine_service.protocol.events import Token
from tandem_client import Checkpoint
from tandem_client.errors import Unavailable
from tests.generation_rows import wait_for
from tests.test_engine_domain import FakeSink

KEY = bytes(range(32))


def entry(i: int, top: int = 2) -> Token:
    # float32 values, as the engine computes them: a page stores them as they are
    return Token(1000 + i, -0.25 * (i % 7) - 0.125, [(i + j, -float(j)) for j in range(top)])


def test_a_log_writes_each_page_as_it_fills_and_keeps_only_the_page_being_filled() -> None:
    log = LogprobLog()
    for i in range(PAGE_TOKENS - 8):
        log.note(i, entry(i))
    (first,) = log.pages_due()
    assert first == (0, [entry(i) for i in range(PAGE_TOKENS - 8)])
    assert log.pages_due() == []  # nothing new
    for i in range(PAGE_TOKENS - 8, PAGE_TOKENS + 8):
        log.note(i, entry(i))
    log.note(PAGE_TOKENS + 7, entry(0))  # noted already (a pending token's): kept as it was
    # The page being filled is written whole again, and the next one begins.
    again, second = log.pages_due()
    assert again == (0, [entry(i) for i in range(PAGE_TOKENS)])
    assert second == (PAGE_TOKENS, [entry(i) for i in range(PAGE_TOKENS, PAGE_TOKENS + 8)])
    assert log.start == PAGE_TOKENS and len(log.entries) == 8  # bounded by a page


def test_a_gap_in_the_log_starts_it_again_at_the_next_page() -> None:
    log = LogprobLog()
    log.note(0, entry(0))
    log.note(5, entry(5))  # never in the engine: every token is noted in order
    for i in range(6, PAGE_TOKENS + 2):
        log.note(i, entry(i))
    assert log.pages_due() == [(PAGE_TOKENS, [entry(PAGE_TOKENS), entry(PAGE_TOKENS + 1)])]


def test_a_page_reads_back_bit_for_bit_and_only_for_its_generation() -> None:
    entries = [entry(i, top=3) for i in range(PAGE_TOKENS, PAGE_TOKENS + 40)]
    record = page_record(KEY, PAGE_TOKENS, entries, "ns", "model", ["kv:plain"])
    assert record.key == page_key(KEY, 1) and record.token_ids == [e.token_id for e in entries]
    assert entries_of(record, KEY) == {PAGE_TOKENS + i: e for i, e in enumerate(entries)}
    with pytest.raises(ValueError):
        entries_of(record, bytes(32))
    record.metadata["logprobs"] = record.metadata["logprobs"][:-8]  # cut short: malformed
    with pytest.raises(ValueError):
        entries_of(record, KEY)


def test_a_page_of_mixed_alternatives_keeps_the_fewest() -> None:
    """A generation resumed asking fewer alternatives writes its page with those."""
    record = page_record(KEY, 0, [entry(0, top=5), entry(1, top=1)], "", "m", [])
    assert [len(e.top or ()) for e in entries_of(record, KEY).values()] == [1, 1]


def test_a_resume_gets_the_entries_past_what_its_client_holds_or_a_refusal() -> None:
    tokens = [entry(i).token_id for i in range(10)]
    found = {i: entry(i, top=3) for i in range(10)}
    sent = replay_entries(found, tokens, 6, 2)
    assert sent == [
        Token(e.token_id, e.logprob, (e.top or [])[:2]) for e in map(entry, range(6, 10))
    ]
    assert replay_entries(found, tokens, 10, 2) == []
    del found[7]
    with pytest.raises(Precondition, match="no log-probabilities for tokens 7 to 9"):
        replay_entries(found, tokens, 6, 2)
    assert replay_entries(found, tokens, 8, 2)  # holding the missing one: nothing lacks
    with pytest.raises(Precondition, match="with 4 alternatives"):
        replay_entries(found, tokens, 8, 4)


def test_a_resumed_log_goes_on_from_its_last_page_read_back() -> None:
    replayed = PAGE_TOKENS + 10
    found = {i: entry(i) for i in range(PAGE_TOKENS, replayed)}
    log = LogprobLog.resumed(PagesRead(found), replayed)
    log.note(replayed, entry(replayed))
    assert log.pages_due() == [(PAGE_TOKENS, [entry(i) for i in range(PAGE_TOKENS, replayed + 1)])]
    # Its last page not in the store: the log begins at the next page.
    lost = LogprobLog.resumed(PagesRead(), replayed)
    for i in range(replayed, 2 * PAGE_TOKENS + 1):
        lost.note(i, entry(i))
    assert lost.pages_due() == [(2 * PAGE_TOKENS, [entry(2 * PAGE_TOKENS)])]


class RecordingSpill:
    """What a log queues (the spill queue's put and lease)."""

    lease_s = 600

    def __init__(self) -> None:
        self.puts: list[Put] = []

    def put(self, item: Put) -> bool:
        self.puts.append(item)
        return True

    def keys(self) -> list[bytes]:
        keys, self.puts = [p.record.key for p in self.puts], []
        return keys


def test_filled_pages_are_put_again_before_their_lease_lapses() -> None:
    """Pages are leased like a generation's records; a filled page is never written again
    by its snapshots, so it is put again once half its lease is gone (a resumed run's, read
    back, at its first snapshot)."""
    spill, log = RecordingSpill(), LogprobLog()
    for i in range(PAGE_TOKENS + 3):
        log.note(i, entry(i))
    log.queue_pages(spill, KEY, "", "m", [], now=1000.0)  # type: ignore[arg-type]
    assert spill.keys() == [page_key(KEY, 0), page_key(KEY, 1)]
    for i in range(PAGE_TOKENS + 3, PAGE_TOKENS + 5):
        log.note(i, entry(i))
    log.queue_pages(spill, KEY, "", "m", [], now=1299.0)  # type: ignore[arg-type]
    assert spill.keys() == [page_key(KEY, 1)]  # the page being filled only
    log.queue_pages(spill, KEY, "", "m", [], now=1301.0)  # type: ignore[arg-type]
    assert spill.keys() == [page_key(KEY, 0)]
    whole = page_record(KEY, 0, [entry(i) for i in range(PAGE_TOKENS)], "", "m", [])
    read = PagesRead({i: entry(i) for i in range(PAGE_TOKENS + 2)}, {0: whole})
    resumed = LogprobLog.resumed(read, PAGE_TOKENS + 2)
    resumed.queue_pages(spill, KEY, "", "m", [], now=5.0)  # type: ignore[arg-type]
    assert spill.keys() == [page_key(KEY, 0)]


class PagesRefused(FakeSink):
    """A store that takes every record but a logprob page."""

    def put(self, checkpoint: Checkpoint, **_: object) -> object:
        if "logprobs_of" in checkpoint.metadata:
            raise Unavailable("a page refused")
        self.puts.append(checkpoint.key)
        return None


def test_a_snapshot_whose_pages_did_not_land_is_not_sent() -> None:
    """A resume would find an older run's entries where the pages should be: the snapshot
    after them is not sent, and the chain's run is marked broken (on_failed)."""
    sink, broken = PagesRefused(), []
    spill = SpillQueue(sink, capacity_bytes=1 << 20, counters=CheckpointCounters())
    log = LogprobLog()
    log.note(0, entry(0))
    landed = log.queue_pages(spill, KEY, "", "m", [], on_failed=lambda: broken.append(True))
    spill.flush()
    assert broken == [True] and not landed()

    def a_probe_lands() -> bool:  # the spill's backoff after a failure is over
        spill.put(Put(Checkpoint(key=b"probe"), 0))
        spill.flush()
        return b"probe" in sink.puts

    wait_for(a_probe_lands, "a put sent again after the backoff")
    spill.put(Put(Checkpoint(key=b"snapshot"), 0, still_wanted=landed))
    spill.put(Put(Checkpoint(key=b"other"), 0))
    spill.flush()
    assert b"snapshot" not in sink.puts and b"other" in sink.puts
    assert log.queue_pages(spill, KEY, "", "m", [])()  # none due: nothing to wait for
