"""`expertmesh bench shed`: overload shedding off vs on, with one expert made hot, in one run.

The embedded model (fp32) behind the router's real data path: the continuous batcher (router_service/batching.py),
the decoder, and the dispatcher (router_service/dispatch.py RemoteExperts) with its shedding policy. A gate bias
added to one expert's logit in every MoE layer (in memory, `LayerWeights.router_bias`, the field gpt-oss's router
bias uses) makes that expert every token's favourite, so it is offered one slot per token per layer while the other
seven share the rest.

Why the experts are modelled devices, not Ray actors. Shedding protects a replica's *capacity*: it helps when a
replica's time per call grows with the tokens it gets (a GPU expert at batch sizes where it is compute- or
memory-bound). On this 2-core CPU box the embedded model's experts are tiny (H=64, I=128: microseconds per token)
and eight Ray actors share two cores, so a call's time is Ray's per-call overhead, the same whether the hot actor
gets 32 slots or 16; moving slots elsewhere changes nothing measurable, or costs a little (the next-best experts
get bigger calls). So each expert replica here is an in-process worker that computes the exact expert math and
then holds the call for `call_ms + per_token_ms x slots` (a sleep: other replicas' calls proceed meanwhile, as on
separate devices); one call at a time per replica, so an overloaded one queues. That is the model under which the
write-ups' breaker pays off, made explicit; the figures are ratios under it, not a claim about Ray actors on CPUs.

Phases: shedding off and on, alternated `rounds` times (so background load on a shared machine falls on both
alike), everything else equal. Each: `streams` concurrent streams of `max_tokens` greedy tokens; gaps between
consecutive tokens of every stream are recorded once every stream has produced 3 tokens and the shedding window has
passed (steady state under sustained overload) until the first stream finishes, and reported pooled per mode as
p50/p99 (and p99 per round) with tokens/s over the same intervals; shed slots from the responses (DoneEvent.shed)
and from the dispatcher's counter, which must agree. One slow step delays every stream at once, so p99 is the
slowest ~1 % of steps: on a loaded machine it measures the machine's hiccups as much as the replicas, hence also
the per-round p99 ratios (on / off, each pair run back to back) and their median.

Quality cost: held-out perplexity over ops/train/corpus.py's held-out text, in process. (1) The biased model without
shedding and with the policy applied to every expert round (window 0, capacity scaled from serving rounds of
`streams` tokens to scoring rounds of 256, the cap as configured: the steady shedding state); the gate bias is an
artificial fault that shedding partly undoes, so this perplexity can fall. (2) The cost of shedding itself: the
unbiased model with `max_share` of its busiest expert's slots moved to their next-best expert in every layer and
round. Scored with ops/perplexity.py, as every benchmark is.
"""

from __future__ import annotations

import asyncio
import contextlib
import platform
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from ..measure import percentile
from ..perplexity import held_out_perplexity
from .common import alternate, machine_info, say_to_stderr

PPL_WINDOW = 256


