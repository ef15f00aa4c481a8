"""`expertmesh score`: logits (or log-probabilities) for every position of the given token ids."""

from __future__ import annotations

import argparse
import json

from .client_flags import add_client_flags, add_local_flag, token_ids


def add_parser(sub) -> None:
    p = sub.add_parser("score", help="logits for every position of the given token ids")
    add_local_flag(p)
    add_client_flags(p)
    p.add_argument("--token-ids", type=token_ids, required=True)
    p.add_argument("--log-probs", action="store_true")


def run(args: argparse.Namespace) -> int:
    key = "log_probs" if args.log_probs else "logits"
    if args.local:
        from .mesh_flags import mesh_config_from_args

        config = mesh_config_from_args(args)  # checked before the data plane (torch, Ray) is imported
        from ...router_service.mesh import ExpertMesh

        with ExpertMesh(config) as mesh:
            logits = mesh.score(args.token_ids)
        if args.log_probs:
            logits = logits.log_softmax(-1)
        if args.json:
            print(json.dumps({"token_ids": args.token_ids, key: logits.tolist()}))
        else:
            for pos, (tok, nxt) in enumerate(zip(args.token_ids, logits.argmax(-1).tolist())):
                print(f"{pos}\ttoken {tok}\tbest next {nxt}\tmax {float(logits[pos].max()):.4f}")
        return 0

    from ...protos import inference_pb2 as pb
    from .. import client

    chan = client.channel(args.target, args.tls_ca)
    # --model-name: which model, on a front serving several (`expertmesh front`); else the server's one
    request = pb.ScoreRequest(token_ids=args.token_ids, log_probs=args.log_probs,
                              model=vars(args).get("model.name") or "")
    resp = client.score(chan, request, args.client_token, args.timeout)
    rows = [list(resp.values[i * resp.vocab_size:(i + 1) * resp.vocab_size]) for i in range(resp.seq_len)]
    print(json.dumps({"token_ids": args.token_ids, key: rows}) if args.json else
          "\n".join(f"{i}\tbest next {max(range(len(r)), key=r.__getitem__)}" for i, r in enumerate(rows)))
    return 0
