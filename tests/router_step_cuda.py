"""The router's step on a real GPU, Ray-free (the GPU machine has torch, transformers and safetensors, not Ray).

    bash ops/gpu_check.sh            # runs this among the GPU tests
    python tests/router_step_cuda.py [--families mixtral,gpt_oss] [--gpu-memory-utilization 0.5]

One line per check. For every family (tiny checkpoints written by transformers, as the CPU tests use): the router's
decoder with its dense weights, paged KV pool, gates and sampling on cuda:0 in bf16 (and fp32), dispatching through
`RemoteExperts` to in-process expert actors computing on the GPU, against the in-process reference on the CPU in
the same dtype: logits within bf16 tolerance (fp32: 1e-4) and greedy tokens equal; served through the continuous batcher
(chunked prefill, seeded sampling at temperature > 0) twice with the same tokens, and a resumed stream equal to the
uninterrupted one; the device-rows dispatch path (`rdt`'s) equal to the host-staged one bit for bit; the paged pool
sized by --gpu-memory-utilization. The same scenarios run under the fake-CUDA
double in CPU CI (tests/unit/test_router_step_fake_cuda.py).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repository root on the path, for `tests.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.router_step import (  # noqa: E402
    StepSetup,
    build_router,
    prefill_then_decode,
    prompts,
    resumed,
    serve,
    serving_requests,
)

FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v2_grouped", "glm4_moe", "many_experts",
            "minimax_m2", "ernie4_5_moe", "hunyuan_v1_moe", "llama4", "mimo_v2_flash", "qwen3_next",
            "deepseek_v32", "glm_moe_dsa", "longcat_flash", "kimi_linear")


def write_checkpoint(family: str, out: Path) -> Path:
    from tests.tiny_checkpoints import write_hf_checkpoint
    from tests.tiny_deepseek import write_deepseek_checkpoint
    from tests.tiny_fam1 import KINDS as FAM1_KINDS
    from tests.tiny_fam1 import write_fam1_checkpoint
    from tests.tiny_kimi_linear import write_kimi_linear_checkpoint
    from tests.tiny_llama4 import write_llama4_checkpoint
    from tests.tiny_longcat_flash import write_longcat_checkpoint
    from tests.tiny_mimo_v2_flash import write_mimo_checkpoint
    from tests.tiny_qwen3_next import write_qwen3_next_checkpoint

    if family.startswith("deepseek") or family in ("glm4_moe", "glm_moe_dsa"):
        return write_deepseek_checkpoint(family, out)
    if family in FAM1_KINDS:  # MiniMax-M2, ERNIE 4.5 MoE, Hunyuan-A13B
        return write_fam1_checkpoint(family, out)
    if family == "llama4":  # chunked attention (chunk 8), NoPE layers with temperature, input-scaled top-1
        return write_llama4_checkpoint(out)
    if family == "mimo_v2_flash":  # per-layer KV shapes, sinks on sliding layers, per-kind RoPE, grouped router
        return write_mimo_checkpoint(out)
    if family == "longcat_flash":  # shortcut MoE across two sublayers, identity experts on the router, scaled MLA
        return write_longcat_checkpoint(out)
    if family == "qwen3_next":  # Gated DeltaNet layers with their state cache, gated attention, a dense layer
        return write_qwen3_next_checkpoint(out)
    if family == "kimi_linear":  # KDA layers (per-channel decay) with their state cache, MLA without RoPE
        return write_kimi_linear_checkpoint(out)
    if family == "many_experts":  # 128 experts, top-8: > 16 pieces per layer, the rank-pass combine
        return write_hf_checkpoint("qwen3_moe", out, num_experts=128, num_experts_per_tok=8)
    return write_hf_checkpoint(family, out)


def check_family(family: str, model_dir: Path, utilization: float, say) -> bool:
    from expertmesh.experts.reference import load_reference_model

    ok = True
    for dtype, tol in ((torch.bfloat16, None), (torch.float32, 1e-4)):
        # The in-process reference on the CPU in the same dtype: a bf16 router against an fp32 reference would
        # measure bf16 itself (a near-tie in a tiny model's gate flips an expert and its logits), not the router.
        reference = load_reference_model(model_dir, dtype=dtype)
        vocab = reference.cfg.vocab_size
        want = [x.float() for x in prefill_then_decode(reference, prompts(vocab))]
        want_tokens = [x.argmax(-1) for x in want]
        started = time.perf_counter()
        model, backend = build_router(model_dir, "cuda", dtype, StepSetup(gpu_memory_utilization=utilization))
        got = prefill_then_decode(model, prompts(vocab))
        gap = max(float((g.float() - w).abs().max()) for g, w in zip(got, want))
        scale = max(float(w.abs().max()) for w in want)
        bound = tol if tol is not None else 0.05 * max(scale, 1.0)
        greedy = all(torch.equal(g.argmax(-1), t) for g, t in zip(got, want_tokens))
        passed = gap <= bound and (greedy or tol is None)
        ok &= passed
        say(f"{'PASS' if passed else 'FAIL'} {family:<20} {str(dtype)[6:]:<9} router step on cuda vs CPU reference: "
            f"max|Δlogit| {gap:.2e} (bound {bound:.1e}), greedy tokens {'equal' if greedy else 'differ'}, "
            f"{backend.transport.calls} expert calls, {time.perf_counter() - started:.1f}s")
        del model, backend
        _release()  # each router's pool takes its share of the GPU: free it before the next is sized
    model, _ = build_router(model_dir, "cuda", torch.bfloat16, StepSetup(gpu_memory_utilization=utilization))
    requests = serving_requests(vocab)
    first, second = serve(model, requests), serve(model, requests)
    again = serve(model, [resumed(requests[1], first[1][:2])])[0]
    passed = first == second and again == first[1][2:]
    del model
    _release()
    ok &= passed
    say(f"{'PASS' if passed else 'FAIL'} {family:<20} bfloat16  batcher on cuda: chunked prefill + seeded sampling "
        f"repeatable ({first == second}), resumed stream equal ({again == first[1][2:]})")
    return ok


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def check_pool(model_dir: Path, utilization: float, say) -> bool:
    _release()
    model, _ = build_router(model_dir, "cuda", torch.bfloat16, StepSetup(gpu_memory_utilization=utilization))
    free, total = torch.cuda.mem_get_info()
    used_share = 1 - free / total
    passed = used_share <= utilization + 0.02 and model.kv_pool.num_blocks > 0
    say(f"{'PASS' if passed else 'FAIL'} paged KV pool at --gpu-memory-utilization {utilization}: "
        f"{model.kv_pool.num_blocks} blocks, process uses {used_share:.1%} of {total / 2**30:.0f} GiB")
    return passed


def check_device_rows(model_dir: Path, utilization: float, say) -> bool:
    """The device-to-device dispatch path (`rdt`'s: rows gathered on the GPU, outputs combined there) against the
    host-staged one, on this GPU: the same logits bit for bit, and every call handed device rows."""
    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        runs = {}
        for device_rows in (False, True):
            _release()
            model, backend = build_router(model_dir, "cuda", dtype,
                                          StepSetup(gpu_memory_utilization=utilization, device_rows=device_rows))
            runs[device_rows] = (prefill_then_decode(model, prompts(model.cfg.vocab_size)),
                                 backend.transport.device_row_calls, backend.transport.calls)
            del model, backend
        (host, _, _), (device, row_calls, calls) = runs[False], runs[True]
        same = all(torch.equal(a, b) for a, b in zip(host, device))
        passed = same and row_calls == calls > 0
        ok &= passed
        say(f"{'PASS' if passed else 'FAIL'} device rows on cuda, {str(dtype)[6:]}: logits "
            f"{'equal' if same else 'DIFFER'} to the host-staged path, {row_calls}/{calls} calls took device rows")
    _release()
    return ok


def cuda_banner() -> bool:
    """Print the GPU scripts' first line: torch, CUDA and the device, or SKIP without one. -> whether CUDA is there."""
    if not torch.cuda.is_available():
        print("SKIP no CUDA device")
        return False
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}", flush=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = parser.parse_args(argv)
    if not cuda_banner():
        return 0
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {f: write_checkpoint(f, Path(tmp) / f) for f in args.families.split(",")}
        for family, model_dir in dirs.items():
            ok &= check_family(family, model_dir, args.gpu_memory_utilization, lambda line: print(line, flush=True))
        first = next(iter(dirs.values()))
        ok &= check_device_rows(first, args.gpu_memory_utilization, lambda line: print(line, flush=True))
        ok &= check_pool(first, args.gpu_memory_utilization, lambda line: print(line, flush=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
