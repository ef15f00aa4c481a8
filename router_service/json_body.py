"""An HTTP request's JSON body, read and checked before and while it is parsed, so that every client mistake is an
OpenAI-shaped 4xx naming what was wrong, never a 500. No Ray; aiohttp only for the request being read.

In order, each before the next costs anything:
- the size: Content-Length over `server.max_message_bytes` is refused before a byte is read (413); a chunked body
  is cut off at the same limit by aiohttp (client_max_size) and refused the same way;
- a body that cannot be read whole (bad chunked encoding, a connection that ends early): 400;
- the media type: JSON (`application/json`, `application/*+json`) or none given, as FastAPI-based servers (vLLM)
  accept; a form or text body is 415, a charset other than UTF-8 is 415;
- strict UTF-8: bytes that are not UTF-8 are 400, where `json.loads(bytes)` used to guess UTF-16/32 and let
  encoded surrogates through;
- the nesting depth (`server.max_json_depth`), counted on the text before it is parsed: Python's parser recurses
  per level, and a body of 100 000 `[` ended in RecursionError, a 500 with a traceback;
- JSON itself, strictly: NaN / Infinity are not JSON (Python's parser takes them);
- an object at the top (400), with no lone UTF-16 surrogate in any string (`"\\ud800"` parses to a str that the
  tokenizer and every encoder refuse: it failed later as a 500). The error names where it is (`messages[0].content`).
"""

from __future__ import annotations

import json
import re

import numpy as np
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from .openai_api import OpenAIError, invalid

# A bracket's byte -> +1 (opens) or -1 (closes), any other byte 0. Brackets are ASCII, and no byte of a multi-byte
# UTF-8 character is below 0x80, so counting on the UTF-8 bytes counts the characters.
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800-\udfff: paired (an emoji) or not
_SURROGATE = re.compile("[\ud800-\udfff]")
UTF8_CHARSETS = frozenset({"utf-8", "utf8", "us-ascii", "ascii"})  # ASCII is UTF-8


def _error(status: int, message: str, code: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(status, message, param=param, code=code)


def check_content_type(header: str | None) -> None:
    """JSON, or no Content-Type at all; anything else is 415 naming what was sent."""
    if header is None or not header.strip():
        return
    media, *params = header.split(";")
    media = media.strip().lower()
    kind, _, subtype = media.partition("/")
    if kind != "application" or not (subtype == "json" or subtype.endswith("+json")):
        raise _error(415, f"Content-Type: expected application/json, got {header[:80]!r}", "unsupported_media_type")
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in UTF8_CHARSETS:
            raise _error(415, f"Content-Type: JSON bodies are UTF-8, got charset {value.strip()[:40]!r}",
                         "unsupported_media_type")


def decode_utf8(raw: bytes) -> str:
    """The body as text, strictly UTF-8 (no surrogates, no overlong forms), else 400 saying where it broke."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start:exc.start + 4].hex(" ")
        raise invalid(None, f"the body is not valid UTF-8: bytes {bad} at offset {exc.start}") from None


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in `text` (0: a scalar) as a JSON parser sees them; for text that is not
    JSON, never less than the depth a parser reaches before it fails. Every pass is a C loop (str.replace, split,
    re, numpy): 16 MB of brackets take ~0.3 s, where a Python loop over the characters took 6-9 s."""
    # Strings out, so that a bracket inside one is text: escaped backslashes first (they cannot escape a quote),
    # then escaped quotes; every quote left delimits a string, whose contents are the odd pieces between quotes.
    unescaped = text.replace("\\\\", "").replace('\\"', "")
    outside = "".join(unescaped.split('"')[::2])
    steps = _STEP[np.frombuffer(outside.encode("utf-8", "surrogatepass"), dtype=np.uint8)]
    steps = steps[steps != 0]
    return int(np.cumsum(steps, dtype=np.int64).max()) if steps.size else 0


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _surrogate_at(value, path: str) -> str | None:
    """The path of the first string (value or key) in `value` holding a lone surrogate, else None."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else key
            if _SURROGATE.search(key):
                return f"{path}.(a key)" if path else "(a key)"
            found = _surrogate_at(item, inner)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _surrogate_at(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def parse_object(raw: bytes, content_type: str | None, max_depth: int) -> dict:
    """The body as a dict, or the OpenAIError (415 / 400) that says what is wrong with it."""
    check_content_type(content_type)
    text = decode_utf8(raw)
    depth = json_depth(text)
    if depth > max_depth:
        raise invalid(None, f"the body nests {depth} levels deep; the limit is {max_depth} (server.max_json_depth)")
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # RecursionError: only if the depth count above were wrong
        raise invalid(None, f"the body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise invalid(None, f"the body must be a JSON object, got {type(body).__name__}")
    # A lone surrogate can only come from a \\u escape (strict UTF-8 has none), so only a body with such an escape is
    # walked (most have none; an emoji sent as an escaped pair is walked and passes).
    where = _surrogate_at(body, "") if _SURROGATE_ESCAPE.search(text) else None
    if where is not None:
        raise invalid(where, "holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is not text")
    return body


def too_large(size: int | None, limit: int) -> OpenAIError:
    got = f"{size} bytes" if size is not None else "the body"
    return _error(413, f"{got} exceeds the server's limit of {limit} bytes (server.max_message_bytes)",
                  "request_too_large")


async def read_json_object(request: web.Request, max_bytes: int, max_depth: int) -> dict:
    """Read `request`'s body within `max_bytes` and parse it (parse_object). The application's client_max_size
    must be `max_bytes` too: it is what stops a chunked body, whose size is not known in advance."""
    size = request.content_length
    if size is not None and size > max_bytes:
        raise too_large(size, max_bytes)  # before reading a byte
    check_content_type(request.headers.get("Content-Type"))  # before reading, too
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large(size, max_bytes) from None
    except RequestPayloadError as exc:  # bad chunked framing, a body shorter than its Content-Length, ...
        raise invalid(None, f"the body could not be read: {str(exc)[:200]}") from None
    return parse_object(raw, request.headers.get("Content-Type"), max_depth)
