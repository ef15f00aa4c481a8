"""`expertmesh bench dispatch --context N`: decode at long context over the paged KV cache, against `transformers`
with a static (preallocated) cache, same weights, same batch, same context, measured alternately in one run.

Setup: the dispatch benchmark's model (checkpoints.MIXTRAL, fp32, its context raised to fit N); `streams`
sequences of N random tokens are prefilled on both sides in chunks of 512 tokens across the batch (transformers into
its StaticCache, expertmesh into the paged pool), then every forward adds one token to each.
Reported: η = transformers' decode step time / expertmesh's, the KV bytes per token (from the pool's tensors) against
the formula layers × 2 × kv_heads × head_dim × dtype bytes, the pool's bytes held and reserved, the max |Δlogit|,
and the process's peak RSS (router and transformers share this process, so it bounds the router's).
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...router_service.config import MeshConfig
from .checkpoints import MIXTRAL, write_bench_checkpoint
from .common import all_cores, machine_info, say_to_stderr

HF_PREFILL_CHUNK = 512  # transformers' prefill into its static cache, in pieces (its mask is [B, 1, S, max_len])


@dataclass(frozen=True)
class ContextParams:
    context: int = 4096
    streams: int = 8
    repeats: int = 5
    model: dict = field(default_factory=lambda: MIXTRAL)

    @classmethod
    def from_args(cls, args) -> ContextParams:
        return cls(args.context, streams=args.streams, repeats=args.repeats)


def run_context_bench(params: ContextParams = ContextParams(), verbose: bool = True,
                      config: MeshConfig | None = None) -> dict:
    from transformers import AutoModelForCausalLM, StaticCache

    from ...router_service.mesh import ExpertMesh

    say = say_to_stderr(verbose)
    context, streams, repeats = params.context, params.streams, params.repeats
    config = config or MeshConfig()
    all_cores()
    torch.manual_seed(0)
    result: dict = {"benchmark": "dispatch-context", "model": params.model, "context": context, "streams": streams,
                    "repeats": repeats, "transport": config.router.transport, "machine": machine_info()}
    with tempfile.TemporaryDirectory(prefix="expertmesh-bench-") as tmp:
        say("writing benchmark checkpoint ...")
        model_dir = write_bench_checkpoint(Path(tmp) / "model", params.model, max_positions=context + repeats + 8)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        ids = torch.randint(0, params.model["vocab"], (streams, context))
        say(f"transformers: prefill {streams} x {context} into a static cache ...")
        hf_cache = StaticCache(config=hf.config, max_cache_len=context + repeats + 2)
        with torch.inference_mode():
            for a in range(0, context, HF_PREFILL_CHUNK):
                b = min(context, a + HF_PREFILL_CHUNK)
                hf_logits = hf(ids[:, a:b], past_key_values=hf_cache, use_cache=True,
                               cache_position=torch.arange(a, b)).logits[:, -1]
        say("starting expert actors ...")
        with ExpertMesh(config.replace(**{"model.path": str(model_dir)})) as mesh:
            model = mesh.model
            say(f"expertmesh: prefill {streams} x {context} into the paged cache ...")
            caches = [model.new_cache() for _ in range(streams)]
            for a in range(0, context, HF_PREFILL_CHUNK):  # chunked like the batcher's prefill: bounded expert calls
                b = min(context, a + HF_PREFILL_CHUNK)
                out = model.forward([row[a:b] for row in ids], caches, logits="last" if b == context else "none")
            mesh_logits = torch.cat(out)  # [streams, V]
            delta = float((mesh_logits - hf_logits).abs().max())
            next_ids = hf_logits.argmax(-1)  # [streams]; both continue with the same tokens
            hf_times, mesh_times = [], []
            say("decode ...")
            for step in range(repeats + 1):  # step 0 warms up
                pos = context + step
                started = time.perf_counter()
                with torch.inference_mode():
                    hf_step = hf(next_ids[:, None], past_key_values=hf_cache, use_cache=True,
                                 cache_position=torch.tensor([pos])).logits[:, -1]
                hf_elapsed = time.perf_counter() - started
                started = time.perf_counter()
                out = model.forward([t.view(1) for t in next_ids], caches, logits="last")
                mesh_elapsed = time.perf_counter() - started
                if step:
                    hf_times.append(hf_elapsed)
                    mesh_times.append(mesh_elapsed)
                delta = max(delta, float((torch.cat(out) - hf_step).abs().max()))
                next_ids = hf_step.argmax(-1)
            pool = model.kv_pool
            cfg = model.cfg
            formula = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * pool.storage[0]["k"].element_size()
            held = sum(c.nbytes() for c in caches)
            hf_s, mesh_s = statistics.median(hf_times), statistics.median(mesh_times)
            result["decode"] = {
                "tokens_per_forward": streams,
                "transformers_static_cache_step_s": round(hf_s, 5),
                "expertmesh_step_s": round(mesh_s, 5),
                "eta": round(hf_s / mesh_s, 4),
                "max_abs_logit_diff": delta,
            }
            result["kv_cache"] = {
                "bytes_per_token": pool.nbytes() // pool.capacity_tokens,  # from the allocated tensors
                "bytes_per_token_formula": formula,
                "formula": "layers x 2 x kv_heads x head_dim x dtype bytes = "
                           f"{cfg.num_layers} x 2 x {cfg.num_kv_heads} x {cfg.head_dim} x "
                           f"{pool.storage[0]['k'].element_size()}",
                "block_size": pool.block_size,
                "bytes_held": held,
                "tokens_held": sum(c.length for c in caches),
                "pool_reserved_bytes": pool.nbytes(),
                "hf_static_cache_bytes": _static_cache_bytes(hf_cache),
            }
            for c in caches:
                c.free()
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["peak_rss_note"] = "this process: the router (dense weights + KV pool) and transformers' model and cache"
    return result


def _static_cache_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
