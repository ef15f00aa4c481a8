"""The `expertmesh` command: `--local` runs as a user runs it (a subprocess that starts its own embedded Ray); the
client commands of a running `expertmesh serve` run in process (`ops.cli.main`, which a subprocess would only wrap).
Every output is compared with a real result: the in-process reference model, or `transformers` on the same
checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from expertmesh.cluster.naming import expert_actor_name
from expertmesh.experts.config import load_model_config
from expertmesh.experts.embedded_model import EMBEDDED_MODEL_DIR
from expertmesh.experts.reference import load_reference_model
from expertmesh.experts.tokenizer import load_tokenizer
from expertmesh.ops.cli import main
from tests.tiny_checkpoints import greedy_tokens

TOL = 1e-4


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expertmesh.ops.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def cli_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """`expertmesh ARGS` in this process: its exit code and what it printed."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["expertmesh", *args], code, out, err)


def test_score_json_equals_transformers(checkpoints):
    from transformers import AutoModelForCausalLM

    ids = [5, 17, 42, 8, 90, 1]
    proc = run_cli("score", "--local", "--model", str(checkpoints["qwen2_moe"]), "--token-ids",
                   ",".join(map(str, ids)), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["qwen2_moe"], dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert (torch.tensor(out["logits"]) - want).abs().max().item() <= 1e-4


def test_generate_on_the_embedded_default_model():
    proc = run_cli("generate", "--local", "--prompt", "def ", "--max-tokens", "12", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert len(out["token_ids"]) >= 1 and isinstance(out["text"], str) and out["text"]
    assert (EMBEDDED_MODEL_DIR / "model.safetensors").is_file()
    # The tokens are the in-process reference's greedy tokens for the same prompt (up to and with EOS, where the
    # CLI stops), and the text is exactly their decoding.
    tokenizer = load_tokenizer(EMBEDDED_MODEL_DIR)
    reference = load_reference_model(EMBEDDED_MODEL_DIR)
    want = greedy_tokens(reference, tokenizer.encode("def ").ids, 12)
    eos = reference.cfg.eos_token_id
    if eos in want:
        want = want[:want.index(eos) + 1]
    assert out["token_ids"] == want
    assert out["finish_reason"] == ("eos" if eos in want else "length")
    assert out["text"] == tokenizer.decode(want)


def test_user_errors_exit_2_with_one_line_naming_the_field(checkpoints):
    proc = run_cli("generate", "--local", "--model", str(checkpoints["mixtral"]), "--prompt", "hi")
    assert proc.returncode == 2 and "prompt" in proc.stderr and "tokenizer.json" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli("score", "--local", "--token-ids", "1,x")
    assert proc.returncode == 2 and "--token-ids" in proc.stderr
    proc = run_cli("generate", "--token-ids", "1,2", "--target", "127.0.0.1:1", "--timeout", "5")  # no server
    assert proc.returncode == 2 and "UNAVAILABLE" in proc.stderr and "Traceback" not in proc.stderr


# ---- a client of a running server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server  # the session's tiny Mixtral (tests/shared_server.py); these tests only read from it


def test_remote_generate_json_equals_transformers_greedy(server, checkpoints, capsys):
    from transformers import AutoModelForCausalLM

    prompt = [3, 14, 15, 92, 65, 35]
    proc = cli_main(capsys, "generate", "--target", server.target, "--token-ids", ",".join(map(str, prompt)),
                    "--max-tokens", "10", "--json", "--timeout", "120")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["mixtral"], dtype=torch.float32).eval()
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(prompt):].tolist()
    assert out["token_ids"] == want
    assert out["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 10}


@pytest.mark.parametrize("log_probs", [False, True])
def test_remote_score_json_equals_the_reference(server, reference, log_probs, capsys):
    ids = [5, 17, 42, 8, 90, 1]
    args = ["score", "--target", server.target, "--token-ids", ",".join(map(str, ids)), "--json", "--timeout", "120"]
    proc = cli_main(capsys, *args, *(["--log-probs"] if log_probs else []))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    want = reference.forward([torch.tensor(ids)])[0]  # [S, V]
    if log_probs:
        want = want.log_softmax(-1)
    got = torch.tensor(out["log_probs" if log_probs else "logits"])
    assert out["token_ids"] == ids and got.shape == want.shape
    assert (got - want).abs().max().item() <= TOL


def test_status_lists_every_actor(server, checkpoints, capsys):
    experts = load_model_config(checkpoints["mixtral"]).num_experts
    actors = {expert_actor_name(e, 0) for e in range(experts)}  # one replica per expert by default
    assert cli_main(capsys, "generate", "--target", server.target, "--token-ids", "1,2,3", "--max-tokens", "2",
                    "--timeout", "120").returncode == 0  # some traffic, so every replica has a state to show
    proc = cli_main(capsys, "status", "--target", server.target, "--json", "--timeout", "120")
    assert proc.returncode == 0, proc.stderr[-2000:]
    state = json.loads(proc.stdout)
    assert {r["actor"] for r in state["replicas"]} == actors
    assert all(r.get("alive") for r in state["replicas"]), state["replicas"]
    assert {r.get("dtype") for r in state["replicas"]} == {"float32"}  # model.dtype auto, resolved on a CPU actor
    assert state["controller_alive"] is True
    # Every shard (layer, expert) has its one replica, on the actor named for its expert.
    shards = {(s.get("layer", 0), s.get("expert", 0)): s["replicas"] for s in state["shards"]}
    layers = load_model_config(checkpoints["mixtral"]).moe_layers
    assert set(shards) == {(layer, e) for layer in layers for e in range(experts)}
    assert all(replicas == [expert_actor_name(e, 0)] for (_, e), replicas in shards.items())
    # The table the human-readable form prints has a row per actor.
    text = cli_main(capsys, "status", "--target", server.target, "--timeout", "120")
    assert text.returncode == 0, text.stderr[-2000:]
    assert "router compute: float32 on cpu" in text.stdout
    rows = [line.split()[0] for line in text.stdout.splitlines() if line.startswith("expert-")]
    assert sorted(rows) == sorted(actors)