class ModelledDeviceTransport:
    """A Transport whose replicas are in-process workers with a service time per call (see the module docstring):
    exact expert math, then held for call_s + per_token_s x slots; one call at a time per replica."""

    def __init__(self, shards: dict, act, actors: list[str], call_s: float, per_token_s: float):
        from ...experts.arrays import to_tensor
        from ...experts.ffn import gated_mlp

        self._to_tensor, self._mlp = to_tensor, gated_mlp
        self.shards, self.act = shards, act
        self.call_s, self.per_token_s = call_s, per_token_s
        self.actors = {name: object() for name in actors}
        self._workers = {name: ThreadPoolExecutor(1, thread_name_prefix=name) for name in actors}
        self.busy_s = {name: 0.0 for name in actors}
        self._lock = threading.Lock()

    def _serve(self, actor: str, layer: int, experts: list[int], counts: list[int], rows: torch.Tensor):
        started = time.perf_counter()
        out = torch.cat([self._mlp(r, self.shards[(layer, e)], self.act) for e, r in zip(experts, rows.split(counts))])
        hold = self.call_s + self.per_token_s * sum(counts) - (time.perf_counter() - started)
        if hold > 0:
            time.sleep(hold)
        with self._lock:
            self.busy_s[actor] += time.perf_counter() - started
        return out

    def submit(self, actor: str, layer: int, experts: list[int], counts: list[int], x) -> Future:
        rows = self._to_tensor(x).clone()  # [sum(counts), H]; the staging buffer is reused by the next send
        return self._workers[actor].submit(self._serve, actor, layer, list(experts), list(counts), rows)

    def gather_settled(self, handles: list[Future], timeout: float) -> list:
        out = []
        for h in handles:
            try:
                out.append(h.result(timeout=timeout))
            except Exception as exc:  # a failed call is the dispatcher's to retry
                out.append(exc)
        return out

    def close(self) -> None:
        for worker in self._workers.values():
            worker.shutdown(wait=False)


def hot_model(hot_expert: int, bias: float):
    """The embedded model as the in-process reference, with `bias` added to `hot_expert`'s gate logit in every MoE
    layer. -> (decoder, model_dir)."""
    from ...experts.embedded_model import EMBEDDED_MODEL_DIR
    from ...experts.reference import load_reference_model

    model = load_reference_model(EMBEDDED_MODEL_DIR)
    for layer in model.w.layers:
        if layer.router is not None:
            layer.router_bias = torch.zeros(model.cfg.num_experts, dtype=layer.router.dtype)  # [E]
            layer.router_bias[hot_expert] = bias
    return model, EMBEDDED_MODEL_DIR


def _perplexity(model, ids: list[int]) -> float:
    """ops/perplexity.py's held-out perplexity of `model` (an MoEDecoder) over `ids`, windows of PPL_WINDOW."""
    return held_out_perplexity(model, ids=ids)["perplexity"]


class _ShedEveryRound:
    """The reference's experts with the shedding policy applied to every expert round (window 0: the steady
    shedding state), for the perplexity cost."""

    def __init__(self, inner, config, num_experts: int):
        from ...router_service.shedding import ShedPolicy

        self.inner, self.policy = inner, ShedPolicy(config, num_experts)
        self.num_experts = num_experts
        self.shed = self.slots = 0
        self._served: dict[int, object] = {}

    def _apply(self, layer, routing):
        from ...router_service.shedding import apply_shed

        replicas = torch.ones(self.num_experts, dtype=torch.int64)
        shed = self.policy.observe(layer, 0.0, routing.tokens_per_expert(self.num_experts), replicas)
        served = apply_shed(routing, shed, ~self.policy.shedding(layer))
        self.shed += served.shed
        self.slots += int((routing.experts >= 0).sum())
        self._served[layer] = served
        return served

    def effective_routing(self, layer, routing):
        return self._served.get(layer, routing)

    def run(self, layer, hidden, routing):
        return self.inner.run(layer, hidden, self._apply(layer, routing))


async def _phase(model, streams: int, max_tokens: int, prompts: list[list[int]], settle_s: float) -> dict:
    from ...router_service.batching import BatcherConfig, ContinuousBatcher, DoneEvent, GenerationRequest

    batcher = ContinuousBatcher(model, None, BatcherConfig(max_active=streams))
    started = time.perf_counter()
    last: dict[int, float] = {}
    counts = [0] * streams
    gaps: list[float] = []
    window: dict[str, float] = {}
    done_shed = [0]
    recorded = [0]

    async def consume(i: int) -> None:
        request = GenerationRequest(prompt_ids=prompts[i % len(prompts)], max_tokens=max_tokens)  # no EOS stop
        async with contextlib.aclosing(batcher.stream(request)) as events:
            async for event in events:
                now = time.perf_counter()
                if isinstance(event, DoneEvent):
                    done_shed[0] += event.shed
                    continue
                if "start" not in window and min(counts) >= 3 and now - started >= settle_s:
                    window["start"] = now
                if "start" in window and i in last and "end" not in window:
                    gaps.append(now - last[i])
                    recorded[0] += 1
                last[i] = now
                counts[i] += 1

    tasks = [asyncio.ensure_future(consume(i)) for i in range(streams)]
    # The window ends when the first stream finishes (after that fewer streams share the steps).
    while not any(t.done() for t in tasks):
        await asyncio.sleep(0.01)
    window["end"] = time.perf_counter()
    await asyncio.gather(*tasks)
    seconds = window["end"] - window.get("start", window["end"])
    return {"gaps": gaps, "tokens": recorded[0], "seconds": seconds, "steps": batcher.steps,
            "shed_tokens_in_responses": done_shed[0]}


