"""The `expertmesh` command, run as a user runs it (a subprocess that starts its own embedded Ray)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from expertmesh.experts.tokenizer import DEFAULT_MODEL_DIR


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expertmesh.ops.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


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
    assert (DEFAULT_MODEL_DIR / "model.safetensors").is_file()


def test_user_errors_exit_2_with_one_line_naming_the_field(checkpoints):
    proc = run_cli("generate", "--local", "--model", str(checkpoints["mixtral"]), "--prompt", "hi")
    assert proc.returncode == 2 and "prompt" in proc.stderr and "tokenizer.json" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli("score", "--local", "--token-ids", "1,x")
    assert proc.returncode == 2 and "--token-ids" in proc.stderr
    proc = run_cli("generate", "--token-ids", "1,2", "--target", "127.0.0.1:1", "--timeout", "5")  # no server
    assert proc.returncode == 2 and "UNAVAILABLE" in proc.stderr and "Traceback" not in proc.stderr
