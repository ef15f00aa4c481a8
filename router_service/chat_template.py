"""Chat messages -> one prompt string, through the checkpoint's own chat template, rendered the way transformers'
`apply_chat_template` does (a sandboxed jinja2 environment with trim_blocks/lstrip_blocks, `raise_exception`,
`tojson`, `strftime_now`, the tokenizer's special tokens as variables, `add_generation_prompt`).

Pure (jinja2 only): the router deployment renders with it and unit tests cover it directly.
Where the template comes from, in transformers' order: `chat_template.jinja` beside the checkpoint, else
`tokenizer_config.json`'s `chat_template` (a string, or a list of named templates: the one named "default").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import RequestError

# Special tokens a template may name; their values come from tokenizer_config.json (a string, or an AddedToken
# dict with "content").
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special_tokens: dict[str, str]

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
               ) -> str:
        """The prompt text for `messages` (dicts with role and content, content a string; an assistant's earlier
        tool_calls and a tool message's tool_call_id pass through). tools: OpenAI tool objects, given to the template
        as transformers' apply_chat_template(tools=...) does (None: the variable is undefined). A template that
        raises (e.g. roles out of the order it accepts) is the caller's error: RequestError on `messages`."""
        extra = {} if tools is None else {"tools": tools}
        try:
            # DeepSeek's templates concatenate arguments as the string the client sent; the others take a dict.
            as_dict = "tool▁sep" not in self.source
            return _compile(self.source).render(messages=[_for_template(m, as_dict) for m in messages],
                                                add_generation_prompt=add_generation_prompt, **extra,
                                                **self.special_tokens)
        except jinja2.TemplateError as exc:
            raise RequestError("messages", f"the model's chat template refused them: {exc}") from None


def _for_template(message: dict, as_dict: bool) -> dict:
    """Tool-call arguments as the templates expect them (transformers' convention: a dict; templates that take a
    string check `is string` first), when the JSON string the client sent holds an object."""
    calls = message.get("tool_calls")
    if not calls or not as_dict:
        return message
    out = []
    for call in calls:
        args = call["function"].get("arguments")
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = call | {"function": call["function"] | {"arguments": parsed}}
        out.append(call)
    return message | {"tool_calls": out}


def load_chat_template(model_dir: str | Path) -> ChatTemplate | None:
    """The checkpoint's chat template, or None when it has none (chat requests then get a 400)."""
    folder = Path(model_dir)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    jinja_file = folder / "chat_template.jinja"
    source = jinja_file.read_text() if jinja_file.is_file() else config.get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        return None
    specials = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            specials[name] = value
    return ChatTemplate(source=source, special_tokens=specials)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # transformers' tojson: no HTML escaping (jinja2's own tojson escapes <, >, & for HTML, not for prompts).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
