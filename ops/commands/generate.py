"""`expertmesh generate`: stream text from a server, or with --local route in this process (greedy only)."""

from __future__ import annotations

import argparse
import json
import sys

from .client_flags import add_client_flags, add_local_flag, token_ids


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text (streams from a server, or --local)")
    add_local_flag(p)
    add_client_flags(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json)")
    src.add_argument("--token-ids", type=token_ids, help="prompt as token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def run(args: argparse.Namespace) -> int:
    return run_local(args) if args.local else run_remote(args)


def run_remote(args: argparse.Namespace) -> int:
    from ...protos import inference_pb2 as pb
    from .. import client

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
    if vars(args).get("model.name"):  # --model-name: which model, on a front serving several (`expertmesh front`)
        request.model = vars(args)["model.name"]
    token_ids: list[int] = []
    pieces: list[str] = []
    done = None
    if not args.json and args.prompt:
        print(args.prompt, end="", flush=True)
    chan = client.channel(args.target, args.tls_ca)
    for message in client.generate_stream(chan, request, args.client_token, args.timeout):
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


def run_local(args: argparse.Namespace) -> int:
    from .mesh_flags import mesh_config_from_args

    config = mesh_config_from_args(args)  # checked before the data plane (torch, Ray) is imported
    from ...experts.tokenizer import load_tokenizer
    from ...router_service.mesh import ExpertMesh

    if args.prompt is not None and load_tokenizer(config.model.resolved_path) is None:
        print(f"error: prompt: the checkpoint at {config.model.resolved_path} has no tokenizer.json; use --token-ids",
              file=sys.stderr)
        return 2
    if args.temperature != 0 or args.top_p is not None or args.top_k or args.stop:
        print("error: --local generates greedily; sampling options and --stop need a server (expertmesh serve)",
              file=sys.stderr)
        return 2
    with ExpertMesh(config) as mesh:
        result = mesh.generate(token_ids=args.token_ids, prompt=args.prompt, max_tokens=args.max_tokens)
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": result.text, "finish_reason": result.finish_reason}))
    else:
        print((args.prompt or "") + (result.text if result.text is not None else str(result.token_ids)))
    return 0
