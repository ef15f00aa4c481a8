"""Tool calls in chat: the request's `tools` / `tool_choice` validated, the model's tool-call syntax recognised from
its chat template, generated text parsed into OpenAI `tool_calls`, and the grammar that forces a call when
`tool_choice` is "required" or names a function. Pure (llguidance for the grammar, no torch, no Ray): the HTTP front
parses and validates here; the router renders `tools` through the chat template and constrains with the grammar;
the front parses the generated text (router_service/openai_responses.py).

Families, recognised by what their published chat templates write (docs/serving/openai-http.md):
  hermes    Qwen2.5 / Qwen3 / Hermes:  <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
  deepseek  DeepSeek-V3 / R1 / V3.1:   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                                       \n```json\n{...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
                                       (V3.1: NAME<｜tool▁sep｜>{...} without the fence)
  glm45     GLM-4.5 / 4.6:             <tool_call>NAME\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>
  harmony   gpt-oss:                   <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
A template that writes none of these (the embedded demo model's) gets the hermes syntax: its calls are then only
what a forced `tool_choice` produces.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from llguidance import LLMatcher

from .openai_errors import OpenAIError, invalid
from .structured_output import JSON_OPTIONS, Constraint, check, lark_literal

_NAME = re.compile(r"^[A-Za-z0-9_\-.]{1,64}$")  # OpenAI's function-name rule (plus ".", which MCP names use)
FAMILIES = ("hermes", "deepseek", "glm45", "harmony")


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's validated tools: the OpenAI tool objects, and the choice ("auto", "none", "required", or
    "named" with `name`)."""

    tools: tuple[dict, ...]
    choice: str = "auto"
    name: str | None = None

    @property
    def functions(self) -> list[dict]:
        return [t["function"] for t in self.tools]

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")


def _invalid(param: str, message: str) -> OpenAIError:
    return invalid(param, message)


def parse_tools(body: dict) -> ToolRequest | None:
    """`tools` and `tool_choice` of a chat body -> ToolRequest, or None when no tool may be called. OpenAIError (400
    naming the field) when malformed."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise _invalid("functions", "the deprecated functions / function_call are not supported; use tools")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise _invalid("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list):
        raise _invalid("tools", "must be a list of {\"type\": \"function\", \"function\": {name, parameters}}")
    clean, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise _invalid(where, "must be {\"type\": \"function\", \"function\": {...}} (only function tools)")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _invalid(f"{where}.function.name", "must be 1-64 letters, digits, _, - or .")
        if name in names:
            raise _invalid(f"{where}.function.name", f"{name!r} is given twice")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _invalid(f"{where}.function.parameters", "must be a JSON schema object")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise _invalid(f"{where}.function.description", "must be a string")
        clean.append({"type": "function", "function": {
            "name": name, **({"description": description} if description is not None else {}),
            "parameters": params}})
    if choice is None or choice == "auto":
        request = ToolRequest(tuple(clean), "auto")
    elif choice == "none":
        return None
    elif choice == "required":
        request = ToolRequest(tuple(clean), "required")
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise _invalid("tool_choice", f"names function {json.dumps(name)[:64]}, which is not in tools")
        request = ToolRequest(tuple(clean), "named", name)
    else:
        raise _invalid("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"function\": "
                                      "{\"name\": ...}}")
    return request


def family_of(template_source: str | None) -> str:
    """Which tool-call syntax a chat template writes (module docstring); hermes when it writes none."""
    source = template_source or ""
    if "<|channel|>" in source or "to=functions." in source:
        return "harmony"
    if "tool▁call▁begin" in source or "tool▁calls▁begin" in source:
        return "deepseek"
    if "<arg_key>" in source:
        return "glm45"
    return "hermes"


# ---- the forcing grammar ---------------------------------------------------------------------------------------

def forced_grammar(request: ToolRequest, family: str = "hermes", special_ids: dict[str, int] | None = None
                  ) -> Constraint:
    """The grammar that makes the model call a tool in its family's syntax: one call of the named function, or of
    any of the tools ("required"), its arguments following the function's parameters schema. special_ids: the
    tokenizer's special tokens (text -> id); a marker that is one is named in the grammar by its id (its text alone
    would never produce the special token), any other is literal text. The front builds the hermes grammar without
    a tokenizer to check the schemas (a schema llguidance cannot compile: 400 naming tools); the router rebuilds it
    for the model's family and tokenizer."""
    specials = special_ids or {}

    def mark(text: str) -> str:
        return f"<[{specials[text]}]>" if text in specials else lark_literal(text)

    functions = [f for f in request.functions if request.choice != "named" or f["name"] == request.name]
    rules = [_FAMILY_RULES[family](k, fn, mark) for k, fn in enumerate(functions)]
    head, tail = _FAMILY_FRAME[family]
    lark = f"start: {' '.join(mark(m) if m.startswith('<') else lark_literal(m) for m in head)} call" \
           f"{''.join(' ' + mark(m) for m in tail)}\ncall: " + " | ".join(f"call{k}" for k in range(len(rules))) \
           + "\n" + "\n".join(rules) + "\n"
    grammar = LLMatcher.grammar_from_lark(lark)
    check("tools", grammar)
    return Constraint(kind="tool_call", param="tools", grammar=grammar)


