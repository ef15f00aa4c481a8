"""HTTP JSON bodies (router_service/json_body.py): each kind of bad body is an OpenAI-shaped 4xx naming what was
wrong, checked before (size, media type, UTF-8, depth) or while (strict JSON, surrogates) it is parsed."""

from __future__ import annotations

import json
import time

import pytest

from expertmesh.router_service.json_body import check_content_type, json_depth, parse_object
from expertmesh.router_service.openai_api import OpenAIError

JSON = "application/json"


def refused(raw: bytes, content_type: str | None = JSON, max_depth: int = 32) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse_object(raw, content_type, max_depth)
    return info.value


def test_an_object_parses():
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "héllo 😀 [{"}]}]}
    assert parse_object(json.dumps(body).encode(), JSON, 32) == body  # ensure_ascii: the emoji as an escaped pair
    assert parse_object(json.dumps(body, ensure_ascii=False).encode(), JSON, 32) == body
    assert parse_object(b'{"a": 1}', None, 32) == {"a": 1}  # no Content-Type: JSON, as FastAPI servers take it


@pytest.mark.parametrize("raw", [b"{", b"", b"{'a': 1}", b'{"a": NaN}', b'{"a": Infinity}', b'{"a": -Infinity}',
                                 b'{"a": 1' + b"1" * 5000 + b"}", b'{"a": 1} x', b"\xef\xbb\xbf{}"])
def test_what_is_not_strict_json_is_400(raw):
    error = refused(raw)
    assert error.status == 400 and error.param is None and "not valid JSON" in error.message, error.message
    assert error.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("raw", "kind"), [(b"[1]", "list"), (b'"x"', "str"), (b"3", "int"), (b"null", "NoneType")])
def test_a_body_that_is_not_an_object_is_400(raw, kind):
    error = refused(raw)
    assert error.status == 400 and f"must be a JSON object, got {kind}" in error.message


@pytest.mark.parametrize("raw", [b'{"prompt": "\xff"}', b'{"prompt": "\xc0\xaf"}',  # overlong "/"
                                 b'{"prompt": "\xed\xa0\x80"}',  # U+D800 encoded (json.loads(bytes) took it)
                                 b'{"prompt": "\xe2\x82"}', '{"p": 1}'.encode("utf-16")])
def test_bytes_that_are_not_utf8_are_400_saying_where(raw):
    error = refused(raw)
    assert error.status == 400 and "not valid UTF-8" in error.message and "at offset" in error.message


@pytest.mark.parametrize(("raw", "param"), [
    (rb'{"prompt": "\ud800"}', "prompt"),
    (rb'{"prompt": "ok \udfff"}', "prompt"),
    (rb'{"prompt": "\ud83d x \ude00"}', "prompt"),  # both halves, not a pair
    (rb'{"messages": [{"role": "user", "content": "\udc00"}]}', "messages[0].content"),
    (rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud800b"}]}]}',
     "messages[0].content[0].text"),
    (rb'{"stop": ["fine", "\ud801"]}', "stop[1]"),
    (rb'{"logit_bias": {"\ud800": 1}}', "logit_bias.(a key)"),
])
def test_a_lone_surrogate_is_400_naming_the_field(raw, param):
    error = refused(raw)
    assert error.status == 400 and error.param == param and "surrogate" in error.message, error.message


def test_an_escaped_backslash_before_u_is_text_not_a_surrogate():
    assert parse_object(rb'{"prompt": "\\ud800"}', JSON, 32) == {"prompt": "\\ud800"}


@pytest.mark.parametrize("header", ["application/json", "application/json; charset=utf-8", "Application/JSON",
                                    'application/json;charset="UTF-8"', "application/vnd.api+json", None, "",
                                    "application/json; charset=us-ascii"])
def test_json_media_types_pass(header):
    check_content_type(header)


@pytest.mark.parametrize("header", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data; b=x",
                                    "application/jsonx", "json", "application/json; charset=utf-16",
                                    "application/json; charset=latin-1"])
def test_other_media_types_are_415(header):
    error = refused(b"{}", header)
    assert error.status == 415 and error.code == "unsupported_media_type" and "Content-Type" in error.message
    assert error.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("text", "depth"), [
    ("1", 0), ('"[[["', 0), ("[]", 1), ("{}", 1), ('{"a": [1, {"b": "[[[["}]}', 3), (r'{"a": "\"[["}', 1),
    (r'{"a": "\\"}', 1), (r'{"a": "\\\"[[", "b": [[]]}', 3), ("[[[", 3), ("[" * 1000, 1000), ("[]" * 1000, 1),
    ('{"é😀": [["ü"]]}', 3),
])
def test_depth_is_what_the_parser_sees(text, depth):
    assert json_depth(text) == depth


def test_depth_over_the_limit_is_400_before_parsing():
    for raw in (b"[" * 100_000, b"[" * 33 + b"]" * 33, b'{"a":' * 40 + b"1" + b"}" * 40):
        error = refused(raw)
        assert error.status == 400 and "server.max_json_depth" in error.message and "32" in error.message
    ok = b"[" * 31 + b"]" * 31
    assert parse_object(b'{"a": ' + ok + b"}", JSON, 32) == {"a": json.loads(ok)}
    assert refused(b'{"a": [[[1]]]}', max_depth=3).status == 400
    assert parse_object(b'{"a": [[[1]]]}', JSON, 4) == {"a": [[[1]]]}


def test_a_deep_body_used_to_raise_recursion_error():
    """Why the depth check exists: Python's parser recurses per level."""
    with pytest.raises(RecursionError):
        json.loads("[" * 100_000 + "]" * 100_000)


def seconds(work, runs: int = 3) -> float:
    """The fastest of `runs` runs: what the work costs, less the noise of a shared machine."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


@pytest.mark.parametrize("text", [
    json.dumps({"prompt": "def f(x):\n    return [x] * {2}\n" * 500_000}),  # 16 MB of text, brackets in strings
    "[" + ",".join(["[]"] * 200_000) + "]",  # 600 kB of brackets (a Python loop over 16 MB of them took 6-9 s)
])
def test_checking_the_depth_costs_less_than_parsing(text):
    """Measured against json.loads on the same text, on the same machine at the same time (no absolute bound)."""
    assert seconds(lambda: json_depth(text)) < 1.5 * seconds(lambda: json.loads(text), runs=1) + 0.05


def test_the_depth_setting_is_validated_naming_the_field():
    from expertmesh.router_service.config import MAX_JSON_DEPTH, ServerConfig

    assert ServerConfig().max_json_depth == 32 and ServerConfig(max_json_depth=MAX_JSON_DEPTH).validate()
    for bad in (7, MAX_JSON_DEPTH + 1):
        with pytest.raises(ValueError, match=r"^max_json_depth: must be in \[8, 256\]"):
            ServerConfig(max_json_depth=bad).validate()
