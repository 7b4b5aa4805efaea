"""Streams run together in one engine, killed, resumed together on another, and run alone:
the steps tests/test_determinism.py and bench/determinism_resume.py share."""

from __future__ import annotations

import threading
from typing import Any

from tandem_client import EngineClient, Generation, GenerationChunk, TandemError
from tandem_client.store_client import StoreClient
from tests.servers import generation_progress


def logprobs_of(chunks: list[GenerationChunk]) -> list[float]:
    """Each token's own log-probability, as the stream carried it (`logprobs=0` requests)."""
    return [lp.logprob for chunk in chunks for lp in chunk.logprobs]


def tokens_of(chunks: list[GenerationChunk]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


def stream_together(
    address: str, prompts: list[list[int]], requests: list[dict[str, Any]]
) -> tuple[list[list[GenerationChunk]], list[threading.Thread]]:
    """Starts the requests at once; returns each one's chunks as they arrive (live lists) and
    the threads reading them, which end when the streams do or the engine is killed."""
    received: list[list[GenerationChunk]] = [[] for _ in prompts]

    def read(i: int) -> None:
        with EngineClient(address) as client:
            try:
                for chunk in client.stream(prompts[i], **requests[i]):
                    received[i].append(chunk)
            except TandemError:
                pass  # the engine was killed under it

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return received, threads


def all_checkpointed(store: StoreClient, prompts: list[list[int]], generated: int) -> bool:
    """Whether every stream's generation checkpoint holds `generated` tokens past its prompt.
    The prompts must be far enough apart in length, and the rows in step, that the n-th
    shortest record is the n-th prompt's."""
    counts = sorted(generation_progress(store).values())
    return len(counts) == len(prompts) and all(
        count >= len(p) + generated for count, p in zip(counts, prompts, strict=True)
    )


def resume_together(
    address: str,
    prompts: list[list[int]],
    requests: list[dict[str, Any]],
    held: list[list[int]],
    timeout: float = 600,
) -> list[Generation | None]:
    """Resumes the requests at once, each holding its `held` tokens (None: did not end)."""
    resumed: list[Generation | None] = [None for _ in prompts]

    def resume(i: int) -> None:
        with EngineClient(address) as client:
            resumed[i] = client.generate(
                prompts[i], resume=True, tokens_held=len(held[i]), **requests[i]
            )

    workers = [threading.Thread(target=resume, args=(i,)) for i in range(len(prompts))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout)
    return resumed


def run_alone(
    address: str, prompts: list[list[int]], requests: list[dict[str, Any]]
) -> list[Generation]:
    """Each request run by itself, one after another, under a request id of its own."""
    with EngineClient(address) as client:
        return [
            client.generate(prompt, **dict(requests[i], request_id=f"solo-{i}"))
            for i, prompt in enumerate(prompts)
        ]
