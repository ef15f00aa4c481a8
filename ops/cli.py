"""`expertmesh` command line: serve, generate, score, bench.

Errors in what the user passed (a field out of range, a bad checkpoint, a gRPC error from the server) print one
line naming the field or the file and key, and exit with status 2; they never print a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..experts.errors import CheckpointError

DEFAULT_TARGET = "127.0.0.1:9000"


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--token-ids must be comma-separated integers, got {text!r}") from exc


def _gpu_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--failed-gpus must be comma-separated GPU indices, got {text!r}") from exc


def _autoscale(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(":"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--router-autoscale must be MIN:MAX, got {text!r}") from exc
    return low, high


def _add_local_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--local", action="store_true",
                   help="no server: route in this process on an embedded (or --address) Ray")
    p.add_argument("--model", metavar="DIR", help="with --local: checkpoint folder (default: the embedded model)")
    p.add_argument("--address", default="local", help="with --local: Ray cluster to join (default: embedded)")
    p.add_argument("--replicas-per-expert", type=int, default=1)
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="cap tokens per expert per step (default: no cap, no token is ever dropped)")


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"gRPC server (default {DEFAULT_TARGET})")
    p.add_argument("--auth-token", default=os.environ.get("EXPERTMESH_TOKEN"),
                   help="bearer token (default: $EXPERTMESH_TOKEN)")
    p.add_argument("--tls-ca", metavar="PEM", help="CA certificate to verify a TLS server")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="expertmesh", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="serve a checkpoint over gRPC until Ctrl-C / SIGTERM")
    srv.add_argument("--model", metavar="DIR", help="checkpoint folder (default: the embedded model)")
    srv.add_argument("--model-name", help="name clients use (default: folder name; expertmesh-demo if embedded)")
    srv.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: localhost only)")
    srv.add_argument("--port", type=int, default=9000, help="0 picks a free port (printed on the ready line)")
    srv.add_argument("--address", default="local", help="Ray cluster to join (default: start an embedded one)")
    srv.add_argument("--replicas-per-expert", type=int, default=1)
    srv.add_argument("--transport", choices=["refs", "grpc", "compiled"], default="refs",
                     help="how routers reach expert actors (README: Transports)")
    srv.add_argument("--overlap", action="store_true", help="split each step into two micro-batches whose expert "
                     "rounds overlap the other's dense compute (README: Transports / Overlap)")
    srv.add_argument("--router-replicas", type=int, default=1)
    srv.add_argument("--router-autoscale", type=_autoscale, metavar="MIN:MAX", help="autoscale router replicas")
    srv.add_argument("--capacity-factor", type=float, default=None)
    srv.add_argument("--max-active", type=int, default=64, help="sequences decoding together per router")
    srv.add_argument("--max-waiting", type=int, default=256, help="queued requests per router before "
                                                                   "RESOURCE_EXHAUSTED")
    srv.add_argument("--max-message-bytes", type=int, default=16 * 1024 * 1024)
    srv.add_argument("--tls-cert", metavar="PEM")
    srv.add_argument("--tls-key", metavar="PEM")
    srv.add_argument("--auth-token", default=os.environ.get("EXPERTMESH_TOKEN"),
                     help="require `authorization: Bearer TOKEN` (default: $EXPERTMESH_TOKEN, else no auth)")
    srv.add_argument("--no-replica-policy", choices=["wait", "degrade"], default="wait",
                     help="when every replica of an expert is down: hold its tokens until one is back (up to "
                          "--wait-timeout, then UNAVAILABLE), or send them to the next-best expert and count them")
    srv.add_argument("--wait-timeout", type=float, default=30.0)
    srv.add_argument("--call-timeout", type=float, default=30.0, help="an expert call slower than this is retried "
                                                                       "on another replica")
    srv.add_argument("--no-restore", action="store_true", help="do not restore lost expert actors")
    srv.add_argument("--trace", choices=["none", "console", "otlp", "file"], default="none",
                     help="OpenTelemetry traces of requests, steps, layer dispatches and expert calls (default off); "
                          "file: JSON lines at --trace-file")
    srv.add_argument("--trace-file", metavar="PATH", help="where --trace file appends spans (one JSON per line)")
    srv.add_argument("--otlp-endpoint", metavar="URL", help="OTLP gRPC collector for --trace otlp "
                                                            "(default: the exporter's, http://localhost:4317)")
    srv.add_argument("--placement", metavar="FILE", help="start from a PLACEMENT.json (`expertmesh plan`): one "
                                                         "expert actor per GPU hosting that GPU's shards")
    srv.add_argument("--elastic", action="store_true", help="rebalance replicas live from observed load "
                                                           "(README: Elasticity)")
    srv.add_argument("--slots-per-gpu", type=int, default=2, help="with --elastic: shards per GPU per MoE layer")
    srv.add_argument("--control-interval", type=float, default=10.0, help="with --elastic: seconds between "
                                                                          "control steps")
    srv.add_argument("--extra-replicas", type=float, default=0.25, help="with --elastic: replicas per layer "
                                                                        "beyond one per expert, as a fraction")
    srv.add_argument("--autoscale-target", type=float, metavar="LOAD", help="with --elastic: autoscale replicas "
                     "so each carries about LOAD routed tokens per load window")
    srv.add_argument("--max-gpus", type=int, help="with --autoscale-target: GPU budget (asks Ray's autoscaler "
                                                  "for GPUs beyond what the cluster has)")

    status = sub.add_parser("status", help="cluster state: replicas, nodes, GPUs, breakers, load, epoch, events")
    _add_client_args(status)

    gen = sub.add_parser("generate", help="generate text (streams from a server, or --local)")
    _add_local_args(gen)
    _add_client_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json)")
    src.add_argument("--token-ids", type=_token_ids, help="prompt as token ids, e.g. 1,2,3")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")

    score = sub.add_parser("score", help="logits for every position of the given token ids")
    _add_local_args(score)
    _add_client_args(score)
    score.add_argument("--token-ids", type=_token_ids, required=True)
    score.add_argument("--log-probs", action="store_true")

    bench = sub.add_parser("bench", help="benchmarks (JSON output)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    dispatch = bench_sub.add_parser("dispatch", help="distributed forward vs transformers in one process")
    dispatch.add_argument("--workload", choices=["prefill", "decode", "both"], default="both")
    dispatch.add_argument("--repeats", type=int, default=5)
    dispatch.add_argument("--transport", choices=["refs", "grpc", "compiled"], default="refs",
                          help="how expert calls travel (README: Transports)")
    dispatch.add_argument("--overlap", action="store_true", help="ping-pong two micro-batches per step")
    dispatch.add_argument("--json", action="store_true", help="print only the JSON result")
    dispatch.add_argument("--out", metavar="FILE", help="also write the JSON here")
    serve_bench = bench_sub.add_parser("serve", help="concurrent gRPC streams: tokens/s and inter-token latency")
    serve_bench.add_argument("--target", help="a running server (default: start one on the embedded model)")
    serve_bench.add_argument("--model", metavar="DIR", help="checkpoint for the self-started server")
    serve_bench.add_argument("--concurrency", default="1,8,32", help="comma-separated stream counts")
    serve_bench.add_argument("--max-tokens", type=int, default=32)
    serve_bench.add_argument("--requests-per-stream", type=int, default=2)
    serve_bench.add_argument("--json", action="store_true", help="print only the JSON result")
    serve_bench.add_argument("--out", metavar="FILE", help="also write the JSON here")
    placement_bench = bench_sub.add_parser("placement", help="placement planner vs greedy replicate-then-pack")
    placement_bench.add_argument("--seed", type=int, default=0)
    placement_bench.add_argument("--repeats", type=int, default=3, help="timing: best of this many runs")
    placement_bench.add_argument("--balance-slack", type=float, default=0.02,
                                 help="also report drift moves at this slack (0 is always reported)")
    placement_bench.add_argument("--quick", action="store_true", help="8 layers instead of 58")
    placement_bench.add_argument("--json", action="store_true", help="print only the JSON result")
    placement_bench.add_argument("--out", metavar="FILE", help="also write the JSON here")
    obs_bench = bench_sub.add_parser("observability", help="cost of load statistics and tracing per layer and step")
    obs_bench.add_argument("--sequences", type=int, default=32, help="sequences in the decode step")
    obs_bench.add_argument("--json", action="store_true", help="print only the JSON result")
    obs_bench.add_argument("--out", metavar="FILE", help="also write the JSON here")

    plan_cmd = sub.add_parser("plan", help="plan a shard placement offline from a load file (writes JSON)")
    plan_cmd.add_argument("--load", required=True, metavar="LOAD.json",
                          help='{"load": [[per expert] per MoE layer]} or the nested list alone')
    plan_cmd.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    plan_cmd.add_argument("--slots-per-gpu", type=int, required=True, help="shards per GPU per MoE layer")
    plan_cmd.add_argument("--nodes", type=int, default=1, help="nodes the GPUs split evenly over")
    plan_cmd.add_argument("--current", metavar="PLACEMENT.json", help="placement now serving: move few shards")
    plan_cmd.add_argument("--out", metavar="PLACEMENT.json", help="write the placement here (default: stdout)")
    plan_cmd.add_argument("--extra-replicas", type=int, default=None,
                          help="replicas per layer beyond one per expert (default: fill every slot)")
    plan_cmd.add_argument("--failed-gpus", type=_gpu_ids, default=[], metavar="G,G", help="GPUs to leave empty")
    plan_cmd.add_argument("--balance-slack", type=float, default=0.0,
                          help="with --current: peak may exceed greedy's by this fraction to save moves")
    plan_cmd.add_argument("--json", action="store_true", help="print the summary as JSON")

    drill = sub.add_parser("drill", help="failover drill under load: kill actors/nodes/router/controller, report")
    drill.add_argument("--kill", choices=["actor", "fraction", "node", "router", "controller"], default="actor")
    drill.add_argument("--every", type=float, default=10.0, help="seconds between kills")
    drill.add_argument("--duration", type=float, default=60.0, help="seconds of the fault phase")
    drill.add_argument("--baseline", type=float, default=15.0, help="seconds of fault-free load first")
    drill.add_argument("--concurrency", type=int, default=8, help="concurrent greedy Generate streams")
    drill.add_argument("--max-tokens", type=int, default=16)
    drill.add_argument("--replicas-per-expert", type=int, default=2)
    drill.add_argument("--no-replica-policy", choices=["wait", "degrade"], default="wait")
    drill.add_argument("--model", metavar="DIR", help="checkpoint for the self-started server (default: embedded)")
    drill.add_argument("--nodes", type=int, default=2, help="worker nodes of the self-started cluster (--kill node)")
    drill.add_argument("--fraction", type=float, default=0.25, help="share of expert actors per tick (fraction)")
    drill.add_argument("--seed", type=int, default=0)
    drill.add_argument("--target", metavar="HOST:PORT", help="attach to a running server instead of starting one")
    drill.add_argument("--address", help="with --target: its Ray cluster (needed to kill router/controller)")
    drill.add_argument("--out", metavar="DIR", default="drill_out", help="report folder (default: drill_out)")
    drill.add_argument("--json", action="store_true", help="print only the JSON report")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import grpc

    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "status":
            return _status(args)
        if args.command in ("generate", "score"):
            return _local(args) if args.local else _remote(args)
        if args.command == "bench" and args.bench == "dispatch":
            from .bench_dispatch import run_dispatch_bench

            result = run_dispatch_bench(args.workload, repeats=args.repeats, verbose=not args.json,
                                        transport=args.transport, overlap=args.overlap)
            _emit(result, args.out)
            return 0
        if args.command == "bench" and args.bench == "serve":
            from .bench_serve import run_serve_bench

            levels = tuple(int(c) for c in args.concurrency.split(","))
            result = run_serve_bench(target=args.target, concurrencies=levels, max_tokens=args.max_tokens,
                                     requests_per_stream=args.requests_per_stream, model_dir=args.model,
                                     verbose=not args.json)
            _emit(result, args.out)
            return 0
        if args.command == "bench" and args.bench == "observability":
            from .bench_observability import run_observability_bench

            _emit(run_observability_bench(sequences=args.sequences), args.out)
            return 0
        if args.command == "bench" and args.bench == "placement":
            from .bench_placement import run_placement_bench

            _emit(run_placement_bench(seed=args.seed, repeats=args.repeats, balance_slack=args.balance_slack,
                                      quick=args.quick), args.out)
            return 0
        if args.command == "plan":
            from .plan_cli import format_summary, run_plan

            placement, summary = run_plan(args.load, args.gpus, args.slots_per_gpu, args.nodes, args.current,
                                          args.out, args.extra_replicas, args.failed_gpus, args.balance_slack)
            if not args.out:
                sys.stdout.write(placement.dumps())
            report = json.dumps(summary) if args.json else format_summary(summary)
            print(report, file=sys.stdout if args.out else sys.stderr)
            return 0
        if args.command == "drill":
            from .drill import DrillConfig, run_drill

            config = DrillConfig(kill=args.kill, every=args.every, duration=args.duration, baseline=args.baseline,
                                 concurrency=args.concurrency, max_tokens=args.max_tokens, seed=args.seed,
                                 fraction=args.fraction, nodes=args.nodes, target=args.target, address=args.address,
                                 out=args.out, model_dir=args.model, replicas_per_expert=args.replicas_per_expert,
                                 no_replica_policy=args.no_replica_policy)
            result = run_drill(config, verbose=not args.json)
            summary = result.pop("summary")
            print(json.dumps(result, indent=2) if args.json else f"{summary}\nreport: {result['files']['markdown']}")
            return 0
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    except (CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1


def _emit(result: dict, out: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        with open(out, "w") as handle:
            handle.write(text + "\n")


def _elastic(args: argparse.Namespace) -> dict | None:
    """ElasticConfig fields from the serve flags (None without --elastic)."""
    if not args.elastic:
        if args.autoscale_target is not None:
            raise ValueError("autoscale_target: needs --elastic")
        return None
    config: dict = {"control_interval_s": args.control_interval, "slots_per_gpu": args.slots_per_gpu,
                    "extra_replica_fraction": args.extra_replicas}
    if args.autoscale_target is not None:
        # base_gpus: what the cluster has when serving starts (ElasticConfig fills it in).
        config["autoscale"] = {"target_load_per_replica": args.autoscale_target}
        if args.max_gpus is not None:
            config["autoscale"]["max_gpus"] = args.max_gpus
    return config


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from ..cluster.controller import ControllerConfig
    from ..experts.telemetry import TracingConfig
    from ..router_service.batching import BatcherConfig
    from ..router_service.dispatch import FailoverConfig
    from ..router_service.grpc_front import FrontSettings
    from ..router_service.server import ServeConfig, serve_forever

    config = ServeConfig(
        model_dir=args.model, address=args.address, model_name=args.model_name,
        front=FrontSettings(host=args.host, port=args.port, tls_cert=args.tls_cert, tls_key=args.tls_key,
                            auth_token=args.auth_token, max_message_bytes=args.max_message_bytes),
        replicas_per_expert=args.replicas_per_expert, router_replicas=args.router_replicas,
        router_autoscale=args.router_autoscale, capacity_factor=args.capacity_factor,
        batcher=BatcherConfig(max_active=args.max_active, max_waiting=args.max_waiting),
        failover=FailoverConfig(no_replica_policy=args.no_replica_policy, call_timeout_s=args.call_timeout,
                                wait_timeout_s=args.wait_timeout),
        controller=ControllerConfig(restore=not args.no_restore, elastic=_elastic(args)),
        tracing=TracingConfig(exporter=args.trace, endpoint=args.otlp_endpoint, path=args.trace_file),
        transport=args.transport, overlap=args.overlap, placement=args.placement,
    )
    asyncio.run(serve_forever(config))
    return 0


def _status(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from ..protos import admin_pb2, admin_pb2_grpc
    from . import client
    from .load_report import control_lines, load_lines

    chan = client.channel(args.target, args.tls_ca)
    state = admin_pb2_grpc.AdminStub(chan).GetClusterState(
        admin_pb2.ClusterStateRequest(), metadata=client.auth_metadata(args.auth_token), timeout=args.timeout or 30)
    if args.json:
        out = MessageToDict(state, preserving_proto_field_name=True)
        # The load snapshots travel as JSON strings; print them as objects.
        out["load"] = json.loads(out.pop("load_json", "null"))
        out.get("router", {})["load"] = json.loads(out.get("router", {}).pop("load_json", "null"))
        out["control"] = json.loads(out.pop("control_json", "[]"))
        print(json.dumps(out))
        return 0
    r = state.router
    print(f"model {state.model}   table epoch {state.epoch}   controller {'up' if state.controller_alive else 'DOWN'}"
          f"   no-replica policy {state.no_replica_policy}")
    print(f"router {r.replica}: {r.active_sequences} active, {r.waiting_requests} waiting, {r.live_kv_caches} KV "
          f"caches, {r.steps} steps, largest batch {r.max_batch_seen}, {r.retried_calls} retried calls, "
          f"{r.degraded_slots} degraded slots")
    for line in load_lines(json.loads(state.load_json) if state.load_json else None):
        print(line)
    for line in control_lines(json.loads(state.control_json) if state.control_json else [], state.requested_gpus):
        print(line)
    print(f"{'actor':<16}{'node':<14}{'gpu':<6}{'device':<8}{'state':<10}{'gen':>4}  {'breaker':<10}"
          f"{'calls':>8}{'tokens':>10}")
    for rep in state.replicas:
        alive = "drained" if rep.drained else "restoring" if rep.restoring else "up" if rep.alive else "DOWN"
        print(f"{rep.actor:<16}{rep.node_id[:12]:<14}{','.join(rep.gpu_ids) or '-':<6}{rep.device or '-':<8}"
              f"{alive:<10}{rep.generation:>4}  {rep.breaker:<10}{rep.calls:>8}{rep.tokens:>10}")
    for event in state.events[-10:]:
        print(f"event {event.time:.1f} {event.kind:<15} {event.actor} {event.detail_json}")
    return 0


def _remote(args: argparse.Namespace) -> int:
    from ..protos import inference_pb2 as pb
    from . import client

    chan = client.channel(args.target, args.tls_ca)
    if args.command == "score":
        resp = client.score(chan, pb.ScoreRequest(token_ids=args.token_ids, log_probs=args.log_probs),
                            args.auth_token, args.timeout)
        rows = [list(resp.values[i * resp.vocab_size:(i + 1) * resp.vocab_size]) for i in range(resp.seq_len)]
        key = "log_probs" if args.log_probs else "logits"
        print(json.dumps({"token_ids": args.token_ids, key: rows}) if args.json else
              "\n".join(f"{i}\tbest next {max(range(len(r)), key=r.__getitem__)}" for i, r in enumerate(rows)))
        return 0
    request = pb.GenerateRequest(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                 stop=args.stop)
    if args.prompt is not None:
        request.prompt = args.prompt
    else:
        request.token_ids.ids.extend(args.token_ids)
    if args.top_p is not None:
        request.top_p = args.top_p
    if args.seed is not None:
        request.seed = args.seed
    token_ids: list[int] = []
    pieces: list[str] = []
    done = None
    if not args.json and args.prompt:
        print(args.prompt, end="", flush=True)
    for message in client.generate_stream(chan, request, args.auth_token, args.timeout):
        if message.HasField("token"):
            token_ids.extend(message.token.token_ids)
            pieces.append(message.token.text)
            if not args.json:
                print(message.token.text if args.prompt else " ".join(map(str, message.token.token_ids)),
                      end="" if args.prompt else " ", flush=True)
        else:
            done = message.done
    if args.json:
        print(json.dumps({
            "token_ids": token_ids, "text": "".join(pieces),
            "finish_reason": done.finish_reason if done else None,
            "usage": {"prompt_tokens": done.usage.prompt_tokens,
                      "completion_tokens": done.usage.completion_tokens} if done else None,
        }))
    else:
        print()
    return 0


def _local(args: argparse.Namespace) -> int:
    from ..experts.tokenizer import DEFAULT_MODEL_DIR, load_tokenizer
    from ..router_service.engine import ExpertMesh, MeshConfig

    if getattr(args, "prompt", None) is not None and load_tokenizer(args.model or DEFAULT_MODEL_DIR) is None:
        print(f"error: prompt: the checkpoint at {args.model} has no tokenizer.json; use --token-ids",
              file=sys.stderr)
        return 2
    config = MeshConfig(model_dir=args.model, address=args.address, replicas_per_expert=args.replicas_per_expert,
                        capacity_factor=args.capacity_factor)
    with ExpertMesh(config) as mesh:
        if args.command == "score":
            logits = mesh.score(args.token_ids)
            if args.log_probs:
                logits = logits.log_softmax(-1)
            key = "log_probs" if args.log_probs else "logits"
            if args.json:
                print(json.dumps({"token_ids": args.token_ids, key: logits.tolist()}))
            else:
                for pos, (tok, nxt) in enumerate(zip(args.token_ids, logits.argmax(-1).tolist())):
                    print(f"{pos}\ttoken {tok}\tbest next {nxt}\tmax {float(logits[pos].max()):.4f}")
            return 0
        if args.temperature != 0 or args.top_p is not None or args.top_k or args.stop:
            print("error: --local generates greedily; sampling options and --stop need a server "
                  "(expertmesh serve)", file=sys.stderr)
            return 2
        result = mesh.generate(token_ids=args.token_ids, prompt=args.prompt, max_tokens=args.max_tokens)
        if args.json:
            print(json.dumps({"token_ids": result.token_ids, "text": result.text,
                              "finish_reason": result.finish_reason}))
        else:
            print((args.prompt or "") + (result.text if result.text is not None else str(result.token_ids)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
