"""Chat templates render as transformers' apply_chat_template does (the same text for the same messages), come from
the checkpoint's own files, and refuse what the template refuses as a 400 on `messages`."""

from __future__ import annotations

import json
import shutil

import pytest

from expertmesh.experts.embedded_model import EMBEDDED_MODEL_DIR
from expertmesh.router_service.chat_template import load_chat_template
from expertmesh.router_service.errors import RequestError

# A ChatML template with the constructs real ones use: loops, raise_exception, tojson, trim/lstrip-sensitive blocks.
CHATML = """{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}
{%- set messages = messages[1:] %}
{%- else %}{%- set system = 'You are helpful.' %}{%- endif %}
{{- bos_token }}<|im_start|>system
{{ system }}<|im_end|>
{% for message in messages %}
    {% if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('roles must be user/assistant') }}
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}{{ {'n': messages | length, 'quote': '<&>'} | tojson }}"""

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <there> & you"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count: 1, 2"}]


def checkpoint_with(tmp_path, **config):
    folder = tmp_path / "ckpt"
    shutil.copytree(EMBEDDED_MODEL_DIR, folder)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config.pop("chat_template", None)
    tok_config.update(config)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return folder


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers_does(tmp_path, add_generation_prompt):
    from transformers import AutoTokenizer

    folder = checkpoint_with(tmp_path, chat_template=CHATML)
    expected = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    ours = load_chat_template(folder).render(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert ours == expected
    assert ours.startswith("<|bos|>") and '"<&>"' in ours  # special tokens filled in; tojson does not HTML-escape


def test_embedded_model_has_its_own_template():
    template = load_chat_template(EMBEDDED_MODEL_DIR)
    text = template.render([{"role": "user", "content": "Hello"}])
    assert text == "<|bos|>User: Hello\nAssistant:"


def test_named_templates_and_jinja_file(tmp_path):
    folder = checkpoint_with(tmp_path, chat_template=[{"name": "tool_use", "template": "T"},
                                                      {"name": "default", "template": "D{{ eos_token }}"}])
    assert load_chat_template(folder).render([]) == "D<|eos|>"
    (folder / "chat_template.jinja").write_text("J")  # transformers prefers the separate file
    assert load_chat_template(folder).render([]) == "J"


def test_no_template_is_none(tmp_path):
    assert load_chat_template(checkpoint_with(tmp_path)) is None


def test_template_refusal_names_messages(tmp_path):
    template = load_chat_template(checkpoint_with(tmp_path, chat_template=CHATML))
    with pytest.raises(RequestError, match="roles must be user/assistant") as info:
        template.render([{"role": "tool", "content": "x"}])
    assert info.value.field == "messages"


def test_sandboxed(tmp_path):
    template = load_chat_template(checkpoint_with(tmp_path, chat_template="{{ ''.__class__.__mro__ }}"))
    with pytest.raises(RequestError):
        template.render([])
