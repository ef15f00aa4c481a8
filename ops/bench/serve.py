"""`expertmesh bench serve`: end-to-end streaming throughput of `expertmesh serve`, against in-process
`transformers` generate, with a profile of where a step's time goes.

For each concurrency level c, c streams (one asyncio client, one channel) each run `requests_per_stream` Generate
requests one after the other (greedy, `ignore_eos`, so every stream yields exactly `max_tokens` tokens). Every
token message's arrival time is recorded; the result per level is the aggregate tokens/s (all tokens over the
level's wall time), per-stream tokens/s, inter-token and time-to-first-token latencies, and how the router's
continuous batcher behaved (Admin GetRouterStats before and after: steps taken, the largest batch).

Beside it, `transformers` generate in this process at batch size c on the same prompts and token counts
(ops/bench/serve_reference.py), with no server up, right before each server starts and right after it stops (so
machine noise hits both alike); η_serve = ours ÷ theirs. The step profile is the router's stage clocks
(router_service/step_profile.py) over the level, plus the actors' compute time (GetClusterState), as ms per step
(ops/bench/serve_profile.py), drawn as a stacked bar chart (ops/bench/serve_chart.py).

Models: "embedded" (the small bundled model: overhead-bound), "mid" (bench dispatch's hidden-1024 Mixtral:
compute-bound) or a checkpoint folder. Transports: one freshly started server per name in `transports`.
The older goal is kept in the JSON: at 32 streams the aggregate is at least 10x one stream (continuous batching).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from ...protos import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from ...protos import inference_pb2 as pb
from .. import client
from ..measure import percentile
from ..server_process import ServerProcess, start_server
from .checkpoints import write_bench_checkpoint
from .common import machine_info, say_to_stderr
from .serve_chart import write_profile_chart
from .serve_profile import profile_table, stage_deltas
from .serve_reference import EngineReference, TransformersReference
from .serve_report import add_eta, engine_levels

GOAL = "aggregate tokens/s at 32 streams >= 10x one stream"
GOAL_SPEEDUP = 10.0
PROMPT_LEN = 8
STREAM_TIMEOUT_S = 900.0
# Issue 17's targets for η_serve (served tok/s ÷ in-process transformers generate tok/s), per model and stream count.
ETA_TARGETS = {"embedded": {"1": 0.5, "32": 0.5}, "mid": {"1": 0.8, "8": 0.8, "32": 0.8}}


# --------------------------------------------------------------------------------------------------- server


# ------------------------------------------------------------------------------------------------- helpers


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000.0 * seconds, 3)


def _vocab_size(model_dir: str) -> int | None:
    try:
        folder = Path(model_dir)
        return int(json.loads((folder / "config.json").read_text())["vocab_size"])
    except Exception:  # unknown model (remote target, odd config): fall back to small ids
        return None


def _prompt(index: int, vocab: int | None) -> list[int]:
    """A short deterministic prompt, distinct per stream index, with ids in [1, min(vocab, 256))."""
    bound = max(2, min(vocab or 128, 256)) - 1
    return [1 + (7 + 13 * k + 31 * index + (index * k) % 17) % bound for k in range(PROMPT_LEN)]


def _request(token_ids: list[int], max_tokens: int) -> pb.GenerateRequest:
    request = pb.GenerateRequest(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request.token_ids.ids.extend(token_ids)
    return request


def _router_stats(chan: grpc.Channel) -> dict | None:
    try:
        stats = admin_pb2_grpc.AdminStub(chan).GetRouterStats(admin_pb2.RouterStatsRequest(), timeout=30)
    except grpc.RpcError:
        return None
    return {"steps": stats.steps, "max_batch_seen": stats.max_batch_seen, "replica": stats.replica,
            "live_kv_caches": stats.live_kv_caches, "active_sequences": stats.active_sequences,
            "waiting_requests": stats.waiting_requests, "stage_seconds": dict(stats.stage_seconds)}


def _actor_compute_s(chan: grpc.Channel) -> float | None:
    """The expert actors' compute seconds since they started, summed (Admin GetClusterState)."""
    try:
        state = admin_pb2_grpc.AdminStub(chan).GetClusterState(admin_pb2.ClusterStateRequest(), timeout=60)
    except grpc.RpcError:
        return None
    return sum(rep.compute_s for rep in state.replicas if rep.alive)


@dataclass
class _Stream:
    started: float
    arrivals: list[float] = field(default_factory=list)  # one per token message
    tokens: int = 0
    finished: float | None = None
    finish_reason: str | None = None
    error: str | None = None


# --------------------------------------------------------------------------------------------------- levels


