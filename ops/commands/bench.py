"""`expertmesh bench dispatch|dispatch-overhead|serve|placement|observability|chunked|prefix|offload|quant|shed|
grouped-ffn|fleet`: benchmarks, each printing one JSON object.

Each benchmark is one module of ops/bench/ with a parameters dataclass (`from_args` maps this command's flags onto
it) and an entry function taking it; BENCHMARKS names them, so adding a benchmark is a module, a parser and a row.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass

from .mesh_flags import add_mesh_flags, mesh_config_from_args


@dataclass(frozen=True)
class Benchmark:
    module: str  # under expertmesh.ops.bench
    entry: str  # entry(params, [verbose=...], [config=...]) -> dict
    params: str  # the module's parameters dataclass, built with .from_args(args)
    verbose: bool = True  # the entry reports progress on stderr unless --json
    config: bool = False  # the entry takes the mesh's configuration (this command's mesh flags)


BENCHMARKS: dict[str, Benchmark] = {
    "dispatch": Benchmark("dispatch", "run_dispatch_bench", "DispatchParams", config=True),
    "dispatch --context": Benchmark("context", "run_context_bench", "ContextParams", config=True),
    "dispatch-overhead": Benchmark("dispatch_overhead", "run_overhead_bench", "OverheadParams", verbose=False),
    "serve": Benchmark("serve", "run_serve_bench", "ServeParams"),
    "serve --peer": Benchmark("peer", "run_peer_bench", "PeerParams"),
    "placement": Benchmark("placement", "run_placement_bench", "PlacementParams", verbose=False),
    "chunked": Benchmark("chunked", "run_chunked_bench", "ChunkedParams"),
    "prefix": Benchmark("prefix", "run_prefix_bench", "PrefixParams"),
    "offload": Benchmark("offload", "run_offload_bench", "OffloadParams", config=True),
    "quant": Benchmark("quant", "run_quant_bench", "QuantParams"),
    "shed": Benchmark("shed", "run_shed_bench", "ShedParams"),
    "observability": Benchmark("observability", "run_observability_bench", "ObservabilityParams", verbose=False),
    "grouped-ffn": Benchmark("grouped_ffn", "run_grouped_ffn_bench", "GroupedFFNParams", verbose=False),
    "fleet": Benchmark("fleet", "run_fleet_bench", "FleetParams"),
}


def _output_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument("--out", metavar="FILE", help="also write the JSON here")


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (JSON output)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    dispatch = bench_sub.add_parser("dispatch", help="distributed forward vs transformers in one process")
    dispatch.add_argument("--workload", choices=["prefill", "decode", "both"], default="both")
    dispatch.add_argument("--repeats", type=int, default=5)
    dispatch.add_argument("--shape", choices=["mixtral", "qwen3-30b-a3b", "deepseek-v3"], default="mixtral",
                          help="benchmark model: Mixtral-like (8 experts, top-2) or a many-expert one (top-8)")
    dispatch.add_argument("--context", type=int, metavar="N", help="decode at N tokens of context over the paged KV "
                          "cache, against transformers with a static cache (ops/bench/context.py)")
    dispatch.add_argument("--streams", type=int, default=8, help="with --context: sequences decoding together")
    dispatch.add_argument("--decode-sequences", type=int, default=32, metavar="N",
                          help="sequences in the decode workload (64 tokens of context each); the cost model's CPU fit "
                          "takes two runs, at 32 and 8 (docs/concepts/cost-model.md)")
    # The mesh's settings (transport, overlap, failover, ...); the benchmark supplies its own checkpoint.
    add_mesh_flags(dispatch, ("ray", "experts", "router", "devices", "failover", "controller", "tracing"),
                   extra=("model.dtype",))
    _output_flags(dispatch)
    overhead = bench_sub.add_parser("dispatch-overhead",
                                    help="the router's own per-layer cost (plan, marshal, combine), before/after")
    overhead.add_argument("--tokens", type=int, default=64)
    overhead.add_argument("--hidden", type=int, default=1024)
    overhead.add_argument("--repeats", type=int, default=300)
    _output_flags(overhead)
    serve_bench = bench_sub.add_parser("serve", help="concurrent gRPC streams: tokens/s and inter-token latency")
    serve_bench.add_argument("--target", help="a running server (default: start one per transport)")
    serve_bench.add_argument("--model", metavar="embedded|mid|DIR",
                             help="embedded (the bundled model; the default), mid (bench dispatch's hidden-1024 "
                                  "Mixtral) or a checkpoint folder; with --target, the server's, for the reference")
    serve_bench.add_argument("--transports", default="socket", help="comma-separated: refs,grpc,socket,compiled; one "
                             "fresh server each (default: socket, what `auto` picks on the embedded Ray it starts)")
    serve_bench.add_argument("--concurrency", default="1,8,32", help="comma-separated stream counts")
    serve_bench.add_argument("--max-tokens", type=int, default=32)
    serve_bench.add_argument("--requests-per-stream", type=int, default=None,
                             help="requests each stream sends in turn (default 2; with --peer 1)")
    serve_bench.add_argument("--no-reference", action="store_true",
                             help="skip the in-process transformers generate rate (and eta_serve)")
    serve_bench.add_argument("--reference-threads", type=int, default=None,
                             help="torch threads of the transformers reference (default: torch's, every core; "
                                  "1 is steadier on a loaded box)")
    serve_bench.add_argument("--chart", metavar="PNG", help="profile chart (default: next to --out, same name)")
    serve_bench.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                             help="extra `expertmesh serve` argument for the started servers (repeatable), e.g. "
                                  "--serve-arg=--overlap")
    peer = serve_bench.add_argument_group("--peer: against `transformers serve` on the same checkpoint "
                                          "(ops/bench/peer.py)")
    peer.add_argument("--peer", action="store_true",
                      help="also start `transformers serve --continuous-batching` on the same checkpoint and drive "
                           "both over OpenAI /v1/completions with one client, in alternating rounds")
    peer.add_argument("--rounds", type=int, default=3, help="alternating rounds (both servers at every level)")
    peer.add_argument("--workloads", default="distinct,shared",
                      help="comma-separated: distinct (own short prompts, non-streamed), shared (a long shared "
                           "system prompt + short suffixes, streamed: time to first token), long (as shared in "
                           "length, every prompt unseen)")
    peer.add_argument("--prompt-tokens", type=int, default=16, help="the distinct workload's prompt tokens")
    peer.add_argument("--system-tokens", type=int, default=400, help="the shared system prompt's tokens")
    peer.add_argument("--suffix-tokens", type=int, default=16, help="each shared-workload request's own tokens")
    peer.add_argument("--peer-arg", action="append", default=[], metavar="ARG",
                      help="extra `transformers serve` argument (repeatable), e.g. --peer-arg=--cb-num-blocks=130")
    _output_flags(serve_bench)
    placement_bench = bench_sub.add_parser("placement", help="placement planner vs greedy replicate-then-pack")
    placement_bench.add_argument("--seed", type=int, default=0)
    placement_bench.add_argument("--repeats", type=int, default=3, help="timing: best of this many runs")
    placement_bench.add_argument("--balance-slack", type=float, default=0.02,
                                 help="also report drift moves at this slack (0 is always reported)")
    placement_bench.add_argument("--quick", action="store_true", help="8 layers instead of 58")
    _output_flags(placement_bench)
    chunked = bench_sub.add_parser("chunked", help="inter-token latency of running streams while a long prompt "
                                   "is prefilled, chunked and not (in process)")
    chunked.add_argument("--prompt-tokens", type=int, default=4096)
    chunked.add_argument("--streams", type=int, default=8)
    chunked.add_argument("--chunks", default="64,256", help="comma-separated max_prefill_tokens to try")
    _output_flags(chunked)
    prefix = bench_sub.add_parser("prefix", help="time to first token with a cached system prompt vs an unseen "
                                  "prompt of the same length (prefix caching, in process)")
    prefix.add_argument("--system-tokens", type=int, default=384, help="the shared system prompt's tokens")
    prefix.add_argument("--user-tokens", type=int, default=16, help="each request's own tokens after it")
    prefix.add_argument("--rounds", type=int, default=9, help="alternating rounds (warm, unseen, cache off)")
    prefix.add_argument("--model", metavar="DIR", help="checkpoint folder (default: the embedded model)")
    prefix.add_argument("--threads", type=int, help="torch threads (default: every core; 1 is steadier on a busy "
                        "machine)")
    _output_flags(prefix)
    offload = bench_sub.add_parser("offload", help="part of the experts resident (memory tiers), with and without "
                                   "prefetch, against all-resident in the same run")
    offload.add_argument("--residency", default="1,0.5,0.25", help="comma-separated shares of each actor's shards "
                         "kept resident (1: no budget, the baseline)")
    offload.add_argument("--prefetch-modes", default="off,gate", help="comma-separated prefetch modes per level; "
                         "gate:C hints only experts some token gives probability ≥ C (experts.prefetch_min_confidence)")
    offload.add_argument("--evictions", default="layer-cycle", help="comma-separated experts.eviction orders, one "
                         "mesh each per offloaded level (all four are also replayed on the recorded routing trace)")
    offload.add_argument("--layers", type=int, default=4, help="layers of the benchmark model")
    offload.add_argument("--decode-sequences", type=int, default=16, metavar="B", help="sequences decoded together "
                         "in the timed decode (16 calls every expert at every layer; 1 is a single stream, which "
                         "calls top-k of them)")
    offload.add_argument("--decode-steps", type=int, default=10, metavar="N", help="timed decode steps per run "
                         "(the table reports the best one)")
    offload.add_argument("--affinity-requests", type=int, default=16, metavar="N", help="FIFO vs expert-affinity "
                         "admission on a mixed-topic burst of N requests in the first offloaded mesh (0: skip)")
    offload.add_argument("--affinity-topics", type=int, default=2, metavar="N", help="topics the affinity burst's "
                         "requests cycle through (each routes to 1/N of the experts; N must divide the experts)")
    offload.add_argument("--governor-steps", type=int, default=128, metavar="N", help="a long decode of N steps on "
                         "demand, with gate prefetch and with gate prefetch under its governor "
                         "(experts.prefetch_governor_hold_steps), in the first offloaded mesh (0: skip)")
    offload.add_argument("--governor-rounds", type=int, default=2, metavar="N", help="rounds of that decode, the "
                         "three modes alternating")
    offload.add_argument("--quant", default="none,int8,int4",
                         help="comma-separated expert quantisation modes (experts.quant), each against its own "
                         "all-resident run")
    offload.add_argument("--no-perplexity", action="store_true",
                         help="skip the embedded model's held-out perplexity per mode, resident and offloaded")
    add_mesh_flags(offload, ("ray", "router"))
    _output_flags(offload)
    quant = bench_sub.add_parser("quant", help="quantised experts (experts.quant) per mode: held-out perplexity, "
                                 "max |Δlogit|, expert bytes, decode/prefill expert-compute time (in process)")
    quant.add_argument("--model", metavar="DIR", help="checkpoint with a tokenizer (default: the embedded model)")
    quant.add_argument("--tokens", type=int, default=8192, help="held-out tokens scored per mode")
    quant.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                       help="serving dtype of the dense model, the activations and mode none")
    quant.add_argument("--repeats", type=int, default=5, help="timing: best of this many")
    quant.add_argument("--threads", type=int, default=1, help="torch threads (one expert actor's CPUs)")
    _output_flags(quant)
    shed = bench_sub.add_parser("shed", help="overload shedding off vs on with one expert made hot: p99 inter-token "
                                "latency, tokens/s, shed tokens, perplexity cost (ops/bench/shed.py)")
    shed.add_argument("--streams", type=int, default=24)
    shed.add_argument("--max-tokens", type=int, default=64)
    shed.add_argument("--gate-bias", type=float, default=4.0, help="added to the hot expert's gate logit")
    shed.add_argument("--per-token-ms", type=float, default=2.0, help="modelled replica time per token slot")
    shed.add_argument("--call-ms", type=float, default=1.0, help="modelled replica time per call")
    shed.add_argument("--capacity", type=int, default=8, help="shedding: token slots per replica per round")
    shed.add_argument("--window-s", type=float, default=1.0, help="shedding: on and off windows")
    shed.add_argument("--max-share", type=float, default=0.5)
    shed.add_argument("--ppl-tokens", type=int, default=1024, help="held-out tokens scored for perplexity")
    shed.add_argument("--rounds", type=int, default=5, help="off/on pairs, alternated")
    _output_flags(shed)
    obs_bench = bench_sub.add_parser("observability", help="cost of load statistics and tracing per layer and step")
    obs_bench.add_argument("--sequences", type=int, default=32, help="sequences in the decode step")
    _output_flags(obs_bench)
    grouped = bench_sub.add_parser("grouped-ffn", help="a call's experts computed per expert, with grouped_mm and "
                                   "with bmm: time and bit-identity (in process)")
    grouped.add_argument("--hidden", type=int, default=256)
    grouped.add_argument("--inter", type=int, default=96)
    grouped.add_argument("--repeats", type=int, default=7)
    grouped.add_argument("--threads", type=int, default=1, help="torch threads (one expert actor's CPUs)")
    _output_flags(grouped)
    fleet = bench_sub.add_parser("fleet", help="fleet simulator: DeepSeek-V3-sized deployments under published failure "
                                 "rates, strategies none/restart/replan and spares (cluster/fleet_sim.py)")
    fleet.add_argument("--gpus", type=int, default=512, help="serving GPUs (whole servers of 8)")
    fleet.add_argument("--days", type=float, default=30.0, help="simulated days")
    fleet.add_argument("--strategies", default="none,restart,replan", help="comma-separated: none,restart,replan")
    fleet.add_argument("--spares", default="0,1", help="comma-separated spare servers (8 GPUs each)")
    fleet.add_argument("--scales", default="1,10", help="comma-separated multiples of the published failure rates")
    fleet.add_argument("--sim-layers", type=int, default=8, help="MoE layers simulated (of 58)")
    fleet.add_argument("--seed", type=int, default=0)
    fleet.add_argument("--chart", metavar="PNG", help="also draw the chart here")
    _output_flags(fleet)


def run(args: argparse.Namespace) -> int:
    from ..bench.common import write_report

    name = args.bench
    if args.bench == "dispatch" and args.context is not None:
        name = "dispatch --context"
    elif args.bench == "serve" and args.peer:
        name = "serve --peer"
    bench = BENCHMARKS[name]
    module = importlib.import_module(f"{__package__.rpartition('.')[0]}.bench.{bench.module}")
    kwargs: dict = {}
    if bench.verbose:
        kwargs["verbose"] = not args.json
    if bench.config:
        kwargs["config"] = mesh_config_from_args(args)
    result = getattr(module, bench.entry)(getattr(module, bench.params).from_args(args), **kwargs)
    write_report(result, args.out)
    return 0
