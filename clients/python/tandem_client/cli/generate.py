"""`tandem generate` and `tandem chat`: streaming text from an engine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tandem_client.cli.connection import add_connection_args, connection
from tandem_client.cli.output import console, engine_address, errors, print_json
from tandem_client.engine_client import EngineClient, GenerationChunk


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine",
        help="engine or gateway address; several, comma-separated, for a stream to go on "
        "through the next when one dies (env TANDEM_ENGINE)",
    )
    add_connection_args(p)
    p.add_argument("--max-tokens", type=int, help="(default: the engine's --default-max-tokens)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, help="(0, 1]; unset: off")
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--min-p", type=float, default=0.0, help="0: off")
    p.add_argument("--repetition-penalty", type=float, default=0.0, help="0 or 1: off")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="-2..2 (OpenAI's)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="-2..2 (OpenAI's)")
    p.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=BIAS",
        type=_bias,
        help="add BIAS to token ID's logit (repeatable)",
    )
    p.add_argument("--seed", type=int, default=0, help="same seed, same tokens")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--namespace", default="", help="(default: the principal's first)")
    p.add_argument(
        "--kv-bits",
        type=int,
        help="KV cache: 0 plain, 4 or 8 affine, 2-4 TurboQuant keys (default: the engine's)",
    )
    p.add_argument("--kv-scheme", choices=["affine", "turboquant"], help="(default: the engine's)")
    p.add_argument("--kv-value-bits", type=int, default=0, help="TurboQuant values: 2-4")
    p.add_argument("--kv-group-size", type=int, default=0, help="32, 64 or 128; 0: the engine's")
    p.add_argument("--quantized-kv-start", type=int, help="tokens kept plain before converting")
    p.add_argument(
        "--num-draft-tokens", type=int, help="speculative decoding: draft tokens per round"
    )


def _bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want TOKEN_ID=BIAS, e.g. 7=-100") from None


def _options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=dict(args.logit_bias),
        seed=args.seed,
        stop=args.stop,
        namespace=args.namespace,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
        kv_scheme=args.kv_scheme,
        kv_value_bits=args.kv_value_bits,
        num_draft_tokens=args.num_draft_tokens,
    )
    if args.top_p is not None:
        options["top_p"] = args.top_p
    return options


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    gen = sub.add_parser("generate", help="stream a generation")
    gen.add_argument("prompt")
    _sampling_args(gen)
    gen.add_argument("--request-id", default="")
    gen.add_argument("--logprobs", type=int)
    gen.add_argument("--json", action="store_true", help="one JSON object when done")
    _constraint_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive multi-turn chat (empty line or EOF ends)")
    _sampling_args(chat)
    chat.add_argument("--system", default="", help="system message")
    chat.set_defaults(func=cmd_chat)


def _usage_line(last: GenerationChunk) -> str:
    u = last.usage
    if u is None:
        return f"[{last.finish_reason}]"
    return (
        f"[{last.finish_reason}: {u.generated_tokens} tokens, {u.cached_prompt_tokens} "
        f"prompt tokens cached, ttft {u.ttft_seconds * 1e3:.0f} ms, "
        f"{u.decode_tokens_per_second:.0f} tok/s]"
    )


def _constraint_args(p: argparse.ArgumentParser) -> None:
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="output valid under this JSON Schema")
    shape.add_argument("--regex", help="output matching this regular expression")
    shape.add_argument("--grammar", metavar="FILE", help="a Lark grammar (.lark) or GBNF (.gbnf)")
    shape.add_argument("--choice", action="append", help="output is one of these (repeatable)")


def _constraint(args: argparse.Namespace) -> dict[str, Any]:
    if args.json_schema:
        return {"json_schema": Path(args.json_schema).read_text()}
    if args.regex:
        return {"regex": args.regex}
    if args.grammar:
        kind = "gbnf" if args.grammar.endswith(".gbnf") else "lark"
        return {kind: Path(args.grammar).read_text()}
    if args.choice:
        return {"choice": args.choice}
    return {}


def cmd_generate(args: argparse.Namespace) -> int:
    options = {**_options(args), **_constraint(args)}
    if args.logprobs is not None:
        options["logprobs"] = args.logprobs
    with EngineClient(engine_address(args.engine), **connection(args)) as client:
        chunks = []
        for chunk in client.stream(args.prompt, request_id=args.request_id, **options):
            chunks.append(chunk)
            if not args.json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    last = chunks[-1]
    if args.json:
        print_json(
            {
                "text": "".join(c.text for c in chunks),
                "token_ids": [t for c in chunks for t in c.token_ids],
                "finish_reason": last.finish_reason,
                "request_id": last.request_id,
                "usage": last.usage.__dict__ if last.usage else None,
                "logprobs": [lp.__dict__ for c in chunks for lp in c.logprobs] or None,
            }
        )
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        errors.print(_usage_line(last), style="dim", markup=False)  # stdout: the text only
    # A generation cut short (error, cancelled) is not a success.
    return 0 if last.finish_reason in ("length", "stop") else 1


def cmd_chat(args: argparse.Namespace) -> int:
    """Each turn sends the whole conversation; the engine reuses its cached prefix (memory,
    then the store), so a long conversation is not recomputed turn after turn."""
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    with EngineClient(engine_address(args.engine), **connection(args)) as client:
        while True:
            if interactive:
                console.print("[bold]you>[/bold] ", end="")
            line = sys.stdin.readline()
            if not line or not line.strip():
                return 0
            messages.append({"role": "user", "content": line.rstrip("\n")})
            console.print("[bold]assistant>[/bold] ", end="")
            reply, last = [], None
            for chunk in client.stream(messages, **_options(args)):
                reply.append(chunk.text)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
            sys.stdout.write("\n")
            if last is not None:
                console.print(_usage_line(last), style="dim", markup=False)
            messages.append({"role": "assistant", "content": "".join(reply)})
