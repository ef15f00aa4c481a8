"""CUDA graphs for the router's decode step on a real GPU, Ray-free (the GPU machine has torch, transformers and
safetensors, not Ray).

    bash ops/gpu_check.sh            # runs this among the GPU tests
    python tests/decode_graphs_cuda.py [--families mixtral,deepseek_v3] [--steps 32]

One line per check. For every graphable family (tiny checkpoints written by transformers): the router's decoder on
cuda:0 in bf16 and fp32 with graphs on, against the same router eager: logits within the dtype's tolerance (fp32
1e-4; padding changes GEMM shapes, so not bit for bit), greedy tokens equal, every bucket captured without a
fallback; the continuous batcher with graphs repeatable and equal to eager; then decode time per step at batch 1 and
8, eager and graphed, for the tiny model (launch-bound: the ratio is what graphs save in kernel launches per step,
with in-process experts; CPU-side dispatch is the same on both). The fake-CUDA double runs the same scenarios in CPU
CI (tests/unit/test_decode_graphs.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repository root on the path, for `tests.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from expertmesh.experts.checkpoint import CheckpointReader  # noqa: E402
from expertmesh.experts.decode_graphs import GraphSettings, model_reason  # noqa: E402
from tests.router_step import StepSetup, build_router, prefill_then_decode, prompts, serve, serving_requests  # noqa: E402
from tests.router_step_cuda import FAMILIES, cuda_banner, write_checkpoint  # noqa: E402


def _setup(graphs: bool) -> StepSetup:
    return StepSetup(gpu_memory_utilization=0.3, cuda_graphs=GraphSettings() if graphs else None)


def decode_ms(model, batch: int, steps: int) -> float:
    """Mean milliseconds per decode step of `batch` sequences after a 16-token prompt each (warm: first steps
    capture)."""
    vocab = model.cfg.vocab_size
    caches = [model.new_cache() for _ in range(batch)]
    model.forward([torch.randint(0, vocab, (16,)) for _ in range(batch)], caches, logits="last")
    tokens = [torch.tensor([1]) for _ in range(batch)]
    for _ in range(3):
        model.forward(tokens, caches, logits="last")
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        model.forward(tokens, caches, logits="last")
    torch.cuda.synchronize()
    for cache in caches:
        cache.free()
    return (time.perf_counter() - started) / steps * 1000


def check_family(family: str, model_dir: Path, steps: int, say) -> bool:
    ok = True
    for dtype, tol in ((torch.bfloat16, None), (torch.float32, 1e-4)):
        eager, _ = build_router(model_dir, "cuda", dtype, _setup(False))
        ids = prompts(eager.cfg.vocab_size, (7, 12, 3, 5, 9))
        want = prefill_then_decode(eager, ids, steps=6)
        del eager
        graphed, _ = build_router(model_dir, "cuda", dtype, _setup(True))
        got = prefill_then_decode(graphed, ids, steps=6)
        stats = graphed.graphs.stats()
        gap = max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want))
        scale = max(float(w.float().abs().max()) for w in want)
        bound = tol if tol is not None else 0.05 * max(scale, 1.0)
        greedy = all(torch.equal(g.argmax(-1), w.argmax(-1)) for g, w in zip(got, want))
        passed = gap <= bound and (greedy or tol is None) and stats["replays"] > 0 and not stats["failed"]
        ok &= passed
        say(f"{'PASS' if passed else 'FAIL'} {family:<20} {str(dtype)[6:]:<9} graphed decode vs eager: "
            f"max|Δlogit| {gap:.2e} (bound {bound:.1e}), greedy {'equal' if greedy else 'differ'}, {stats}")
        del graphed
        torch.cuda.empty_cache()
    requests = serving_requests(CheckpointReader(model_dir).config.vocab_size)
    eager, _ = build_router(model_dir, "cuda", torch.float32, _setup(False))
    want = serve(eager, requests)
    del eager
    graphed, _ = build_router(model_dir, "cuda", torch.float32, _setup(True))
    first, second = serve(graphed, requests), serve(graphed, requests)
    passed = first == second == want
    ok &= passed
    say(f"{'PASS' if passed else 'FAIL'} {family:<20} float32   batcher with graphs: repeatable ({first == second}), "
        f"equal to eager ({first == want})")
    timings = []
    for batch in (1, 8):
        for graphs in (False, True):
            model, _ = build_router(model_dir, "cuda", torch.bfloat16, _setup(graphs))
            timings.append((batch, graphs, decode_ms(model, batch, steps)))
            del model
            torch.cuda.empty_cache()
    say(f"INFO {family:<20} bfloat16  decode ms/step (in-process experts): " + ", ".join(
        f"batch {b} {'graphs' if g else 'eager'} {ms:.2f}" for b, g, ms in timings))
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args(argv)
    if not cuda_banner():
        return 0
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            model_dir = write_checkpoint(family, Path(tmp) / family)
            reason = model_reason(CheckpointReader(model_dir).config, None)
            if reason is not None:
                print(f"SKIP {family:<20} eager only: {reason}", flush=True)
                continue
            ok &= check_family(family, model_dir, args.steps, lambda line: print(line, flush=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
