"""`expertmesh bench dispatch`: tokens/s of the distributed forward against `transformers` in one process.

Both run in one process run on the same weights and the same batch, measured alternately (one transformers
forward, one expertmesh forward, repeat) so machine noise hits both alike; the result is their ratio η.

Workloads (random Mixtral weights written to a temporary folder in fp32; `--dtype` runs both sides in that dtype,
transformers loaded with the same dtype; "auto" is float32 on this CPU benchmark):
  prefill  hidden 1024, ffn 2816, 8 experts top-2, 4 layers; 4 sequences x 256 tokens per forward
  decode   same model; 32 sequences with 64 tokens of context, one new token each per forward
--shape qwen3-30b-a3b / deepseek-v3 runs the same workloads on a many-expert model (128 or 256 experts, top-8;
ops/bench/checkpoints.py) instead of the Mixtral one. Parameters: DispatchParams.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...router_service.config import MeshConfig
from .checkpoints import MIXTRAL, SHAPES, write_shape_checkpoint
from .common import all_cores, machine_info, median_ms, say_to_stderr
from .dispatch_report import forward_summary, with_noop_floor


@dataclass(frozen=True)
class DispatchParams:
    """workload: prefill, decode or both; shape: a checkpoints.SHAPES name (and the result's label); model: a model
    dict in place of SHAPES[shape] (a test's smaller one); prefill / decode: the batches timed."""

    workload: str = "both"
    repeats: int = 5
    shape: str = "mixtral"
    model: dict | None = None  # overrides SHAPES[shape]
    prefill: dict = field(default_factory=lambda: dict(sequences=4, tokens=256))
    decode: dict = field(default_factory=lambda: dict(sequences=32, context=64))

    @property
    def model_shape(self) -> dict:
        return self.model if self.model is not None else SHAPES[self.shape]

    @classmethod
    def from_args(cls, args) -> DispatchParams:
        if args.decode_sequences < 1:
            raise ValueError(f"--decode-sequences: must be at least 1, got {args.decode_sequences}")
        return cls(workload=args.workload, repeats=args.repeats, shape=args.shape,
                   decode=dict(sequences=args.decode_sequences, context=64))


def run_dispatch_bench(params: DispatchParams = DispatchParams(), verbose: bool = True,
                       config: MeshConfig | None = None) -> dict:
    """config: the mesh's settings (transport, overlap, ...); its model path is replaced by the bench checkpoint."""
    from transformers import AutoModelForCausalLM

    from ...experts.dtypes import resolve_dtype
    from ...router_service.mesh import ExpertMesh
    from ...router_service.transports.base import resolve_transport

    config = config or MeshConfig()
    transport, overlap = resolve_transport(config.router.transport, config.ray.address), config.router.overlap
    dtype = resolve_dtype(config.model.dtype, "float32", on_gpu=False)  # the CPU benchmark's checkpoint is fp32

    say = say_to_stderr(verbose)
    all_cores()
    torch.manual_seed(0)
    model, repeats = params.model_shape, params.repeats
    result: dict = {"benchmark": "dispatch", "shape": params.shape, "model": model, "transport": transport,
                    "overlap": overlap, "dtype": dtype, "repeats": repeats, "machine": machine_info(),
                    "decode_workload": dict(params.decode)}  # sequences and context (the cost model's fit reads it)
    with tempfile.TemporaryDirectory(prefix="expertmesh-bench-") as tmp:
        say("writing benchmark checkpoint ...")
        model_dir = write_shape_checkpoint(Path(tmp) / "model", model)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        say("starting expert actors ...")
        with ExpertMesh(config.replace(**{"model.path": str(model_dir), "model.dtype": dtype})) as mesh:
            result["noop_round_ms"] = _noop_round_ms(mesh)
            result["transport_round_ms"] = _transport_round_ms(mesh, hidden=model["hidden"])
            result["transport_round_vs_noop"] = round(result["transport_round_ms"] / result["noop_round_ms"], 3)
            result["one_call_ms"] = _one_call_ms(mesh, hidden=model["hidden"])
            if params.workload in ("prefill", "both"):
                say("prefill ...")
                result["prefill"] = with_noop_floor(_bench_prefill(hf, mesh, params), result["noop_round_ms"])
            if params.workload in ("decode", "both"):
                say("decode ...")
                result["decode"] = with_noop_floor(_bench_decode(hf, mesh, params), result["noop_round_ms"])
            say("device reads (router step on a fake GPU) ...")
            result["device_reads"] = device_reads(mesh, model_dir, getattr(torch, dtype), model, params.decode)
            stats = {k: getattr(mesh.router.transport, k, None) for k in ("builds", "compiled_rounds",
                                                                            "fallback_rounds", "reconnects")}
            result["transport_stats"] = {k: v for k, v in stats.items() if v is not None}
    return result


def device_reads(mesh, model_dir: Path, dtype: torch.dtype, model: dict = MIXTRAL,
                 decode: dict = DispatchParams().decode) -> dict:
    """How often the router's step reads the device (README: The router on a GPU), counted by running it with its
    dense weights, KV pool and gates on a fake GPU (ops/fake_cuda: CUDA's device rules on the CPU, every
    device->host read and wait counted) against the mesh's live expert actors: one prefill forward and one decode
    step of the decode workload. -> per phase: waits and reads per MoE layer, and where they happen."""
    n, ctx = decode["sequences"], decode["context"]
    ids = torch.randint(0, model["vocab"], (n, ctx), generator=torch.Generator().manual_seed(1))
    out: dict = {"method": "router step on a fake GPU (ops/fake_cuda) against the live expert actors",
                 "sequences": n, "context": ctx}
    transport = mesh.backend.transport
    if getattr(transport, "takes_device_rows", False):
        # NIXL cannot register a fake GPU's memory: the step stages its rows to the host here. The device-rows
        # path's own count is tests/unit/test_router_step_fake_cuda.py's (the routing's one wait per layer).
        transport.takes_device_rows = False
        out["device_rows"] = "staged to the host on the fake GPU (NIXL needs real device memory)"
    try:
        out |= _counted_step(mesh, model_dir, dtype, ids)
    finally:
        if "device_rows" in out:
            del transport.takes_device_rows  # the class's answer again
    return out


def _counted_step(mesh, model_dir: Path, dtype: torch.dtype, ids: torch.Tensor) -> dict:
    """One prefill forward of ids [n, ctx] and one decode step on a fake GPU, every read counted -> per phase."""
    from ...experts.checkpoint import CheckpointReader
    from ...experts.kv_cache import KVCacheSettings
    from ...experts.modeling import MoEDecoder
    from ...experts.weights import load_dense_weights
    from ..fake_cuda import fake_cuda

    n, ctx = ids.shape
    out: dict = {}
    with fake_cuda() as fc:
        reader = CheckpointReader(model_dir)
        decoder = MoEDecoder(reader.config, load_dense_weights(reader, dtype, device="cuda"), mesh.backend,
                             kv_cache=KVCacheSettings(max_tokens=n * (ctx + 16)))
        moe_layers = len(reader.config.moe_layers)
        caches = [decoder.new_cache() for _ in range(n)]
        with fc.counting() as prefill:
            logits = decoder.forward(list(ids), caches, logits="last")
        step = [x[-1].argmax().view(1) for x in logits]  # [1] each, on the device
        with fc.counting() as decode:
            decoder.forward(step, caches, logits="last")
        for cache in caches:
            cache.free()
    for name, c in (("prefill", prefill), ("decode", decode)):
        out[name] = {
            "moe_layers": moe_layers,
            "waits_per_moe_layer": round(c.syncs / moe_layers, 3),
            "reads_per_moe_layer": round((c.syncs + c.host_reads + c.shape_syncs) / moe_layers, 3),
            "host_reads": c.host_reads, "syncs": c.syncs, "shape_syncs": c.shape_syncs,
            "sites": {k: dict(v) for k, v in (("reads", c.read_sites), ("syncs", c.sync_sites),
                                              ("shape_syncs", c.shape_sync_sites)) if v},
        }
    return out


def _noop_round_ms(mesh, rounds: int = 20) -> float:
    """Ray's floor for one layer round: one no-op call to every expert actor, all in flight, then wait."""
    import ray

    handles = list(mesh.actors.values())
    ray.get([h.ready.remote() for h in handles])
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        ray.get([h.ready.remote() for h in handles])
        times.append(time.perf_counter() - started)
    return median_ms(times)


def _transport_round_ms(mesh, rounds: int = 20, hidden: int = MIXTRAL["hidden"]) -> float:
    """The transport's own cost of one layer round: an empty batch (0 rows) to every expert actor through the
    mesh's transport, all in flight, then gather. Same shape as a real round, with no expert compute in it."""
    from ...experts.arrays import pack

    transport = mesh.router.transport
    shards = mesh.router.spec.actor_shards
    empty = pack(torch.zeros(0, hidden, dtype=mesh.model.dtype))
    times = []
    for i in range(rounds + 3):  # 3 warm-up rounds
        started = time.perf_counter()
        handles = [transport.submit(name, shards[name][0][0], [shards[name][0][1]], [0], empty) for name in shards]
        results = transport.gather_settled(handles, 30.0)
        if i >= 3:
            times.append(time.perf_counter() - started)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise RuntimeError(f"empty expert round failed: {failed[0]!r}")
    return median_ms(times)


def _one_call_ms(mesh, rows: int = 8, calls: int = 60, hidden: int = MIXTRAL["hidden"]) -> dict:
    """One call of `rows` rows to one expert actor, alone in flight: through the mesh's transport, and as a plain
    Ray call carrying the same rows inline (ExpertActor.forward, the refs transport's call) -> median ms each and
    the difference. The cost model's GPU profile of a transport Ray calls carry (rdt) adds this difference, which
    is the transport's own per-call work, to a published classic Ray call (cluster/cost_profiles.py)."""
    import ray

    from ...experts.arrays import pack

    transport = mesh.router.transport
    name, shards = next(iter(mesh.router.spec.actor_shards.items()))
    layer, expert = shards[0]
    x = torch.randn(rows, hidden, dtype=mesh.model.dtype, generator=torch.Generator().manual_seed(2))
    packed = pack(x)
    handle = mesh.actors[name]

    def through_transport():
        (out,) = transport.gather_settled([transport.submit(name, layer, [expert], [rows], packed)], 30.0)
        if isinstance(out, BaseException):
            raise RuntimeError(f"one-call probe failed: {out!r}")

    def plain_ray_call():
        ray.get(handle.forward.remote(layer, [expert], [rows], packed), timeout=30)

    times: dict[str, list[float]] = {"transport": [], "ray_call_inline": []}
    for i in range(calls + 5):  # 5 warm-up calls each, then alternating so drift hits both alike
        for key, fn in (("transport", through_transport), ("ray_call_inline", plain_ray_call)):
            started = time.perf_counter()
            fn()
            if i >= 5:
                times[key].append(time.perf_counter() - started)
    out = {key: median_ms(v) for key, v in times.items()}
    out["rows"] = rows
    out["extra_ms"] = round(out["transport"] - out["ray_call_inline"], 3)
    return out


def _compute_cpu_s(mesh) -> float:
    return sum(info.get("compute_cpu_s", 0.0) for info in mesh.actor_info())


def _timed_mesh(mesh, fn, compute: list[float] | None = None):
    """-> (output, wall s, s in expert rounds); appends the actors' compute CPU s of this forward to `compute`."""
    cpu_before = _compute_cpu_s(mesh) if compute is not None else 0.0
    before = mesh.backend.round_seconds
    started = time.perf_counter()
    out = fn()
    elapsed, round_s = time.perf_counter() - started, mesh.backend.round_seconds - before
    if compute is not None:
        compute.append(_compute_cpu_s(mesh) - cpu_before)
    return out, elapsed, round_s


def _bench_prefill(hf, mesh, params: DispatchParams) -> dict:
    model, repeats = params.model_shape, params.repeats
    ids = torch.randint(0, model["vocab"], (params.prefill["sequences"], params.prefill["tokens"]))
    rows = [r for r in ids]
    with torch.inference_mode():
        hf(ids)  # warm-up both
    mesh.model.forward(rows)
    hf_times, mesh_times, rounds, compute, delta = [], [], [], [], 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        with torch.inference_mode():
            hf_logits = hf(ids).logits
        hf_times.append(time.perf_counter() - started)
        out, elapsed, round_s = _timed_mesh(mesh, lambda: mesh.model.forward(rows), compute)
        mesh_times.append(elapsed)
        rounds.append(round_s)
        delta = max(delta, float((torch.stack(out).float() - hf_logits.float()).abs().max()))
    return forward_summary(ids.numel(), hf_times, mesh_times, rounds, delta, compute, model["layers"],
                           os.cpu_count() or 1)


def _bench_decode(hf, mesh, params: DispatchParams) -> dict:
    from transformers import DynamicCache

    model, repeats = params.model_shape, params.repeats
    n, ctx = params.decode["sequences"], params.decode["context"]
    ids = torch.randint(0, model["vocab"], (n, ctx))
    hf_cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        hf_logits = hf(ids, past_key_values=hf_cache, use_cache=True).logits[:, -1]
    caches = [mesh.model.new_cache() for _ in range(n)]
    mesh_logits = torch.stack([x[-1] for x in mesh.model.forward(list(ids), caches)])
    delta = float((mesh_logits.float() - hf_logits.float()).abs().max())
    next_ids = hf_logits.argmax(-1)  # [n]; both continue with the same tokens
    hf_times, mesh_times, rounds, compute = [], [], [], []
    for step in range(repeats + 1):  # step 0 warms up
        started = time.perf_counter()
        with torch.inference_mode():
            hf_step = hf(next_ids[:, None], past_key_values=hf_cache, use_cache=True).logits[:, -1]
        hf_elapsed = time.perf_counter() - started
        step_tokens = [t.view(1) for t in next_ids]
        cpu: list[float] = []
        out, elapsed, round_s = _timed_mesh(mesh, lambda: mesh.model.forward(step_tokens, caches), cpu)  # noqa: B023
        if step:
            compute.extend(cpu)
            hf_times.append(hf_elapsed)
            mesh_times.append(elapsed)
            rounds.append(round_s)
        delta = max(delta, float((torch.stack([x[-1] for x in out]).float() - hf_step.float()).abs().max()))
        next_ids = hf_step.argmax(-1)
    return forward_summary(n, hf_times, mesh_times, rounds, delta, compute, model["layers"], os.cpu_count() or 1)
