"""Qwen3-MoE in transformers' stacked (fused) layout and gpt-oss (interleaved stacked, and MXFP4) served through the
distributed router (`ExpertMesh`, one actor per expert, each reading only its rows of the stacked tensors): logits
and greedy tokens equal the in-process reference bit for bit, and transformers within 1e-4 in fp32."""

from __future__ import annotations

import pytest
import torch

from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service.mesh import ExpertMesh, MeshConfig
from tests.tiny_checkpoints import VOCAB, greedy_tokens, write_hf_checkpoint, write_mxfp4_gpt_oss

TOL = 1e-4
pytestmark = pytest.mark.usefixtures("local_ray")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("served_families")
    gpt_oss = write_hf_checkpoint("gpt_oss", root / "gpt_oss", seed=21)
    return {
        "qwen3_moe_fused": write_hf_checkpoint("qwen3_moe", root / "qwen3_moe_fused", seed=20, fused=True),
        "gpt_oss": gpt_oss,
        "gpt_oss_mxfp4": write_mxfp4_gpt_oss(gpt_oss, root / "gpt_oss_mxfp4"),
    }


def _hf(folder, name: str):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if name.endswith("mxfp4") else {}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra).eval()


@pytest.mark.parametrize("name", ["qwen3_moe_fused", "gpt_oss", "gpt_oss_mxfp4"])
def test_distributed_equals_reference_bit_for_bit(folders, name):
    folder = folders[name]
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (14, 5)]  # 14 > gpt-oss's window (4)
    reference = load_reference_model(folder)
    want = reference.forward([torch.tensor(s) for s in seqs])
    prompt = seqs[0][:6]
    want_tokens = greedy_tokens(reference, prompt, 10)  # decoding runs past the window
    config = MeshConfig.from_dict({"model": {"path": str(folder)}, "controller": {"enabled": False},
                                    "experts": {"layout": "per-expert"}})  # calls counted per expert actor
    with ExpertMesh(config) as mesh:
        got = mesh.score_batch(seqs)
        calls = dict(mesh.backend.calls_per_layer)
        generation = mesh.generate(token_ids=prompt, max_tokens=10)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert calls and all(n > 0 for n in calls.values())  # the experts ran in the actors
    assert generation.token_ids == want_tokens
    hf = _hf(folder, name)
    for ids, logits in zip(seqs, got):
        with torch.no_grad():
            assert (logits - hf(torch.tensor([ids])).logits[0]).abs().max().item() <= TOL