async def _run_stream_async(stub: inference_pb2_grpc.InferenceStub, request: pb.GenerateRequest) -> _Stream:
    record = _Stream(started=time.perf_counter())
    try:
        async for message in stub.Generate(request, timeout=STREAM_TIMEOUT_S):
            now = time.perf_counter()
            if message.HasField("token"):
                record.arrivals.append(now)
                record.tokens += len(message.token.token_ids)
            else:
                record.finish_reason = message.done.finish_reason
    except grpc.RpcError as exc:
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        record.error = code.name if code is not None else type(exc).__name__
    except Exception as exc:  # a stream must never take the benchmark down
        record.error = type(exc).__name__
    record.finished = time.perf_counter()
    return record


async def _drive(target: str, requests: list[list[pb.GenerateRequest]]) -> tuple[list[list[_Stream]], float]:
    """All streams from one event loop and one channel: on a small machine that shares its cores with the server,
    a thread per stream would bill the client's own overhead to the server under test."""
    records: list[list[_Stream]] = [[] for _ in requests]
    async with grpc.aio.insecure_channel(target) as chan:
        stub = inference_pb2_grpc.InferenceStub(chan)
        await chan.channel_ready()

        async def worker(slot: int) -> None:
            for request in requests[slot]:
                records[slot].append(await _run_stream_async(stub, request))

        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(len(requests))))
        return records, time.perf_counter() - started


def _run_level(chan: grpc.Channel, target: str, concurrency: int, requests_per_stream: int, max_tokens: int,
               vocab: int | None) -> dict:
    requests = [[_request(_prompt(slot * requests_per_stream + j, vocab), max_tokens)
                 for j in range(requests_per_stream)] for slot in range(concurrency)]
    compute_before = _actor_compute_s(chan)
    stats_before = _router_stats(chan)
    window_started = time.perf_counter()  # the stretch the stage deltas cover, as this client sees it
    records, wall = asyncio.run(_drive(target, requests))
    window_s = time.perf_counter() - window_started
    stats_after = _router_stats(chan)
    compute_after = _actor_compute_s(chan)

    streams = [s for per_slot in records for s in per_slot]
    errors = Counter(s.error for s in streams if s.error)
    total_tokens = sum(s.tokens for s in streams)
    gaps = [b - a for s in streams for a, b in zip(s.arrivals, s.arrivals[1:])]
    ttfts = [s.arrivals[0] - s.started for s in streams if s.arrivals]
    per_stream_tps = [s.tokens / (s.finished - s.started) for s in streams
                      if not s.error and s.tokens and s.finished > s.started]
    level = {
        "concurrency": concurrency,
        "streams": len(streams),
        "completed_streams": sum(1 for s in streams if not s.error),
        "total_tokens": total_tokens,
        "expected_tokens": len(streams) * max_tokens,
        "wall_s": round(wall, 3),
        "aggregate_tokens_per_s": round(total_tokens / wall, 3) if wall > 0 else None,
        "per_stream_tokens_per_s": {
            "mean": round(sum(per_stream_tps) / len(per_stream_tps), 3) if per_stream_tps else None,
            "p50": round(percentile(per_stream_tps, 50), 3) if per_stream_tps else None,
            "min": round(min(per_stream_tps), 3) if per_stream_tps else None,
        },
        "inter_token_ms": {"p50": _ms(percentile(gaps, 50)), "p99": _ms(percentile(gaps, 99)),
                           "samples": len(gaps)},
        "ttft_ms": {"p50": _ms(percentile(ttfts, 50)), "p99": _ms(percentile(ttfts, 99))},
        "finish_reasons": dict(Counter(s.finish_reason for s in streams if s.finish_reason)),
        "errors": dict(errors),
        "router": None,
    }
    if stats_before is not None and stats_after is not None:
        steps = stats_after["steps"] - stats_before["steps"]
        same_replica = stats_before["replica"] == stats_after["replica"]
        level["router"] = {
            "steps": steps if same_replica else None,
            "tokens_per_step": round(total_tokens / steps, 3) if same_replica and steps > 0 else None,
            "max_batch_seen": stats_after["max_batch_seen"],
            "max_batch_seen_before": stats_before["max_batch_seen"],
            "replica": stats_after["replica"],
            "same_replica": same_replica,
        }
        if same_replica and steps > 0 and stats_after["stage_seconds"]:
            compute = (compute_after - compute_before
                       if compute_before is not None and compute_after is not None else None)
            level["profile"] = profile_table(stage_deltas(stats_before["stage_seconds"], stats_after["stage_seconds"]),
                                             steps, window_s, compute)
            level["profile"]["actor_compute_s"] = None if compute is None else round(compute, 4)
    return level


