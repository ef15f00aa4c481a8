"""bf16 on every supported family: the in-process reference in bf16 against `transformers` on the same tiny
checkpoint, by transformers' own yardstick (tests/tiny_checkpoints.py: no further from float32 than transformers'
bf16 is, greedy tokens equal up to the first near-tie). The two round at different points, e.g. gate weights, so bit
equality is not the claim, and how far bf16 lands depends on the CPU's bf16 kernels."""

from __future__ import annotations

import pytest
import torch

from expertmesh.experts.reference import load_reference_model
from tests.tiny_checkpoints import assert_by_transformers_yardstick, load_hf_model, write_hf_checkpoint
from tests.tiny_deepseek import write_deepseek_checkpoint

FAMILIES = ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe")
PROMPT = [3, 17, 5, 42, 9, 11, 60, 2]


def _write(family: str, out):
    if family in ("deepseek_v2", "deepseek_v3", "glm4_moe"):
        return write_deepseek_checkpoint(family, out, seed=5)
    return write_hf_checkpoint(family, out, seed=5)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_reference_is_as_close_to_float32_as_transformers_bf16(tmp_path, family):
    folder = _write(family, tmp_path / family)
    ours = load_reference_model(folder, dtype=torch.bfloat16)
    theirs, truth = load_hf_model(folder, torch.bfloat16), load_hf_model(folder)
    assert_by_transformers_yardstick(ours, theirs, truth, torch.tensor(PROMPT))
