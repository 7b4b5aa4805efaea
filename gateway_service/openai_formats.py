"""OpenAI's `response_format` (and Tandem's own constraint extras) onto a GenerateRequest's
structured-output constraint. The engine compiles and checks it: a schema it cannot take
comes back INVALID_ARGUMENT, which the front answers 400."""

from __future__ import annotations

import json
from typing import Any

from gateway_service.openai_wire import ApiError
from tandem_wire.pb import engine_pb2

# `"tandem": {...}` keys naming a constraint, one at most (the API has no place for them).
CONSTRAINT_EXTRAS = ("regex", "choice", "lark", "gbnf")


def apply_constraint(body: dict[str, Any], req: engine_pb2.GenerateRequest) -> None:
    """response_format: text (none), json_object, or json_schema {name, schema, strict};
    or one of CONSTRAINT_EXTRAS under "tandem"."""
    extra = body.get("tandem") or {}
    given = [k for k in CONSTRAINT_EXTRAS if k in extra]
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if fmt is not None and not isinstance(fmt, dict):
        raise ApiError(400, "'response_format' must be an object", param="response_format")
    if kind not in (None, "text") and given:
        raise ApiError(400, "one constraint at most: response_format or tandem." + given[0])
    if len(given) > 1:
        raise ApiError(400, f"one constraint at most, got tandem.{given}", param="tandem")
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
