"""The router's whole step on a chosen device, without Ray: the scenarios that the fake-CUDA test
(tests/unit/test_router_step_fake_cuda.py) and the GPU script (tests/router_step_cuda.py) both run.

The router here is the real one minus Ray: dense weights, paged KV pool, gates and sampling on `device`
(router_service/router.py does the same), `RemoteExperts` (router_service/dispatch.py: the device crossing, no-replica
policy, shedding, planning, combine) over an in-process transport whose "actors" compute the checkpoint's experts
with the actors' own grouped kernels, and the `ContinuousBatcher` (chunked prefill, continuous batching, sampling,
stream resumption) stepping on the calling thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from expertmesh.cluster.routing_table import RoutingTable
from expertmesh.experts.arrays import pack, to_tensor
from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.decode_graphs import GraphSettings
from expertmesh.experts.ffn import activation
from expertmesh.experts.grouped_ffn import GroupedExperts
from expertmesh.experts.kv_cache import KVCacheSettings, settings_for
from expertmesh.experts.modeling import MoEDecoder
from expertmesh.experts.weights import load_dense_weights, load_expert_shards
from expertmesh.router_service.batching import BatcherConfig, ContinuousBatcher, DoneEvent, GenerationRequest
from expertmesh.router_service.dispatch import FailoverConfig, RemoteExperts
from expertmesh.router_service.sampling import SamplingParams
from expertmesh.router_service.shedding import ShedConfig

# Sheds from the first round: a shard is "overloaded" above 8 slots per replica (the busier ones at prefill).
EAGER_SHED = ShedConfig(enabled=True, replica_tokens_per_step=8, threshold=1.0, window_s=0.0, off_threshold=0.0,
                        off_window_s=0.0)


class InProcessActors:
    """A transport whose actors are in this process: each call's rows (host bytes, as on the wire) are computed by
    the experts the actor hosts, on `device`, and come back as host bytes, as an expert actor's forward does."""

    takes_prefetch = False

    def __init__(self, table: RoutingTable, experts: GroupedExperts, device: torch.device, device_rows: bool = False):
        self.table = table
        self.experts = experts
        self.device = device
        # As the `rdt` transport: a device router's rows come as device tensors, outputs go back onto its device.
        self.takes_device_rows = device_rows
        self.actors = {name: object() for name in table.actors}
        self.calls = 0
        self.device_row_calls = 0  # calls whose rows came as device tensors

    def submit(self, actor: str, layer: int, experts: list[int], counts: list[int], x, **_):
        assert all((layer, e) in self.table.actors[actor] for e in experts), (actor, layer, experts)
        self.calls += 1
        if isinstance(x, torch.Tensor):  # device rows: only a transport that takes them may be handed them
            assert self.takes_device_rows and x.device.type != "cpu", x.device
            self.device_row_calls += 1
            out = self.experts.run(layer, list(experts), list(counts), x.to(self.device))
            return out.to(x.device)  # read back onto the router's device
        rows = to_tensor(x).to(self.device)  # [sum(counts), H]
        out = self.experts.run(layer, list(experts), list(counts), rows)
        return pack(out.cpu())

    def gather_settled(self, handles, timeout: float):
        return [h if isinstance(h, torch.Tensor) else to_tensor(h) for h in handles]


@dataclass
class StepSetup:
    """How to build one router: the scenario's knobs."""

    capacity_factor: float | None = None
    overlap: bool = False
    failover: FailoverConfig = field(default_factory=FailoverConfig)
    actors: int = 2  # expert actors per layer (each hosts a contiguous slice of the experts)
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    actor_device: str | None = None  # where the in-process actors compute (None: the router's device)
    # Load statistics per layer and step, as a real router keeps them (no metrics, no Ray calls). None: when the
    # observer's module imports (it needs Ray and OpenTelemetry, which the GPU machine's image lacks).
    observe: bool | None = None
    # Decode steps replayed as CUDA graphs (experts/decode_graphs.py); None: eager. Only on a (fake) CUDA device.
    cuda_graphs: GraphSettings | None = None
    device_rows: bool = False  # the in-process transport takes device rows, as `rdt` does


