"""The gateway's routing in-process: the prefix key, rendezvous ranking, DNS discovery, and
the Python client's moves between addresses (tests/test_gateway_pair.py runs them live)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway_service.affinity import AFFINITY_BLOCKS, TOKEN_BLOCK, affinity_key, rendezvous_rank
from gateway_service.config import parse_args
from gateway_service.discovery import DnsEngines
from tandem_client.engine_client import generate_request
from tandem_client.failover import Move, StreamAttempts, split_addresses

ENGINES = [f"10.0.0.{i}:50051" for i in range(1, 6)]


def _key(tokens: list[int], scope: str = "", namespace: str = "") -> bytes | None:
    return affinity_key(generate_request(tokens, namespace=namespace), scope)


def test_the_key_is_the_first_blocks_of_the_prompt_in_its_scope() -> None:
    head = list(range(100, 100 + TOKEN_BLOCK * AFFINITY_BLOCKS))
    assert _key(head[: TOKEN_BLOCK - 1]) is None  # under a block: nothing to share
    assert _key(head + [1, 2, 3]) == _key(head + [9] * 40)  # past the blocks: the same
    assert _key(head[:-1] + [7]) != _key(head)
    assert _key(head, scope="tenant-a") != _key(head, scope="tenant-b")
    assert _key(head, namespace="x") != _key(head)
    text = generate_request("word " * 100)
    assert affinity_key(text, "") == affinity_key(generate_request("word " * 60), "")


def test_every_gateway_ranks_the_engines_the_same() -> None:
    keys = [_key([n] * TOKEN_BLOCK * 2) for n in range(200)]
    for key in keys:
        assert rendezvous_rank(key, ENGINES) == rendezvous_rank(key, ENGINES[::-1])
    tops = {rendezvous_rank(key, ENGINES)[0] for key in keys}
    assert tops == set(ENGINES)  # 200 prefixes spread over all 5
    assert rendezvous_rank(None, ENGINES) == []


def test_an_engine_that_leaves_moves_only_its_own_prefixes() -> None:
    keys = [_key([n, n + 1] * TOKEN_BLOCK) for n in range(300)]
    before = {key: rendezvous_rank(key, ENGINES)[0] for key in keys}
    gone = ENGINES[2]
    after = {key: rendezvous_rank(key, [e for e in ENGINES if e != gone])[0] for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    assert moved and all(before[key] == gone for key in moved)
    # ...and to the engine each ranked second, the spill target every gateway agrees on.
    assert all(after[key] == rendezvous_rank(key, ENGINES)[1] for key in moved)


def test_dns_gives_the_records_of_a_name_and_keeps_them_while_it_fails() -> None:
    async def run() -> tuple[bool, list[str], bool, list[str]]:
        engines = DnsEngines(["localhost:50051", "no-such-name.invalid:50051"])
        changed = await engines.refresh()
        first = engines.addresses()
        again = await engines.refresh()
        return changed, first, again, engines.addresses()

    changed, first, again, later = asyncio.run(run())
    assert changed and "127.0.0.1:50051" in first
    assert all(a in ("127.0.0.1:50051", "[::1]:50051") for a in first)
    assert not again and later == first


def test_engines_dns_wants_host_and_port() -> None:
    config = parse_args(["--http-listen", ":0", "--engines-dns", "tandem-engines:50051"])
    assert config.engines_dns == ["tandem-engines:50051"]
    with pytest.raises(SystemExit):
        parse_args(["--http-listen", ":0", "--engines-dns", "tandem-engines"])


def test_addresses_split_and_keep_their_order() -> None:
    assert split_addresses("a:1, b:2,a:1") == ["a:1", "b:2"]
    assert split_addresses(["b:2", "a:1"]) == ["b:2", "a:1"]
    with pytest.raises(ValueError):
        split_addresses(" , ")


def test_a_stream_moves_on_with_its_id_and_the_tokens_held() -> None:
    attempts = StreamAttempts(generate_request("hi", max_tokens=64), addresses=2)
    first = attempts.request()
    assert first.request_id.startswith("py-") and not first.resume and not first.tokens_held
    attempts.after(grpc.StatusCode.UNAVAILABLE)  # before any token: started afresh elsewhere
    assert attempts.request() == first
    attempts.received(5)
    attempts.received(3)
    step = attempts.after(grpc.StatusCode.UNAVAILABLE)
    assert step.move is Move.NEXT_ADDRESS and step.pause_s == 0.0  # the other one, at once
    moved = attempts.request()
    assert (moved.request_id, moved.resume, moved.tokens_held) == (first.request_id, True, 8)
    # The engine still ends the row the dead server opened: the same address, a bit later.
    step = attempts.after(grpc.StatusCode.ALREADY_EXISTS)
    assert step.move is Move.SAME_ADDRESS and step.pause_s > 0
    # No checkpoint to resume: from the start, the 8 tokens skipped by the engine.
    assert attempts.after(grpc.StatusCode.NOT_FOUND).move is Move.SAME_ADDRESS
    again = attempts.request()
    assert (again.resume, again.tokens_held) == (False, 8)
    assert attempts.after(grpc.StatusCode.INVALID_ARGUMENT).move is Move.GIVE_UP


def test_a_caller_s_own_errors_and_a_fleet_that_stays_down_end_the_stream() -> None:
    fresh = StreamAttempts(generate_request("hi", request_id="mine"), addresses=2)
    assert fresh.request().request_id == "mine"
    assert fresh.after(grpc.StatusCode.ALREADY_EXISTS).move is Move.GIVE_UP  # before a move
    assert fresh.after(grpc.StatusCode.NOT_FOUND).move is Move.GIVE_UP
    down = StreamAttempts(generate_request("hi"), addresses=2, wait_s=3600)
    pauses = [down.after(grpc.StatusCode.UNAVAILABLE).pause_s for _ in range(8)]
    assert pauses[0] == 0.0 and pauses == sorted(pauses) and pauses[-1] > pauses[1]
    gone = StreamAttempts(generate_request("hi"), addresses=2, wait_s=-1)
    assert gone.after(grpc.StatusCode.UNAVAILABLE).move is Move.GIVE_UP
