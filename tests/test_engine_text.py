"""Streaming text: multi-byte characters split across tokens, stop strings cut exactly."""

from __future__ import annotations

from engine_service.front.text import TextStream
from tandem_client import EngineClient


def _stream(reference, ids: list[int], stops=(), prompt=()):  # noqa: ANN001, ANN202
    text = TextStream(reference.tokenizer, stops, prompt)
    deltas = []
    for t in ids:
        deltas.append(text.add(t))
        if text.stopped_by:
            break
    if not text.stopped_by:
        deltas.append(text.finish())
    return deltas, text


def test_multibyte_characters_split_over_tokens(reference) -> None:  # noqa: ANN001
    tok = reference.tokenizer
    original = "日本語の文章🙂 déjà vu, naïve 🚀✨"
    ids = tok.encode(original)
    assert len(ids) > 12  # byte-level pieces: several characters span token boundaries
    deltas, _ = _stream(reference, ids)
    assert "".join(deltas) == original
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_split_across_tokens_is_cut_exactly(reference) -> None:  # noqa: ANN001
    tok = reference.tokenizer
    original = "The quick brown fox jumps over the lazy dog"
    ids = tok.encode(original)
    pieces = [tok.decode([t]) for t in ids]
    # A stop string made of the end of one token and the start of the next.
    i = next(k for k in range(len(pieces) - 1) if len(pieces[k]) >= 2 and pieces[k + 1])
    stop = pieces[i][-2:] + pieces[i + 1][:1]
    start = original.index(stop)
    deltas, text = _stream(reference, ids, stops=[stop, "never"])
    assert "".join(deltas) == original[:start]
    assert text.stopped_by == stop


def test_text_held_for_a_possible_stop_is_released_when_it_is_not_one(reference) -> None:  # noqa: ANN001
    tok = reference.tokenizer
    ids = tok.encode("abc abd")
    deltas, text = _stream(reference, ids, stops=["abx"])
    assert "".join(deltas) == "abc abd" and not text.stopped_by


def test_engine_stream_text_equals_full_decode_for_sampled_bytes(
    engine_client: EngineClient, reference
) -> None:  # noqa: ANN001
    # High temperature over a byte-level vocabulary emits loose UTF-8 bytes; the streamed
    # deltas must still add up to exactly what decode gives for the whole sequence.
    prompt = reference.tokenizer.encode("日本語 🙂")
    got = engine_client.generate(prompt, max_tokens=64, temperature=3.0, seed=7, ignore_eos=True)
    prompt_text = reference.tokenizer.decode(prompt)
    full = reference.tokenizer.decode(prompt + got.token_ids)
    assert got.text == full[len(prompt_text) :]


def test_engine_stops_at_a_stop_string(engine_client: EngineClient, reference) -> None:  # noqa: ANN001
    free = engine_client.generate("Hello world", max_tokens=30, ignore_eos=True)
    assert len(free.text) > 8
    stop = free.text[5:8]
    cut = free.text.index(stop)
    got = engine_client.generate("Hello world", max_tokens=30, ignore_eos=True, stop=[stop])
    assert got.text == free.text[:cut]
    assert got.finish_reason == "stop" and got.chunks[-1].matched_stop == stop
    assert len(got.token_ids) < 30


def test_engine_stops_at_a_stop_token(engine_client: EngineClient) -> None:
    free = engine_client.generate("Hello world", max_tokens=20, ignore_eos=True)
    target = free.token_ids[4]
    first = free.token_ids.index(target)
    got = engine_client.generate(
        "Hello world", max_tokens=20, ignore_eos=True, stop_token_ids=[target]
    )
    assert got.token_ids == free.token_ids[: first + 1]
    assert got.finish_reason == "stop"
