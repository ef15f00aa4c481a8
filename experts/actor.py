"""The expert actor: a thin Ray shell around `gated_mlp` for the shards it hosts.

It reads only its shards' tensors from the checkpoint, computes on the GPU Ray gave it (or the CPU), and sets its
torch thread count from the CPUs Ray gave it, so many actors on one machine do not fight over cores. Its dtype is
`model.dtype` resolved for its own device (experts/dtypes.py: "auto" is the checkpoint's dtype on a GPU, float32 on
a CPU); rows arrive and leave as HostTensor (raw bytes + dtype tag, experts/arrays.py), so bf16 crosses bit-exactly.
On a GPU a call is: host -> device copy, compute, device -> host copy into a pinned buffer, one synchronisation.
On the `rdt` transport (`forward_rdt`) rows and outputs are tensors read one-sided through NIXL instead
(experts/rdt_box.py), and the output stays on this actor's device until the router reads it.

With a device budget (`memory_gb`, README: Offload) only part of its shards are resident: experts/tier_store.py keeps
the rest in host memory (GPU) or in the memory-mapped checkpoint (CPU) and brings them in per call, or ahead of it
when the router's `prefetch` hints name them. Those calls compute expert by expert (gated_mlp, the grouped path's
bit-identical fallback), since the resident set changes from call to call and a layer has no fixed stack.
"""

from __future__ import annotations

import os
import time

import ray
import torch

from ..cluster.naming import DEFAULT_MESH_ID
from .arrays import HostStager, HostTensor, pack, to_tensor
from .devices import gpus_given, local_device
from .dtypes import read_checkpoint_dtype, resolve_dtype, torch_dtype
from .ffn import activation, gated_mlp
from .gil_handoff import shorten_gil_switch_interval
from .grouped_ffn import GroupedExperts
from .load_progress import ProgressReporter
from .model_source import open_checkpoint, shard_tensors
from .rdt_box import RdtBox, rdt_box, rdt_reading
from .telemetry import ExpertMetrics, build_tracer, context_of
from .tier_store import GIB, DiskTier, HostTier, TierStore, pinned_copy
from .tracing_config import TracingConfig
from .weights import Shard, expert_shard_bytes, load_expert_shards


def _kv_put(key: bytes, value: bytes) -> None:
    from ..cluster.mesh_store import cluster_store

    cluster_store().put_key(key, value)  # key: progress_key's, which carries the mesh's prefix