def _model_dir(model: str | None, tmp: Path) -> tuple[str, str | None]:
    """(name for the report, checkpoint folder): "embedded" (default), "mid" (bench dispatch's hidden-1024 Mixtral,
    written into tmp) or a folder."""
    if model in (None, "embedded"):
        from ...experts.embedded_model import EMBEDDED_MODEL_DIR

        return "embedded", str(EMBEDDED_MODEL_DIR)
    if model == "mid":
        return "mid", str(write_bench_checkpoint(tmp / "mid"))
    return model, model


@dataclass(frozen=True)
class ServeParams:
    """target: a running server (host:port), or None to start one per transport; model_dir: "embedded", "mid" or a
    checkpoint folder; reference: time the in-process transformers generate (and η_serve); chart: where to write
    the profile chart (PNG), None for none; serve_args: extra `expertmesh serve` arguments for started servers;
    reference_threads: torch threads of the transformers reference; None: torch's default (every core), what a user
    running transformers here gets. 1 is steadier on a loaded box, where a 2-thread OpenMP team spins waiting for a
    descheduled peer (14.7 then 1.6 tok/s in two runs a minute apart), but it handicaps the baseline on a quiet one."""

    target: str | None = None
    concurrencies: tuple[int, ...] = (1, 8, 32)
    max_tokens: int = 32
    requests_per_stream: int = 2
    model_dir: str | None = None
    transports: tuple[str, ...] = ("socket",)
    reference: bool = True
    chart: Path | None = None
    serve_args: tuple[str, ...] = ()
    reference_threads: int | None = None

    @classmethod
    def from_args(cls, args) -> ServeParams:
        chart = args.chart or (str(Path(args.out).with_suffix(".png")) if args.out else None)
        return cls(target=args.target, concurrencies=tuple(int(c) for c in args.concurrency.split(",")),
                   max_tokens=args.max_tokens,
                   requests_per_stream=2 if args.requests_per_stream is None else args.requests_per_stream,
                   model_dir=args.model,
                   transports=tuple(args.transports.split(",")), reference=not args.no_reference,
                   chart=Path(chart) if chart else None, serve_args=tuple(args.serve_arg),
                   reference_threads=args.reference_threads)