def _summary(runs: list[dict]) -> dict:
    """The rounds of one mode pooled: gaps, tokens over measured seconds, shed slots."""
    gaps = [g for r in runs for g in r["gaps"]]
    seconds = sum(r["seconds"] for r in runs)
    return {
        "gaps": len(gaps),
        "inter_token_ms": {"p50": _ms(percentile(gaps, 50)), "p99": _ms(percentile(gaps, 99)),
                           "max": _ms(max(gaps) if gaps else None)},
        "p99_per_round_ms": [_ms(percentile(r["gaps"], 99)) for r in runs],
        "tokens_per_s": round(sum(r["tokens"] for r in runs) / seconds, 2) if seconds > 0 else None,
        "measured_s": round(seconds, 3),
        "shed_tokens_in_responses": sum(r["shed_tokens_in_responses"] for r in runs),
        "shed_slots_dispatcher": sum(r["shed_slots_dispatcher"] for r in runs),
        "hot_replica_busy_s": round(sum(r["hot_busy_s"] for r in runs), 3),
        "other_replicas_busy_s_max": round(max(r["others_busy_s_max"] for r in runs), 3),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000.0 * seconds, 2)


@dataclass(frozen=True)
class ShedParams:
    """streams x max_tokens served per phase; bias: added to the hot expert's gate logit; call_ms / per_token_ms:
    the modelled replica time; capacity, threshold, window_s, max_share: the shedding policy; ppl_tokens: held-out
    tokens scored; rounds: off/on pairs, alternated."""

    streams: int = 24
    max_tokens: int = 64
    hot_expert: int = 0
    bias: float = 4.0
    call_ms: float = 1.0
    per_token_ms: float = 2.0
    capacity: int = 8
    threshold: float = 0.95
    window_s: float = 1.0
    max_share: float = 0.5
    ppl_tokens: int = 1024
    rounds: int = 5

    @classmethod
    def from_args(cls, args) -> ShedParams:
        return cls(streams=args.streams, max_tokens=args.max_tokens, bias=args.gate_bias, call_ms=args.call_ms,
                   per_token_ms=args.per_token_ms, capacity=args.capacity, window_s=args.window_s,
                   max_share=args.max_share, ppl_tokens=args.ppl_tokens, rounds=args.rounds)