def _json_rule(name: str, schema) -> str:
    return f"{name}: %json {json.dumps(schema | {'x-guidance': JSON_OPTIONS} if isinstance(schema, dict) else schema)}"


def _hermes_rule(k: int, fn: dict, mark) -> str:
    schema = {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False}
    return f"call{k}: args{k}\n" + _json_rule(f"args{k}", schema)


def _deepseek_rule(k: int, fn: dict, mark) -> str:
    opening = lark_literal(fn["name"] + "\n```json\n")
    closing = lark_literal("\n```")
    return (f"call{k}: {lark_literal('function')} {mark('<｜tool▁sep｜>')} {opening} args{k} {closing} "
            f"{mark('<｜tool▁call▁end｜>')}\n" + _json_rule(f"args{k}", fn["parameters"]))


def _harmony_rule(k: int, fn: dict, mark) -> str:
    return (f"call{k}: {lark_literal(fn['name'] + ' ')} {mark('<|constrain|>')} {lark_literal('json')} "
            f"{mark('<|message|>')} args{k} {mark('<|call|>')}\n" + _json_rule(f"args{k}", fn["parameters"]))


def _glm45_rule(k: int, fn: dict, mark) -> str:
    """GLM's <arg_key>/<arg_value> pairs: the schema's required parameters in their declared order (optional ones
    left out), a string parameter as raw text without "<", any other as JSON following its schema."""
    params = fn["parameters"] if isinstance(fn["parameters"], dict) else {}
    props = params.get("properties", {}) if isinstance(params.get("properties"), dict) else {}
    required = [p for p in props if p in (params.get("required") or [])]
    parts, rules = [lark_literal(fn["name"] + "\n")], []
    for j, key in enumerate(required):
        prop = props[key] if isinstance(props[key], dict) else {}
        value = f"v{k}_{j}"
        parts += [mark("<arg_key>"), lark_literal(key), mark("</arg_key>"), lark_literal("\n"), mark("<arg_value>"),
                  value, mark("</arg_value>"), lark_literal("\n")]
        rules.append(f"{value}: /[^<]*/" if prop.get("type") == "string" else _json_rule(value, prop))
    return f"call{k}: " + " ".join(parts) + "\n" + "\n".join(rules)


_FAMILY_RULES = {"hermes": _hermes_rule, "deepseek": _deepseek_rule, "harmony": _harmony_rule, "glm45": _glm45_rule}
# Per family: the markers before the call (literal text unless it starts with "<", then a possible special token)
# and after it. harmony's output starts after the template's "<|start|>assistant".
_FAMILY_FRAME = {
    "hermes": (["<tool_call>", "\n"], ["\n", "</tool_call>"]),
    "deepseek": (["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"], ["<｜tool▁calls▁end｜>"]),
    "harmony": (["<|channel|>", "commentary to=functions."], []),
    "glm45": (["<tool_call>"], ["</tool_call>"]),
}


# ---- parsing generated text ------------------------------------------------------------------------------------

@dataclass
class Parsed:
    """Generated text split into what the user reads and the calls: (name, arguments as a JSON string)."""

    content: str
    calls: list[tuple[str, str]] = field(default_factory=list)


