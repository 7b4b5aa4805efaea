"""OpenAI's `response_format`, llama.cpp's `grammar` (GBNF) and `json_schema`, and Tandem's
own constraint extras onto a GenerateRequest's structured-output constraint (one at most).
The engine compiles and checks it: a schema it cannot take comes back INVALID_ARGUMENT, which
the front answers 400."""

from __future__ import annotations

import json
from typing import Any

from gateway_service.openai_errors import ApiError
from tandem_wire.pb import engine_pb2

# `"tandem": {...}` keys naming a constraint, one at most (the API has no place for them).
CONSTRAINT_EXTRAS = ("regex", "choice", "lark", "gbnf")
# llama.cpp's server's top-level extensions: a GBNF grammar, a JSON schema.
LLAMA_CPP = ("grammar", "json_schema")


def apply_constraint(body: dict[str, Any], req: engine_pb2.GenerateRequest) -> None:
    """response_format: text (none), json_object, or json_schema {name, schema, strict};
    or one of CONSTRAINT_EXTRAS under "tandem"."""
    extra = body.get("tandem") or {}
    given = [k for k in CONSTRAINT_EXTRAS if k in extra]
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if fmt is not None and not isinstance(fmt, dict):
        raise ApiError(400, "'response_format' must be an object", param="response_format")
    named = [f"tandem.{k}" for k in given] + [k for k in LLAMA_CPP if body.get(k) is not None]
    if kind not in (None, "text"):
        named.insert(0, "response_format")
    if len(named) > 1:
        raise ApiError(400, f"one constraint at most, got {', '.join(named)}", param=named[1])
    _llama_cpp(body, req)
    if kind == "json_object":
        req.constraint.json_object = True
    elif kind == "json_schema":
        spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(
                400,
                "response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}",
                param="response_format",
            )
        req.constraint.json_schema = json.dumps(schema)
    elif kind not in (None, "text"):
        raise ApiError(
            400, f"response_format type {kind!r} is not supported", param="response_format"
        )
    for name in given:
        value = extra[name]
        if name == "choice":
            if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                raise ApiError(400, "'tandem.choice' must be a list of strings", param="tandem")
            req.constraint.choice.options.extend(value)
        elif isinstance(value, str):
            setattr(req.constraint, name, value)
        else:
            raise ApiError(400, f"'tandem.{name}' must be a string", param="tandem")


def _llama_cpp(body: dict[str, Any], req: engine_pb2.GenerateRequest) -> None:
    grammar, schema = body.get("grammar"), body.get("json_schema")
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar:
            raise ApiError(400, "'grammar' must be a GBNF grammar (a string)", param="grammar")
        req.constraint.gbnf = grammar
    if schema is not None:
        if not isinstance(schema, dict):
            raise ApiError(400, "'json_schema' must be a JSON schema object", param="json_schema")
        req.constraint.json_schema = json.dumps(schema)