def run_shed_bench(params: ShedParams = ShedParams(), verbose: bool = True) -> dict:
    from ...cluster.routing_table import RoutingTable
    from ...experts.modeling import MoEDecoder
    from ...router_service.dispatch import FailoverConfig, RemoteExperts
    from ...router_service.shedding import ShedConfig
    from ..drill.workload import held_out_chunk, make_prompts

    say = say_to_stderr(verbose)
    streams, max_tokens, hot_expert, bias = params.streams, params.max_tokens, params.hot_expert, params.bias
    call_ms, per_token_ms, capacity, threshold = params.call_ms, params.per_token_ms, params.capacity, params.threshold
    window_s, max_share, ppl_tokens, rounds = params.window_s, params.max_share, params.ppl_tokens, params.rounds
    run_started = time.perf_counter()
    torch.set_num_threads(1)  # the replicas are modelled; the dense work is small: keep the box's cores for them
    model, model_dir = hot_model(hot_expert, bias)
    cfg = model.cfg
    shed_config = ShedConfig(enabled=True, replica_tokens_per_step=capacity, threshold=threshold, window_s=window_s,
                             off_window_s=window_s, max_share=max_share)
    result: dict = {
        "benchmark": "shed", "model": "embedded (expertmesh-demo), fp32, gate bias on one expert",
        "hot_expert": hot_expert, "gate_bias": bias, "streams": streams, "max_tokens": max_tokens,
        "replica_model": {"call_ms": call_ms, "per_token_ms": per_token_ms, "replicas_per_expert": 1,
                          "note": "in-process replicas held call_ms + per_token_ms x slots per call (module "
                                  "docstring: why not Ray actors on this CPU box)"},
        "shed_config": {"replica_tokens_per_step": capacity, "threshold": threshold, "window_s": window_s,
                        "off_window_s": window_s, "max_share": max_share},
    }
    prompts = make_prompts(None)
    layout = {f"expert-e{e}-r0": [(layer, e) for layer in cfg.moe_layers] for e in range(cfg.num_experts)}
    table = RoutingTable.from_actor_shards(layout)
    hot_name = f"expert-e{hot_expert}-r0"
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    # Off and on alternate, `rounds` times, so background load on a shared box falls on both alike.
    for round_index, name in alternate(rounds, ("off", "on")):
        transport = ModelledDeviceTransport(model.experts.shards, model.experts.act, list(layout),
                                            call_ms / 1000.0, per_token_ms / 1000.0)
        failover = FailoverConfig(shed=replace(shed_config, enabled=name == "on"))
        backend = RemoteExperts(table, transport, failover)  # a fresh policy: the window starts again
        say(f"round {round_index + 1}/{rounds}, shedding {name}: {streams} streams x {max_tokens} tokens ...")
        try:
            run = asyncio.run(_phase(MoEDecoder(cfg, model.w, backend), streams, max_tokens, prompts,
                                     settle_s=window_s + 0.5))
        finally:
            transport.close()
        busy = transport.busy_s
        run.update(shed_slots_dispatcher=backend.shed_slots, hot_busy_s=busy[hot_name],
                   others_busy_s_max=max(v for k, v in busy.items() if k != hot_name))
        runs[name].append(run)
        say(f"  itl p99 {_ms(percentile(run['gaps'], 99))} ms, shed {backend.shed_slots}")
    phases = {name: _summary(r) for name, r in runs.items()}
    result["rounds"] = rounds
    result["phases"] = phases
    off, on = phases["off"], phases["on"]
    result["p50_inter_token_ratio_on_vs_off"] = _ratio(on["inter_token_ms"]["p50"], off["inter_token_ms"]["p50"])
    result["p99_inter_token_ratio_on_vs_off"] = _ratio(on["inter_token_ms"]["p99"], off["inter_token_ms"]["p99"])
    result["tokens_per_s_ratio_on_vs_off"] = _ratio(on["tokens_per_s"], off["tokens_per_s"])
    # Round by round (each off run next to its on run): one machine stall in either mode moves the pooled p99 by
    # itself; the median of the per-round ratios does not.
    per_round = [_ratio(b, a) for a, b in zip(off["p99_per_round_ms"], on["p99_per_round_ms"])]
    result["p99_ratio_per_round"] = per_round
    result["p99_ratio_median_of_rounds"] = percentile([r for r in per_round if r is not None], 50)
    result["shed_counted_per_response_equals_dispatcher"] = (
        on["shed_tokens_in_responses"] == on["shed_slots_dispatcher"])

    say("held-out perplexity ...")
    ids, source = held_out_chunk(None, ppl_tokens)
    # Scoring runs rounds of PPL_WINDOW tokens, serving rounds of `streams`: the capacity is scaled by their ratio
    # so every expert sees the utilisation it had while serving.
    scaled = replace(shed_config, window_s=0.0,
                     replica_tokens_per_step=max(1, round(capacity * PPL_WINDOW / streams)))
    shedder = _ShedEveryRound(model.experts, scaled, cfg.num_experts)
    plain_ppl = _perplexity(model, ids)
    shed_ppl = _perplexity(MoEDecoder(cfg, model.w, shedder), ids)
    # The biased gate is an artificial fault: shedding partly undoes it, so the biased model's perplexity can fall.
    # The cost of shedding itself: the unbiased model with the cap (max_share of the slots) moved off its
    # naturally busiest expert in every layer and round.
    unbiased, _ = hot_model(hot_expert, 0.0)
    busiest = _busiest_expert(unbiased, ids[:PPL_WINDOW])
    forced = _ShedFixedShare(unbiased.experts, busiest, max_share, cfg.num_experts)
    unbiased_ppl = _perplexity(unbiased, ids)
    forced_ppl = _perplexity(MoEDecoder(cfg, unbiased.w, forced), ids)
    result["quality"] = {
        "held_out_tokens": len(ids), "window": PPL_WINDOW, "source": source["source"],
        "hot_expert_share_of_slots": round(_hot_share(model, ids[:PPL_WINDOW], hot_expert), 4),
        "biased_model": {
            "scoring_capacity": scaled.replica_tokens_per_step,
            "perplexity_no_shedding": round(plain_ppl, 4), "perplexity_shedding": round(shed_ppl, 4),
            "perplexity_delta_pct": round(100.0 * (shed_ppl / plain_ppl - 1.0), 3),
            "shed_share_of_slots": round(shedder.shed / max(1, shedder.slots), 4)},
        "unbiased_model_cap_on_busiest_expert": {
            "expert": busiest, "share_moved": max_share,
            "perplexity": round(unbiased_ppl, 4), "perplexity_shedding": round(forced_ppl, 4),
            "perplexity_delta_pct": round(100.0 * (forced_ppl / unbiased_ppl - 1.0), 3),
            "shed_share_of_slots": round(forced.shed / max(1, forced.slots), 4)},
    }
    result["machine"] = machine_info(python=platform.python_version())
    result["run_wall_s"] = round(time.perf_counter() - run_started, 3)
    return result