def build_router(model_dir: Path, device: torch.device | str, dtype: torch.dtype,
                 setup: StepSetup | None = None) -> tuple[MoEDecoder, RemoteExperts]:
    """The router's decoder on `device` over in-process expert actors (computing on setup.actor_device, by default
    `device` too)."""
    setup = setup or StepSetup()
    device = torch.device(device)
    actor_device = torch.device(setup.actor_device or device)
    reader = CheckpointReader(model_dir)
    cfg = reader.config
    dense = load_dense_weights(reader, dtype, device=device)
    shards = [(layer, e) for layer in cfg.moe_layers for e in range(cfg.num_experts)]
    experts = GroupedExperts(load_expert_shards(reader, shards, dtype, device=actor_device),
                             activation(cfg.hidden_act))
    per_actor = -(-cfg.num_experts // setup.actors)
    layout = {f"expert-a{a}": [(layer, e) for layer in cfg.moe_layers
                               for e in range(a * per_actor, min(cfg.num_experts, (a + 1) * per_actor))]
              for a in range(setup.actors)}
    table = RoutingTable.from_actor_shards(layout)
    backend = RemoteExperts(table, InProcessActors(table, experts, actor_device, setup.device_rows), setup.failover)
    kv = (settings_for(device, setup.kv_cache_gb, setup.gpu_memory_utilization) if device.type == "cuda"
          else KVCacheSettings(max_tokens=4096))
    model = MoEDecoder(cfg, dense, backend, setup.capacity_factor, overlap=setup.overlap, kv_cache=kv,
                       cuda_graphs=setup.cuda_graphs)
    if setup.observe is not False:
        try:
            from expertmesh.router_service.observability import RouterObserver
        except ImportError:
            if setup.observe:
                raise
        else:
            backend.observer = RouterObserver(cfg, backend, "router-step")
            model.step_observer = backend.observer.on_step
    return model, backend


def prompts(vocab: int, lengths: tuple[int, ...] = (7, 12, 3), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def prefill_then_decode(model: MoEDecoder, prompt_ids: list[list[int]], steps: int = 3) -> list[torch.Tensor]:
    """Whole prompts (one forward, several sequences), then greedy decode steps of every sequence together.
    -> every step's last-position logits [B, V], on the host."""
    caches = [model.new_cache() for _ in prompt_ids]
    out = []
    logits = model.forward([torch.tensor(p) for p in prompt_ids], caches, logits="last")
    for _ in range(steps + 1):
        last = torch.stack([x[-1] for x in logits])  # [B, V]
        out.append(last.cpu())
        nxt = last.argmax(-1).cpu()  # [B]
        logits = model.forward([t.view(1) for t in nxt], caches, logits="last")
    for cache in caches:
        cache.free()
    return out


class InlineExecutor(concurrent.futures.Executor):
    """Runs the batcher's forward on the event loop's own thread: the fake-CUDA double's interception is per
    thread, and the step is the same whichever thread runs it."""

    def submit(self, fn, /, *args, **kwargs):
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine, as a thread pool would
            future.set_exception(exc)
        return future


SAMPLINGS = (
    SamplingParams(),  # greedy
    SamplingParams(temperature=1.0, seed=7),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=11),
    # logit rules (sampling.adjust_logits) on the logits' device; with min_tokens below, a suppressed stop id too
    SamplingParams(temperature=0.7, seed=3, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.3,
                   logit_bias=((2, 1.5),)),
)


def serve(model: MoEDecoder, requests: list[GenerationRequest], max_prefill_tokens: int = 8) -> list[list[int]]:
    """The requests served together by the continuous batcher (chunked prefill: prompts longer than
    max_prefill_tokens take several steps while the others decode). -> generated ids per request."""
    batcher = ContinuousBatcher(model, decode=None, config=BatcherConfig(max_prefill_tokens=max_prefill_tokens))
    batcher._executor = InlineExecutor()

    async def one(request: GenerationRequest) -> list[int]:
        ids: list[int] = []
        async for event in batcher.stream(request):
            if isinstance(event, DoneEvent):
                return ids
            ids.extend(event.token_ids)
        return ids

    async def all_of() -> list[list[int]]:
        return list(await asyncio.gather(*(one(r) for r in requests)))

    return asyncio.run(all_of())


def serving_requests(vocab: int, max_tokens: int = 5) -> list[GenerationRequest]:
    requests = [GenerationRequest(prompt_ids=p, max_tokens=max_tokens, sampling=s)
                for p, s in zip(prompts(vocab, (13, 5, 9, 6)), SAMPLINGS)]
    # the last one's stop id stays suppressed for its whole run (min_tokens = max_tokens): every stream is whole
    requests[-1] = replace(requests[-1], stop_token_ids=frozenset({5}), min_tokens=max_tokens)
    return requests


def resumed(request: GenerationRequest, delivered: list[int]) -> GenerationRequest:
    """The same request resumed on another router after `delivered` tokens reached the client."""
    return replace(request, resumed_ids=tuple(delivered))