def run_serve_bench(params: ServeParams = ServeParams(), verbose: bool = True) -> dict:
    """Benchmark streaming generation against `target`, or against one server started here per transport; beside
    each level, the in-process `transformers` generate rate at the same batch size (reference) and
    η_serve = ours ÷ theirs, and the step profile from the router's stage clocks."""
    say = say_to_stderr(verbose)
    target, concurrencies, max_tokens = params.target, params.concurrencies, params.max_tokens
    requests_per_stream, model_dir, transports = params.requests_per_stream, params.model_dir, params.transports
    reference, chart, serve_args = params.reference, params.chart, params.serve_args
    reference_threads = params.reference_threads
    if max_tokens < 2:
        raise ValueError(f"max_tokens: need >= 2 to measure inter-token latency, got {max_tokens}")
    if requests_per_stream < 1:
        raise ValueError(f"requests_per_stream: must be >= 1, got {requests_per_stream}")
    concurrencies = [int(c) for c in concurrencies]
    if not concurrencies or min(concurrencies) < 1:
        raise ValueError(f"concurrencies: need positive integers, got {concurrencies}")
    transports = [target] if target is not None else list(transports)

    run_started = time.perf_counter()
    if reference_threads is not None:
        torch.set_num_threads(reference_threads)
    reference_threads = torch.get_num_threads()
    result: dict = {"benchmark": "serve", "model": None, "target": target, "self_started": target is None,
                    "max_tokens": max_tokens, "requests_per_stream": requests_per_stream,
                    "prompt_tokens": PROMPT_LEN, "concurrencies": concurrencies, "transports": transports,
                    "reference_threads": reference_threads, "runs": {}, "eta_serve": {}}
    with tempfile.TemporaryDirectory(prefix="expertmesh-bench-serve-") as tmp:
        if target is not None and model_dir is None:
            name, folder = None, None  # a remote server's model: no in-process reference
        else:
            say("preparing the model ...")
            name, folder = _model_dir(model_dir, Path(tmp))
        result["model"] = name
        ref = None
        if reference and folder is not None:
            say("loading the transformers reference ...")
            ref = TransformersReference(folder)
            ref.warm_up(_prompt(10_000, _vocab_size(folder)))
        engine = None
        if ref is not None:
            say("timing expertmesh's decoder in process (every expert local) ...")
            engine_ref = EngineReference(folder)
            engine_ref.warm_up(_prompt(10_000, _vocab_size(folder)))
            engine = _reference_rates(engine_ref, folder, concurrencies, max_tokens, requests_per_stream, say,
                                      label="expertmesh in process")
            del engine_ref
        before = None
        for transport in transports:
            # The reference runs with no server up (an idle server's processes still take some CPU on a small
            # box), right before it starts and right after it stops, so load that comes and goes on a shared
            # machine weighs on both sides alike; its rate per level is the two runs' tokens over their time.
            # One transport's "after" is the next one's "before".
            if ref is not None and before is None:
                before = _reference_rates(ref, folder, concurrencies, max_tokens, requests_per_stream, say)
                result["in_process_engine"] = engine_levels(engine, before)
            run = _run_transport(transport, target, folder, concurrencies, max_tokens, requests_per_stream,
                                 serve_args, say)
            if ref is not None:
                after = _reference_rates(ref, folder, concurrencies, max_tokens, requests_per_stream, say)
                add_eta(run, before, after, engine)
                before = after
                say(f"{transport}: eta_serve {run['eta_serve']}")
            result["runs"][transport] = run
            result["eta_serve"][transport] = run["eta_serve"]
            if run.get("model_name") and result["model"] is None:
                result["model"] = run["model_name"]
    first = result["runs"][transports[0]]["levels"]
    one = first.get("1", {}).get("aggregate_tokens_per_s")
    many = first.get("32", {}).get("aggregate_tokens_per_s")
    speedup = many / one if one and many is not None else None
    result["speedup_32_vs_1"] = round(speedup, 3) if speedup is not None else None
    result["goal"] = GOAL
    result["goal_met"] = bool(speedup is not None and speedup >= GOAL_SPEEDUP and not first["32"]["errors"])
    result["eta_serve_targets"] = ETA_TARGETS
    result["machine"] = machine_info(load_average=_load_average(), python=platform.python_version(),
                                     grpc=grpc.__version__)
    if chart is not None:
        bars = [(f"{t} · {c} stream{'s' if c > 1 else ''}", run["levels"][str(c)]["profile"])
                for t, run in result["runs"].items() for c in concurrencies
                if run["levels"].get(str(c), {}).get("profile")]
        if bars:
            result["chart"] = str(write_profile_chart(
                bars, chart, f"expertmesh bench serve: {result['model']}, {max_tokens} new tokens, where a step goes"))
    result["run_wall_s"] = round(time.perf_counter() - run_started, 3)
    return result


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _run_transport(transport: str, target: str | None, folder: str | None, concurrencies: list[int],
                   max_tokens: int, requests_per_stream: int, serve_args: tuple[str, ...], say) -> dict:
    """One served process (or the given target): warm-up, then every level."""
    server: ServerProcess | None = None
    run: dict = {"levels": {}, "eta_serve": {}}
    try:
        if target is None:
            say(f"starting expertmesh serve --transport {transport} ...")
            t0 = time.perf_counter()
            args = ["--transport", transport, *serve_args]
            server = start_server((["--model", folder] if folder is not None else []) + args)
            target = server.target
            run["model_name"] = server.model_name
            run["server_start_s"] = round(time.perf_counter() - t0, 3)
            run["serve_args"] = args
            say(f"serving {server.model_name} on {target} (ready after {run['server_start_s']} s)")
        vocab = _vocab_size(folder) if folder is not None else None
        chan = client.channel(target)
        try:
            grpc.channel_ready_future(chan).result(timeout=60)
            say("warm-up ...")
            warm = asyncio.run(_drive(target, [[_request(_prompt(10_000, vocab), min(4, max_tokens))]]))[0][0][0]
            run["warmup"] = {"tokens": warm.tokens, "seconds": round(warm.finished - warm.started, 3),
                             "error": warm.error}
            if warm.error:
                say(f"warm-up failed: {warm.error}")
            for c in concurrencies:
                say(f"{transport}, {c} streams: {c * requests_per_stream} streams x {max_tokens} tokens ...")
                level = _run_level(chan, target, c, requests_per_stream, max_tokens, vocab)
                run["levels"][str(c)] = level
                profile = level.get("profile")
                say(f"  {level['aggregate_tokens_per_s']} tok/s; step {profile['step_ms'] if profile else '-'} ms; "
                    f"errors {level['errors'] or 'none'}")
        finally:
            chan.close()
    finally:
        if server is not None:
            say("stopping server ...")
            run["server_exit_code"] = server.stop()
            run["server_log"] = str(server.log_path)
    return run


def _reference_rates(ref: TransformersReference | EngineReference, folder: str, concurrencies: list[int],
                     max_tokens: int, requests_per_stream: int, say, label: str = "transformers generate"
                     ) -> dict[str, dict]:
    """A reference's rate at every level, on the prompts the served level sends."""
    vocab = _vocab_size(folder)
    rates = {}
    for c in concurrencies:
        rounds = [[_prompt(slot * requests_per_stream + j, vocab) for slot in range(c)]
                  for j in range(requests_per_stream)]
        rates[str(c)] = ref.rate(rounds, max_tokens)
        say(f"  {label}, batch {c}: {rates[str(c)]['tokens_per_s']} tok/s")
    return rates