class _ShedFixedShare(_ShedEveryRound):
    """The reference's experts with `share` of one expert's slots moved to their next-best expert every round."""

    def __init__(self, inner, expert: int, share: float, num_experts: int):
        self.inner, self.expert, self.share, self.num_experts = inner, expert, share, num_experts
        self.shed = self.slots = 0
        self._served = {}

    def _apply(self, layer, routing):
        from ...router_service.shedding import apply_shed

        counts = torch.zeros(self.num_experts, dtype=torch.int64)
        counts[self.expert] = int(self.share * int((routing.experts == self.expert).sum()))
        targets = torch.ones(self.num_experts, dtype=torch.bool)
        targets[self.expert] = False
        served = apply_shed(routing, counts, targets)
        self.shed += served.shed
        self.slots += int((routing.experts >= 0).sum())
        self._served[layer] = served
        return served


def _busiest_expert(model, ids: list[int]) -> int:
    """The expert with the most routed slots over all MoE layers on `ids`."""
    model.forward([torch.tensor(ids, dtype=torch.int64)])
    total = sum(r.tokens_per_expert(model.cfg.num_experts) for r in model.last_trace.routings.values())
    return int(torch.argmax(total))


def _hot_share(model, ids: list[int], hot_expert: int) -> float:
    """Share of routed slots (all MoE layers) the hot expert gets on `ids`."""
    model.forward([torch.tensor(ids, dtype=torch.int64)])
    routings = model.last_trace.routings.values()
    hot = sum(int((r.experts == hot_expert).sum()) for r in routings)
    return hot / sum(int((r.experts >= 0).sum()) for r in routings)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)
