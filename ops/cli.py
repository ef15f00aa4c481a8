"""`expertmesh` command line: generate, score and bench on the data plane.

Errors in what the user passed (a field out of range, a bad checkpoint) print one line naming the field or the
file and key, and exit with status 2; they never print a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..experts.errors import CheckpointError


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--token-ids must be comma-separated integers, got {text!r}") from exc


def _add_mesh_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--local", action="store_true", help="run in this process on an embedded (or --address) Ray")
    p.add_argument("--model", metavar="DIR", help="Hugging Face checkpoint folder (default: the embedded model)")
    p.add_argument("--address", default="local", help="Ray cluster to join (default: start an embedded one)")
    p.add_argument("--replicas-per-expert", type=int, default=1)
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="cap tokens per expert per step (default: no cap, no token is ever dropped)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="expertmesh", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="greedy generation")
    _add_mesh_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json)")
    src.add_argument("--token-ids", type=_token_ids, help="prompt as token ids, e.g. 1,2,3")
    gen.add_argument("--max-tokens", type=int, default=32)

    score = sub.add_parser("score", help="logits for every position of the given token ids")
    _add_mesh_args(score)
    score.add_argument("--token-ids", type=_token_ids, required=True)

    bench = sub.add_parser("bench", help="benchmarks (JSON output)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    dispatch = bench_sub.add_parser("dispatch", help="distributed forward vs transformers in one process")
    dispatch.add_argument("--workload", choices=["prefill", "decode", "both"], default="both")
    dispatch.add_argument("--repeats", type=int, default=5)
    dispatch.add_argument("--json", action="store_true", help="print only the JSON result")
    dispatch.add_argument("--out", metavar="FILE", help="also write the JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("generate", "score"):
            return _run_mesh_command(args)
        if args.command == "bench" and args.bench == "dispatch":
            from .bench_dispatch import run_dispatch_bench

            result = run_dispatch_bench(args.workload, repeats=args.repeats, verbose=not args.json)
            text = json.dumps(result, indent=2)
            print(text)
            if args.out:
                with open(args.out, "w") as handle:
                    handle.write(text + "\n")
            return 0
    except (CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1


def _run_mesh_command(args: argparse.Namespace) -> int:
    if not args.local:
        print("error: --local is required: this version runs the router in the calling process "
              "(the gRPC client mode arrives with `expertmesh serve`)", file=sys.stderr)
        return 2
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
            if args.json:
                print(json.dumps({"token_ids": args.token_ids, "logits": logits.tolist()}))
            else:
                top = logits.argmax(-1).tolist()
                for pos, (tok, nxt) in enumerate(zip(args.token_ids, top)):
                    print(f"{pos}\ttoken {tok}\tbest next {nxt}\tmax logit {float(logits[pos].max()):.4f}")
            return 0
        result = mesh.generate(token_ids=args.token_ids, prompt=args.prompt, max_tokens=args.max_tokens)
        if args.json:
            print(json.dumps({"token_ids": result.token_ids, "text": result.text,
                              "finish_reason": result.finish_reason}))
        else:
            print((args.prompt or "") + (result.text if result.text is not None else str(result.token_ids)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
