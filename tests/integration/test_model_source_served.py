"""`expertmesh serve --model org/name --revision R` from an offline Hugging Face cache (HF_HUB_OFFLINE=1): the real
Hub code path, no network. Serves, answers like the same checkpoint from a folder, and names the repo as the model."""

from __future__ import annotations

import os

import grpc

from expertmesh.experts.embedded_model import EMBEDDED_MODEL_DIR
from expertmesh.experts.reference import load_reference_model
from expertmesh.ops.server_process import start_server
from tests.hub_cache import populate_hub_cache
from tests.served import generate_ids
from tests.tiny_checkpoints import greedy_tokens


# ~2 min; in CI's default set: the only end-to-end run of a repo id from an offline cache
def test_serve_a_repo_id_from_an_offline_cache(tmp_path):
    cache = tmp_path / "hub"
    populate_hub_cache(cache, "acme/expertmesh-demo", EMBEDDED_MODEL_DIR, revision="v1")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    server = start_server(["--model", "acme/expertmesh-demo", "--revision", "v1", "--cpus-per-actor", "0.25"],
                          log_path=tmp_path / "serve.log", timeout=300, env=env)
    try:
        prompt = [5, 17, 42, 9]
        with grpc.insecure_channel(server.target) as channel:
            got = generate_ids(channel, prompt, 6)
        assert server.model_name == "acme/expertmesh-demo", server.log()
        assert got == greedy_tokens(load_reference_model(EMBEDDED_MODEL_DIR), prompt, 6)
    finally:
        assert server.stop() == 0, server.log()
