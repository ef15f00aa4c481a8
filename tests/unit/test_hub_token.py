"""Which Hugging Face token a download uses (experts/hub_token.py): the process's own, else the one the driver
published in Ray's key-value store (faked here), else huggingface_hub's own lookup; never logged."""

from __future__ import annotations

import logging

import pytest

from expertmesh.experts import hub_token
from expertmesh.experts.hub_token import env_token, token_for_download


def test_env_token_reads_huggingface_hub_s_variables_in_its_order():
    assert env_token({}) is None
    assert env_token({"HF_TOKEN": "  "}) is None
    assert env_token({"HUGGING_FACE_HUB_TOKEN": "old"}) == "old"
    assert env_token({"HF_TOKEN": " hf_a \n", "HUGGING_FACE_HUB_TOKEN": "old"}) == "hf_a"


@pytest.mark.parametrize("environ, published, expected", [
    ({}, None, None),                              # nothing anywhere: huggingface_hub's own lookup (its token file)
    ({}, "hf_driver\n", "hf_driver"),              # node without a token: the driver's
    ({}, "  ", None),
    ({"HF_TOKEN": "hf_node"}, "hf_driver", None),  # the node's own wins; huggingface_hub reads it itself
    ({"HUGGING_FACE_HUB_TOKEN": "hf_node"}, "hf_driver", None),
])
def test_token_for_download(environ, published, expected):
    assert token_for_download(environ, published) == expected


@pytest.fixture
def fake_kv(monkeypatch):
    import ray
    from ray.experimental import internal_kv

    store: dict[bytes, bytes] = {}
    monkeypatch.setattr(internal_kv, "_internal_kv_put", lambda k, v, overwrite=True: store.__setitem__(k, v))
    monkeypatch.setattr(internal_kv, "_internal_kv_get", lambda k: store.get(k))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    return store


def test_published_token_reaches_a_process_without_one_and_is_never_logged(fake_kv, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    assert hub_token.publish_hub_token({"HF_TOKEN": "hf_secret_1"}) is True
    for name in hub_token.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    assert hub_token.download_token() == "hf_secret_1"
    monkeypatch.setenv("HF_TOKEN", "hf_own")
    assert hub_token.download_token() is None  # huggingface_hub uses hf_own from the environment
    # A later driver without a token leaves the published one in place.
    assert hub_token.publish_hub_token({}) is False
    assert hub_token.published_hub_token() == "hf_secret_1"
    assert "hf_secret_1" not in caplog.text


def test_no_ray_no_published_token(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert hub_token.published_hub_token() is None
