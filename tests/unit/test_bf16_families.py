"""bf16 on every supported family: the in-process reference in bf16 against `transformers` in bf16 on the same tiny
checkpoint — greedy tokens equal, logits within bf16 tolerance (a few bf16 ulps of the logits' scale; the two
round at different points, e.g. gate weights, so bit equality is not the claim)."""

from __future__ import annotations

import pytest
import torch

from expertmesh.experts.reference import load_reference_model
from tests.tiny_checkpoints import greedy_tokens, write_hf_checkpoint
from tests.tiny_deepseek import write_deepseek_checkpoint

FAMILIES = ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe")
PROMPT = [3, 17, 5, 42, 9, 11, 60, 2]


def _write(family: str, out):
    if family in ("deepseek_v2", "deepseek_v3", "glm4_moe"):
        return write_deepseek_checkpoint(family, out, seed=5)
    return write_hf_checkpoint(family, out, seed=5)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_reference_is_close_to_transformers_bf16(tmp_path, family):
    from transformers import AutoModelForCausalLM

    folder = _write(family, tmp_path / family)
    ours = load_reference_model(folder, dtype=torch.bfloat16)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        want = theirs(ids[None]).logits[0].float()  # [S, V]
        got = ours.forward([ids])[0].float()
        expected = theirs.generate(ids[None], attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                                   max_new_tokens=8, do_sample=False)[0, len(PROMPT):].tolist()
    scale = want.abs().max().item()
    gap = (got - want).abs().max().item()
    assert gap <= 0.05 * max(scale, 1.0), f"{family}: max |Δlogit| {gap:.4f} at logit scale {scale:.2f}"
    assert greedy_tokens(ours, PROMPT, 8) == expected