class ExpertActor:
    def __init__(self, name: str, model_dir: str, shards: list[Shard], dtype: str = "auto", generation: int = 0,
                 tracing: dict | None = None, metrics: bool = True, revision: str | None = None,
                 memory_gb: float | None = None, quant: str = "none", gpu_without_cuda: str = "refuse",
                 mesh_id: str = DEFAULT_MESH_ID, eviction: str = "layer-cycle"):
        """dtype: model.dtype ("auto" or a name), resolved here for this actor's device; revision: with a Hub repo id
        as model_dir; tracing: TracingConfig fields (experts/telemetry.py), None = off; metrics: export
        expertmesh_expert_seconds (and the tier counters) through Ray's metrics API; memory_gb: device budget for
        this actor's expert weights (None: every shard resident); eviction: experts.eviction, the order its device
        tier gives shards back in (experts/eviction.py); quant: experts.quant ("none", "int8", "int4");
        gpu_without_cuda: devices.gpu_without_cuda, what to do when Ray gave a GPU that torch cannot see."""
        shorten_gil_switch_interval()  # its socket server thread answers short calls (experts/gil_handoff.py)
        self.name = name
        self.generation = generation  # 0 for the first actor of this name; +1 each time it is restored
        self.started = time.time()
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        self.threads = max(1, int(cpus))
        torch.set_num_threads(self.threads)
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        # cuda:0 is the GPU Ray assigned; given one that torch cannot see, refuse (one line) before reading a byte,
        # rather than compute on the CPU unnoticed - unless devices.gpu_without_cuda says cpu.
        self.device = local_device(f"expert actor {name}", gpus_given(self.gpu_ids), gpu_without_cuda)
        # A folder, or a Hub repo id of which this node fetches only the files holding these shards.
        reader = open_checkpoint(model_dir, revision, shard_tensors(shards))
        self.act = activation(reader.config.hidden_act)
        self.dtype_name = resolve_dtype(dtype, read_checkpoint_dtype(reader.model_dir), self.device.type == "cuda")
        self.dtype = torch_dtype(self.dtype_name)
        # Progress (bytes read of bytes to read) goes to Ray's KV store while __init__ runs, for `expertmesh status`.
        total = expert_shard_bytes(reader, shards)
        if memory_gb is not None:
            total = min(total, int(memory_gb * GIB))
        self.mesh_id = mesh_id
        reporter = ProgressReporter(name, total, _kv_put, mesh_id=mesh_id)
        self.tiers: TierStore | None = None
        try:
            if memory_gb is None:
                self.shards = load_expert_shards(reader, shards, self.dtype, self.device, on_bytes=reporter.add,
                                                 quant=quant)
            else:
                self.tiers = TierStore(shards, self._lower_tier(reader, shards, quant), int(memory_gb * GIB),
                                       eviction=eviction)
                self.tiers.preload(on_bytes=reporter.add)
                self.shards = {}
        except BaseException as exc:
            reporter.finish(error=f"{type(exc).__name__}: {exc}")
            raise
        reporter.finish()
        self.quant = quant
        self.hosted = sorted(shards)
        # A call's experts in grouped matmuls, as the reference (with tiers: expert by expert, see the docstring).
        self.experts = GroupedExperts(self.shards, self.act) if self.tiers is None else None
        self.calls = 0
        self.tokens = 0
        self.tracer = build_tracer(TracingConfig(**tracing), f"expert:{name}") if tracing else None
        self.metrics = ExpertMetrics(name, tiers=self.tiers is not None) if metrics else None
        self.compute_s = 0.0  # time inside forward (benchmarks subtract it from a round to get the transport's cost)
        self.compute_cpu_s = 0.0  # CPU time of this thread inside forward: unlike wall time, not inflated by waiting
        self._grpc = None  # the gRPC transport server, started on first `grpc_address`
        self._socket = None  # the socket transport server, started on first `socket_address`
        self._warm_up()

    def _lower_tier(self, reader, shards: list[Shard], quant: str):
        """Where shards beyond the budget wait: host memory (pinned) under a GPU, the mapped checkpoint on a CPU
        (quantised as they are read, exactly as an all-resident actor loads them)."""
        if self.device.type != "cuda":
            return DiskTier(reader, self.dtype, self.device, quant)
        host = load_expert_shards(reader, shards, self.dtype, "cpu", quant=quant)
        return HostTier({s: pinned_copy(w) for s, w in host.items()}, self.device)

    def _warm_up(self) -> None:
        """One forward per shard before the actor reports ready, so its first real call pays no lazy setup."""
        resident = self.shards.values() if self.tiers is None else [self.tiers.weights(s)
                                                                     for s in self.tiers.resident()]
        with torch.inference_mode():
            for weights in resident:
                gated_mlp(torch.zeros(1, weights.gate_up.shape[1], device=self.device, dtype=self.dtype), weights,
                          self.act)

    def forward(self, layer: int, experts: list[int], counts: list[int], x: HostTensor,
                trace: dict[str, str] | None = None, prefetch: list[Shard] | None = None) -> HostTensor:
        """x: [sum(counts), H], rows grouped by expert in `experts` order -> unweighted expert outputs, same layout.
        trace: W3C carrier of the router's dispatch span (None: tracing off, no span is made).
        prefetch: shards the router predicts for the next layer, loaded in the background while this call computes
        (ignored without a memory budget). Handed to the tiers after this call's shards are pinned: a hint handed
        first could evict the very shard this call is about to compute with (measured: it did, README: Offload)."""
        # Arrays from Ray's object store (and gRPC messages) are read-only views; we never write to them.
        return self._traced(layer, experts, counts, to_tensor(x), trace, prefetch, to_host=True)

    def forward_rdt(self, layer: int, experts: list[int], counts: list[int], rows: RdtBox | torch.Tensor,
                    trace: dict[str, str] | None = None, prefetch: list[Shard] | None = None) -> RdtBox | torch.Tensor:
        """The `rdt` transport's call (router_service/transports/rdt.py). rows: the box of the [sum(counts), H] rows
        (experts/rdt_box.py; an empty tensor comes as itself). The box keeps Ray from resolving the ref: this call
        reads the rows out of the router's memory itself (NIXL, one-sided) into this process's registered read slab,
        on its own thread, with a timeout. Ray's own receive for a bare ref would run in the actor's `_ray_system`
        concurrency group, which a compiled graph's loop holds for as long as it is up. The output stays here, on
        this actor's device, in Ray's NIXL pool; the router reads it the same way. -> the output's box."""
        with rdt_reading(rows, self.device) as x:  # [sum(counts), H]; the range is free again after the forward
            out = self._traced(layer, experts, counts, x, trace, prefetch, to_host=False)
            return rdt_box(out)

    def rdt_echo(self, rows: RdtBox | torch.Tensor) -> RdtBox | torch.Tensor:
        """Reads a box like forward_rdt and puts the tensor back: the `rdt` transport's warm-up, so NIXL's agent
        (seconds to start under load) and the registered memory are up before the first real call."""
        with rdt_reading(rows, self.device) as x:
            return rdt_box(x.clone())

    def _traced(self, layer: int, experts: list[int], counts: list[int], rows: torch.Tensor,
                trace: dict[str, str] | None, prefetch: list[Shard] | None, to_host: bool) -> HostTensor | torch.Tensor:
        if trace is not None and self.tracer is not None:
            with self.tracer.start_as_current_span(
                "expertmesh.expert", context=context_of(trace),
                attributes={"actor": self.name, "layer": layer, "experts": list(experts), "tokens": int(sum(counts))},
            ):
                return self._forward(layer, experts, counts, rows, to_host, prefetch)
        return self._forward(layer, experts, counts, rows, to_host, prefetch)

    def _forward(self, layer: int, experts: list[int], counts: list[int], rows: torch.Tensor,
                 to_host: bool, prefetch: list[Shard] | None = None) -> HostTensor | torch.Tensor:
        """rows: [sum(counts), H] on any device -> outputs packed as host bytes (to_host) or left on this actor's
        device for the `rdt` transport to put (experts/rdt_box.py waits for the device there)."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        inputs = rows.to(self.device, self.dtype, non_blocking=True)  # [sum(counts), H]
        with torch.inference_mode():
            result = self._compute(layer, experts, counts, inputs, prefetch)  # [sum(counts), H]
            if to_host:
                stager = HostStager()  # one per call: gRPC threads and Ray calls may run forwards side by side
                host = stager.stage(result)
                stager.finish()  # the one synchronisation of this call (none on a CPU)
                out: HostTensor | torch.Tensor = pack(host)
            else:
                # Left on the device, unsynchronised: rdt_box waits for the stream before the router can read it.
                out = result.contiguous()
        self.calls += 1
        self.tokens += int(rows.shape[0])
        elapsed = time.perf_counter() - started
        self.compute_s += elapsed
        self.compute_cpu_s += time.thread_time() - cpu_started
        if self.metrics is not None:
            self.metrics.observe(elapsed, None if self.tiers is None else self.tiers.stats())
        return out

    def _compute(self, layer: int, experts: list[int], counts: list[int], inputs: torch.Tensor,
                 prefetch: list[Shard] | None = None) -> torch.Tensor:
        """inputs: [sum(counts), H] on this actor's device, rows grouped by expert -> outputs, same layout."""
        if self.tiers is None:
            return self.experts.run(layer, list(experts), list(counts), inputs)
        weights = self.tiers.acquire(layer, list(experts))  # resident and pinned for this call
        try:
            if prefetch:
                self.prefetch(prefetch)  # loads while this call computes, never over its pinned shards
            outs = [gated_mlp(rows, w, self.act) for w, rows in zip(weights, inputs.split(list(counts)))]  # [n_e, H]
            return torch.cat(outs) if outs else inputs.new_zeros((0, inputs.shape[1]))
        finally:
            self.tiers.release(layer, list(experts))

    def prefetch(self, shards: list[Shard]) -> None:
        """Start loading these shards (the router's prediction for its next layer) in the background."""
        if self.tiers is not None:
            self.tiers.prefetch([(int(layer), int(expert)) for layer, expert in shards])

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {
            "name": self.name,
            "mesh_id": self.mesh_id,  # mesh.id: which mesh (namespace, stored keys) this actor belongs to
            "node_id": ctx.get_node_id(),
            "gpu_ids": self.gpu_ids,
            "device": str(self.device),
            "dtype": self.dtype_name,
            "threads": self.threads,
            "pid": os.getpid(),
            "shards": self.hosted,
            "quant": self.quant,  # experts.quant: weight_bytes are packed integers + scales when not "none"
            "weight_bytes": (sum(w.nbytes() for w in self.shards.values()) if self.tiers is None
                             else self.tiers.resident_bytes()),
            "calls": self.calls,
            "tokens": self.tokens,
            "generation": self.generation,
            "compute_s": self.compute_s,
            "compute_cpu_s": self.compute_cpu_s,
            "tiers": None if self.tiers is None else self.tiers.stats(),
        }

    def ready(self) -> bool:
        return True

    def grpc_address(self) -> str:
        """host:port of this actor's gRPC transport server, started on the first ask (on the node's cluster IP, for
        callers holding the cluster secret) so actors only reached over Ray calls pay nothing for it."""
        if self._grpc is None:
            from .grpc_server import ExpertGrpcServer
            from .transport_secret import transport_secret

            self._grpc = ExpertGrpcServer(self.forward, ray.util.get_node_ip_address(), transport_secret())
        return self._grpc.address

    def socket_address(self) -> str:
        """host:port of this actor's socket transport server (experts/socket_server.py), started on the first ask,
        like `grpc_address`."""
        if self._socket is None:
            from .socket_server import ExpertSocketServer
            from .transport_secret import transport_secret

            self._socket = ExpertSocketServer(self.forward, ray.util.get_node_ip_address(), transport_secret())
        return self._socket.address

    def forward_step(self, step: tuple) -> HostTensor | None:
        """One layer step of a compiled graph that feeds every actor the same input:
        step = (layer, {actor name: (experts, counts, x)}, trace) -> this actor's outputs, None when it has no rows."""
        layer, calls, trace = step
        call = calls.get(self.name)
        if call is None:
            return None
        experts, counts, x = call
        if trace:
            return self.forward(layer, experts, counts, x, trace=trace)
        return self.forward(layer, experts, counts, x)

