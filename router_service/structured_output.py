"""Structured output: the request fields that constrain what a model may generate -> one llguidance grammar.
Pure (llguidance only, no torch, no Ray): the HTTP front validates here, at the boundary, so an unsupported schema is
a 400 naming the field the client sent; the router turns the grammar into per-step token masks
(router_service/grammar_mask.py).

Accepted, at most one per request (docs/serving/openai-http.md):
  response_format  {"type": "text"} (no constraint), {"type": "json_object"},
                   {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}        (OpenAI)
  structured_outputs {"json": schema | string, "regex": str, "choice": [str], "grammar": lark str,
                      "json_object": true}                                                       (vLLM ≥ 0.10.2)
  guided_json / guided_regex / guided_choice / guided_grammar                            (vLLM's older names)

JSON is generated compact (", " and ": " between items, no other whitespace): a grammar that allowed free whitespace
would let a weak model spend its whole budget on spaces and newlines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from llguidance import LLMatcher

from .openai_errors import OpenAIError, invalid

# llguidance's JSON compiler options for every JSON grammar (see the module docstring).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CHOICES = 1024  # a guided_choice longer than this is refused (each is a grammar alternative)
MAX_SPEC_BYTES = 256 * 1024  # a schema / regex / grammar above this size is refused before compiling it

_VLLM_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    """A validated output constraint: which kind, the request field it came from (for errors), and the llguidance
    grammar (a string LLMatcher takes)."""

    kind: str  # "json_object" | "json_schema" | "regex" | "choice" | "grammar" | "tool_call"
    param: str
    grammar: str


def _invalid(param: str, message: str) -> OpenAIError:
    return invalid(param, message)


def parse(body: dict) -> Constraint | None:
    """The request's output constraint, or None. OpenAIError (400 naming the field) when a field is malformed, when
    two constraints are given, or when llguidance cannot compile it (an unsupported schema keyword, a regex with
    look-around, a grammar with a syntax error)."""
    found: list[tuple[str, str, object]] = []  # (param, vLLM kind, value)
    response_format = body.get("response_format")
    if response_format is not None:
        found.extend(_response_format(response_format))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise _invalid("structured_outputs", "must be an object with one of " + ", ".join(_VLLM_KEYS))
        given = [k for k in _VLLM_KEYS if outputs.get(k) not in (None, False)]
        unknown = sorted(set(outputs) - set(_VLLM_KEYS) - {"disable_any_whitespace", "disable_additional_properties",
                                                           "whitespace_pattern", "disable_fallback"})
        if unknown:
            raise _invalid(f"structured_outputs.{unknown[0]}", "is not supported (supported: "
                                                               + ", ".join(_VLLM_KEYS) + ")")
        found.extend((f"structured_outputs.{k}", k, outputs[k]) for k in given)
    for name, kind in _LEGACY.items():
        if body.get(name) is not None:
            found.append((name, kind, body[name]))
    if not found:
        return None
    if len(found) > 1:
        raise _invalid(found[1][0], f"only one output constraint per request; {found[0][0]} is already given")
    param, kind, value = found[0]
    return compile_constraint(param, kind, value)


def _response_format(value) -> list[tuple[str, str, object]]:
    if not isinstance(value, dict):
        raise _invalid("response_format", "must be an object with a type: text, json_object or json_schema")
    kind = value.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_object", True)]
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise _invalid("response_format.json_schema", "required with type json_schema: an object with name "
                                                          "and schema")
        schema = spec.get("schema")
        if schema is None:  # OpenAI allows it to be left out: any JSON object
            return [("response_format", "json_object", True)]
        return [("response_format", "json", schema)]
    raise _invalid("response_format", f"type must be text, json_object or json_schema, got "
                                      f"{json.dumps(kind)[:64]}")


def compile_constraint(param: str, kind: str, value) -> Constraint:
    """One constraint (vLLM's kind: json, json_object, regex, choice, grammar) -> a checked llguidance grammar."""
    if kind == "json_object":
        grammar, kind_name = schema_grammar({"type": "object"}), "json_object"
    elif kind == "json":
        if isinstance(value, str):  # vLLM accepts the schema as a JSON string
            try:
                value = json.loads(value)
            except ValueError:
                raise _invalid(param, "must be a JSON schema (an object, or a string holding one)") from None
        if not isinstance(value, dict | bool):
            raise _invalid(param, "must be a JSON schema (an object)")
        _check_size(param, json.dumps(value))
        grammar, kind_name = schema_grammar(value), "json_schema"
    elif kind == "regex":
        if not isinstance(value, str) or not value:
            raise _invalid(param, "must be a non-empty regular expression string")
        _check_size(param, value)
        grammar, kind_name = LLMatcher.grammar_from_regex(value), "regex"
    elif kind == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise _invalid(param, f"must be a list of 1 to {MAX_CHOICES} non-empty strings")
        _check_size(param, json.dumps(value))
        grammar, kind_name = choice_grammar(value), "choice"
    elif kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise _invalid(param, "must be a Lark grammar string (llguidance's syntax)")
        _check_size(param, value)
        grammar, kind_name = LLMatcher.grammar_from_lark(value), "grammar"
    else:
        raise _invalid(param, f"unknown constraint kind {kind!r}")
    check(param, grammar)
    return Constraint(kind=kind_name, param=param, grammar=grammar)


def schema_grammar(schema: dict | bool) -> str:
    """A JSON schema -> llguidance grammar (compact JSON; not yet validated: `check`)."""
    return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def choice_grammar(choices: list[str]) -> str:
    """Exactly one of the strings (as a Lark grammar of literal alternatives)."""
    return LLMatcher.grammar_from_lark("start: " + " | ".join(lark_literal(c) for c in choices))


def lark_literal(text: str) -> str:
    """A Lark string literal matching `text` exactly (JSON string escapes are Lark's)."""
    return json.dumps(text)


def check(param: str, grammar: str) -> None:
    """Refuse a grammar llguidance cannot build (without a tokenizer: the grammar itself), naming `param`."""
    error = LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        # llguidance's message spans lines (the error, then the source with a caret): keep the words, one line.
        lines = [ln.strip() for ln in error.splitlines() if ln.strip() and not set(ln.strip()) <= {"^"}]
        raise _invalid(param, f"cannot be compiled to a grammar: {' '.join(lines)[:400]}")


def _check_size(param: str, text: str) -> None:
    if len(text) > MAX_SPEC_BYTES:
        raise _invalid(param, f"{len(text)} bytes exceed the server's limit of {MAX_SPEC_BYTES}")
