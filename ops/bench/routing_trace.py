"""Recording a routing trace of the embedded model over the held-out text, for the offload policy simulators
(experts/eviction_sim.py, router_service/affinity_sim.py) and their tests.

Each sequence is the start of a different held-out file (different modules of the standard library: different
"topics"), scored in one in-process forward (teacher forcing gives a causal model the routing decode would give the
same tokens). Per sequence, per token, per MoE layer: the experts the layer's router picked, and the next MoE layer's
gate applied to this layer's expert input (what `experts.prefetch: gate` predicts) as its top-4 experts with their
softmax probabilities, for confidence thresholds.

`python -m expertmesh.ops.bench.routing_trace OUT.json [--sequences N --tokens T]` writes it; the committed one is
docs/benchmarks/results/offload/routing-trace.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

PREDICTED_TOP = 4  # predicted experts kept per token (with probabilities)
# The committed trace (the repository's docs; tests and `bench offload` read it).
ROUTING_TRACE = Path(__file__).resolve().parents[2] / "docs/benchmarks/results/offload/routing-trace.json"


def record_routing_trace(sequences: int = 16, tokens: int = 48, model_dir: str | None = None) -> dict:
    from ...experts.embedded_model import EMBEDDED_MODEL_DIR
    from ...experts.reference import load_reference_model
    from ...experts.tokenizer import load_tokenizer
    from ..train.corpus import load_held_out

    model_dir = model_dir or EMBEDDED_MODEL_DIR
    model = load_reference_model(model_dir, torch.float32)
    tok = load_tokenizer(Path(model_dir))
    texts = [t for t in load_held_out()[0] if len(tok.encode(t).ids) >= tokens][:sequences]
    if len(texts) < sequences:
        raise ValueError(f"routing trace: only {len(texts)} held-out files have {tokens} tokens")
    ids = [torch.tensor(tok.encode(t).ids[:tokens]) for t in texts]
    layers = list(model.cfg.moe_layers)
    next_of = dict(zip(layers, layers[1:]))
    picked: dict[int, torch.Tensor] = {}  # layer -> experts [T, k]
    predicted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (experts, probs) [T, 4] of next layer

    run = model.experts.run

    def recording_run(layer: int, hidden: torch.Tensor, routing):
        picked[layer] = routing.experts.clone()
        if layer in next_of:
            nxt = model.w.layers[next_of[layer]]
            probs = torch.softmax(model._gate_logits(nxt, hidden).float(), dim=-1)  # [T, E]
            top = probs.topk(PREDICTED_TOP, dim=-1)
            predicted[layer] = (top.indices, top.values)
        return run(layer, hidden, routing)

    model.experts.run = recording_run
    with torch.no_grad():
        model.forward(ids, logits="none")
    bounds = [0]
    for t in ids:
        bounds.append(bounds[-1] + len(t))
    seqs = []
    for s in range(len(ids)):
        lo, hi = bounds[s], bounds[s + 1]
        steps = []
        for t in range(lo, hi):
            step = {"experts": [picked[layer][t].tolist() for layer in layers]}
            step["next_pred"] = [[[int(e), round(float(p), 3)] for e, p in zip(*(x[t] for x in predicted[layer]))]
                                 for layer in layers if layer in predicted]
            steps.append(step)
        seqs.append({"tokens": steps})
    cfg = model.cfg
    return {"model": "embedded", "layers": layers, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
            "tokens_per_sequence": tokens, "source": "ops/train/corpus.py held-out files, one per sequence",
            "sequences": seqs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args(argv)
    trace = record_routing_trace(args.sequences, args.tokens)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(trace, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
