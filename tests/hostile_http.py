"""Raw bytes to an HTTP port, for what no HTTP client library will send (a broken request line, bad chunked
framing, a header too long): the status and body that come back, parsed loosely."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass

CHUNK = 65536


@dataclass
class RawReply:
    status: int | None  # None: the server closed without answering
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


def parse_reply(data: bytes) -> RawReply:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines[0].startswith("HTTP/"):
        return RawReply(None, {}, data)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = _unchunk(body)
    elif "content-length" in headers:
        body = body[:int(headers["content-length"])]
    return RawReply(int(lines[0].split()[1]), headers, body)


def _unchunk(body: bytes) -> bytes:
    out = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, body = out + rest[:size], rest[size + 2:]
    return out


def send_raw(host: str, port: int, data: bytes, timeout: float = 10.0, half_close: bool = False) -> RawReply:
    """Send `data` on a fresh connection and read until the server closes it (or answers a complete response)."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before taking everything: read what it said
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        received = b""
        while True:
            try:
                part = sock.recv(CHUNK)
            except (ConnectionResetError, TimeoutError):
                break
            if not part:
                break
            received += part
            reply = parse_reply(received)
            length = reply.headers.get("content-length")
            if reply.status is not None and length is not None and len(reply.body) >= int(length):
                break
    return parse_reply(received)


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    """An HTTP/1.1 request as bytes (Content-Length set unless `headers` frame the body themselves)."""
    headers = {"Host": "test", "Connection": "close"} | (headers or {})
    if body and "Transfer-Encoding" not in headers and "Content-Length" not in headers:
        headers["Content-Length"] = str(len(body))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return head.encode("latin-1") + body


def _post(path: str, body: bytes, **headers: str) -> bytes:
    return request("POST", path, body, {"Content-Type": "application/json"} | headers)


GOOD_BODY = b'{"model": "m", "prompt": "hi", "max_tokens": 2}'
# What aiohttp's parser refuses before any handler runs: (name, the bytes sent). Each must be answered 400 (or
# closed without a word, for bytes that are not HTTP at all), with no traceback in the log.
PARSER_ERRORS = [
    ("garbage request line", b"GARBAGE\r\n\r\n"),
    ("bad method", b"G(T /health HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("bad version", b"GET /health HTTP/1.x\r\nHost: x\r\n\r\n"),
    ("header without a colon", b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n"),
    ("header too long", request("GET", "/health", headers={"X-Big": "a" * 10_000})),
    ("request line too long", request("GET", "/" + "a" * 10_000)),
    ("too many headers", request("GET", "/health", headers={f"X-H{i}": "v" for i in range(200)})),
    ("NUL in a header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n"),
    ("content-length not a number", request("POST", "/v1/completions", b"{}", {"Content-Length": "abc"})),
    ("negative content-length", request("POST", "/v1/completions", b"{}", {"Content-Length": "-1"})),
    ("content-length and chunked", request("POST", "/v1/completions", b"2\r\n{}\r\n0\r\n\r\n",
                                           {"Content-Length": "12", "Transfer-Encoding": "chunked"})),
    ("bad chunk size", _post("/v1/completions", b"zz\r\n{}\r\n0\r\n\r\n", **{"Transfer-Encoding": "chunked"})),
    ("chunk longer than its size", _post("/v1/completions", b"2\r\n{\"a\": 1}\r\n0\r\n\r\n",
                                         **{"Transfer-Encoding": "chunked"})),
    ("unknown transfer-encoding", _post("/v1/completions", b"{}", **{"Transfer-Encoding": "gzip, zebra"})),
]
# Not HTTP at all (a TLS ClientHello on the plain port): no reply is needed, only no traceback.
NOT_HTTP = [("TLS on the plain port", bytes.fromhex("16030100c4010000c00303") + b"\x00" * 64)]
# What reaches the front and must be refused by it: (name, bytes, status, param).
BODY_ERRORS = [
    ("content-length over the limit", _post("/v1/completions", b"", **{"Content-Length": str(1 << 40)}), 413, None),
    ("form body", request("POST", "/v1/completions", b"prompt=hi",
                          {"Content-Type": "application/x-www-form-urlencoded"}), 415, None),
    ("invalid UTF-8", _post("/v1/completions", b'{"model": "m", "prompt": "\xff\xfe"}'), 400, None),
    ("UTF-8 encoded surrogate", _post("/v1/completions", b'{"model": "m", "prompt": "\xed\xa0\x80"}'), 400, None),
    ("lone surrogate escape", _post("/v1/completions", b'{"model": "m", "prompt": "\\ud800"}'), 400, "prompt"),
    ("lone surrogate in chat", _post("/v1/chat/completions",
                                     b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}'),
     400, "messages[0].content"),
    ("lone surrogate to tokenize", _post("/tokenize", b'{"prompt": "a\\ud800"}'), 400, "prompt"),
    ("deep nesting", _post("/v1/completions", b'{"model": "m", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
     400, None),
    ("NaN", _post("/v1/completions", b'{"model": "m", "prompt": "x", "temperature": NaN}'), 400, None),
    ("not an object", _post("/v1/completions", b"[1, 2]"), 400, None),
    ("empty body", _post("/v1/chat/completions", b""), 400, None),
    # A header aiohttp decodes with surrogateescape: 401 with a token set (not a 500), else the request's answer.
    ("non-UTF-8 authorization", _post("/v1/completions", GOOD_BODY).replace(
        b"Content-Type:", b"Authorization: Bearer \xff\xfe\r\nContent-Type:"), None, None),
]