def _arguments(value) -> str | None:
    """Arguments as OpenAI sends them: a JSON string of an object (a string that holds JSON is kept as is)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


_DECODER = json.JSONDecoder()
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes(text: str) -> Parsed:
    """Qwen / Hermes: each <tool_call>{"name", "arguments"}</tool_call>. The closing tag may be missing or cut (the
    model stopped at end-of-sequence or max_tokens right after the JSON). A block that is not a call stays in the
    content."""
    content, calls, at, search = [], [], 0, 0
    while (start := text.find(_HERMES_OPEN, search)) != -1:
        body = start + len(_HERMES_OPEN)
        while body < len(text) and text[body].isspace():
            body += 1
        try:
            obj, end = _DECODER.raw_decode(text, body)
        except ValueError:
            search = body
            continue
        call = _json_call(obj)
        if call is None:
            search = end
            continue
        rest = text[end:].lstrip()
        if rest.startswith(_HERMES_CLOSE):
            end = len(text) - len(rest) + len(_HERMES_CLOSE)
        elif _HERMES_CLOSE.startswith(rest.rstrip()):  # cut inside the closing tag: it ends the text
            end = len(text)
        content.append(text[at:start])
        calls.append(call)
        at = search = end
    content.append(text[at:])
    return Parsed("".join(content).strip() if calls else text, calls)


def _json_call(obj) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = _arguments(obj.get("arguments", obj.get("parameters", {})))
    return None if args is None else (obj["name"], args)


_DS_BEGIN = "<｜tool▁calls▁begin｜>"
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(?:(?P<type>\w+)<｜tool▁sep｜>(?P<name>[^\n<]+)\n```(?:json)?\n"
                      r"(?P<args>.*?)\n```|(?P<name31>[^<]+?)<｜tool▁sep｜>(?P<args31>.*?))<｜tool▁call▁end｜>", re.S)


def parse_deepseek(text: str) -> Parsed:
    """DeepSeek-V3 / R1 (function<｜tool▁sep｜>NAME, arguments in a ```json fence) and V3.1
    (NAME<｜tool▁sep｜>{...}); the content is the text before the calls."""
    at = text.find(_DS_BEGIN)
    if at == -1:
        return Parsed(text)
    calls = []
    for match in _DS_CALL.finditer(text, at):
        name = match.group("name") or match.group("name31")
        args = _arguments(match.group("args") if match.group("args") is not None else match.group("args31"))
        if name and args is not None:
            calls.append((name.strip(), args))
    if not calls:
        return Parsed(text)
    return Parsed(text[:at].strip(), calls)


_GLM_CALL = re.compile(r"<tool_call>\s*(?P<name>[^\n<]+?)\s*(?P<body>(?:<arg_key>.*?)?)\s*</tool_call>", re.S)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def parse_glm45(text: str, tools: tuple[dict, ...] = ()) -> Parsed:
    """GLM-4.5: <tool_call>NAME then <arg_key>/<arg_value> pairs. A value is a string unless the function's schema
    types that parameter otherwise (then it is read as JSON, as GLM's template writes non-strings with tojson)."""
    types = {t["function"]["name"]: t["function"].get("parameters", {}).get("properties", {}) for t in tools}
    content, calls, at = [], [], 0
    for match in _GLM_CALL.finditer(text):
        name = match.group("name").strip()
        props = types.get(name, {})
        args = {}
        for key, raw in _GLM_ARG.findall(match.group("body")):
            key = key.strip()
            declared = props.get(key, {}).get("type") if isinstance(props.get(key), dict) else None
            value = raw
            if declared != "string":
                try:
                    value = json.loads(raw)
                except ValueError:
                    value = raw
            args[key] = value
        content.append(text[at:match.start()])
        calls.append((name, json.dumps(args, ensure_ascii=False)))
        at = match.end()
    content.append(text[at:])
    return Parsed("".join(content).strip() if calls else text, calls)


_HARMONY_MESSAGE = re.compile(r"(?:<\|start\|>)?(?P<header>(?:(?!<\|message\|>|<\|start\|>).)*)<\|message\|>"
                              r"(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|$)", re.S)
_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_\-.]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


def parse_harmony(text: str) -> Parsed:
    """gpt-oss harmony: messages `[<|start|>assistant]<|channel|>C[ to=functions.NAME][ <|constrain|>json]<|message|>
    BODY<|end|>|<|call|>|<|return|>`. A message to functions.NAME is a call (BODY: its JSON arguments); the final
    channel is the content; analysis (reasoning) is not returned. Text without any harmony header is content."""
    messages = list(_HARMONY_MESSAGE.finditer(text))
    if not messages:
        return Parsed(text)
    content, calls = [], []
    for match in messages:
        header = match.group("header")
        recipient = _RECIPIENT.search(header)
        if recipient:
            args = _arguments(match.group("body").strip())
            if args is not None:
                calls.append((recipient.group(1), args))
            continue
        channel = _CHANNEL.search(header)
        if channel is None or channel.group(1) == "final":
            content.append(match.group("body"))
    return Parsed("".join(content).strip(), calls)


def parse(text: str, family: str, tools: tuple[dict, ...] = ()) -> Parsed:
    if family == "hermes":
        return parse_hermes(text)
    if family == "deepseek":
        return parse_deepseek(text)
    if family == "glm45":
        return parse_glm45(text, tools)
    if family == "harmony":
        return parse_harmony(text)
    raise ValueError(f"unknown tool-call family {family!r}")


# Where calls may begin; harmony's whole output is headed messages, so it is parsed from the first character.
START_MARKERS = {"hermes": "<tool_call>", "deepseek": _DS_BEGIN, "glm45": "<tool_call>", "harmony": ""}


def call_id() -> str:
    """An id for one call, as OpenAI's look (call_ + 24 random characters)."""
    return "call_" + secrets.token_hex(12)


def tool_call_dicts(calls: list[tuple[str, str]], first_index: int = 0, stream: bool = False) -> list[dict]:
    """OpenAI's tool_calls entries (streamed deltas carry their index)."""
    out = []
    for k, (name, args) in enumerate(calls):
        entry = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}
        out.append({"index": first_index + k} | entry if stream else entry)
    return out


class ToolStream:
    """One streamed choice's text split into content deltas and tool-call deltas as it grows. Content is released
    up to the first tool-call start marker (holding back a tail that could be the start of one); from the marker on
    the text is held and parsed, and each call is sent whole once complete (one delta carrying id, name and the
    arguments, which the openai client accumulates like OpenAI's fragments)."""

    def __init__(self, family: str, tools: tuple[dict, ...] = ()):
        self.family, self.tools = family, tools
        self.marker = START_MARKERS[family]
        self.text = ""
        self.sent = 0  # characters of text released as content
        self.calls_sent = 0
        self.in_calls = False

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        """The content to send now and the tool-call deltas completed by `piece`."""
        self.text += piece
        if self.family == "harmony":
            return self._harmony_content(), self._new_calls(final=False)
        if not self.in_calls:
            at = self.text.find(self.marker, self.sent)
            if at == -1:
                safe = len(self.text) - _prefix_tail(self.text, self.marker)
                out = self.text[self.sent:safe] if safe > self.sent else ""
                self.sent = max(self.sent, safe)
                return out, []
            out = self.text[self.sent:at]
            self.sent = at
            self.in_calls = True
            return out, self._new_calls(final=False)
        return "", self._new_calls(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        """At the end: the calls not sent yet, and the content not sent yet (the held text when it held no call;
        after calls, what the whole text's parse has beyond the content already sent)."""
        calls = self._new_calls(final=True)
        if self.family == "harmony":
            self.text += "<|end|>"  # closes a final message cut short
            return self._harmony_content(), calls
        if self.calls_sent == 0:  # no call after all: the held text is content
            rest = self.text[self.sent:]
            self.sent = len(self.text)
            return rest, calls
        sent = self.text[:self.sent].strip()
        content = parse(self.text, self.family, self.tools).content
        return (content[len(sent):] if content.startswith(sent) else ""), calls

    def _harmony_content(self) -> str:
        """harmony: the final channel's text so far, less a tail that may be the start of a header token."""
        text = self.text
        cut = text.rfind("<|")
        if cut != -1 and "|>" not in text[cut:]:
            text = text[:cut]
        content = parse_harmony(text).content if "<|message|>" in text else ""
        out = content[self.sent:] if len(content) > self.sent else ""
        self.sent = max(self.sent, len(content))
        return out

    @property
    def called(self) -> bool:
        return self.calls_sent > 0

    def _new_calls(self, final: bool) -> list[dict]:
        parsed = parse(self.text, self.family, self.tools).calls
        # A call the parser reads from an unclosed block (hermes at end of text) may still grow: wait unless final.
        if not final and self.family == "hermes" and not self.text.rstrip().endswith("</tool_call>"):
            parsed = parsed[:self.text.count("</tool_call>")]
        new = parsed[self.calls_sent:]
        self.calls_sent += len(new)
        return tool_call_dicts(new, self.calls_sent - len(new), stream=True)


# Families whose call markers are special tokens in their tokenizers (gpt-oss's harmony headers certainly): their
# text is decoded with special tokens kept, or the parser would never see the markers.
SPECIAL_FAMILIES = ("harmony", "deepseek", "glm45")


class SpecialText:
    """Rewrites the text of a tools job's token events as decoded with special tokens kept (the batcher's text
    skips them). Per choice, the text is the decode of all its ids so far, less end-of-sequence, emitted as it grows
    (held back while it ends in half a character). Stop strings still end the generation but are not cut from this
    text. resumed: per choice index, the ids its client already has (a job re-sent after failover)."""

    def __init__(self, decode: Callable[[list[int]], str], eos_token_id: int | None,
                 resumed: tuple[tuple[int, ...], ...] = ()):
        self.decode, self.eos = decode, eos_token_id
        self.ids = {i: list(ids) for i, ids in enumerate(resumed)}
        self.emitted = {i: self._text(ids) for i, ids in self.ids.items()}

    def _text(self, ids: list[int]) -> str:
        return self.decode([t for t in ids if t != self.eos]) if ids else ""

    def rewrite(self, event: dict) -> dict:
        kind, body = next(iter(event.items()))
        if kind not in ("token", "done"):
            return event
        index = body.get("index", 0)
        ids = self.ids.setdefault(index, [])
        emitted = self.emitted.setdefault(index, "")
        if kind == "token":
            ids.extend(body["ids"])
            full = self._text(ids)
            if full.endswith("\ufffd") or not full.startswith(emitted):
                return {"token": body | {"text": ""}}
            self.emitted[index] = full
            return {"token": body | {"text": full[len(emitted):]}}
        return event


def _prefix_tail(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
