"""The interleaved A/B behind docs/benchmarks/results/bench/serve_overhead/ab_*.json (issue 17, servecut):
server A (main's code: run without the worktree overlay), server B (this branch) and in-process
`transformers` `generate`, measured level by level in rounds, so a load that changes minute to minute hits all
three alike. Best and median per level.

    PYTHONPATH=<worktree>/.pkg python -m expertmesh.ops.bench.serve_ab_window <model dir or -> <out.json> [rounds]

A measurement record, not a product command: `expertmesh bench serve` is the benchmark.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from expertmesh.ops.bench import serve as b
from expertmesh.ops.bench.common import write_report
from expertmesh.ops.server_process import start_server

LEVELS = (1, 8, 32)
NEW = 32


def tf_rate(model, vocab: int | None, batch: int, threads: int) -> float:
    torch.set_num_threads(threads)
    ids = torch.tensor([b._prompt(i, vocab) for i in range(batch)])
    with torch.inference_mode():
        started = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                       do_sample=False, pad_token_id=0)
        return batch * NEW / (time.perf_counter() - started)


def serve_rate(target: str, vocab: int | None, streams: int, seed: int) -> tuple[float, list, float]:
    requests = [[b._request(b._prompt(1000 * seed + i, vocab), NEW)] for i in range(streams)]
    records, wall = asyncio.run(b._drive(target, requests))
    streams_done = [s for per_slot in records for s in per_slot]
    gaps = sorted(y - x for s in streams_done for x, y in zip(s.arrivals, s.arrivals[1:]))
    return (sum(s.tokens for s in streams_done) / wall, [s.error for s in streams_done if s.error],
            gaps[len(gaps) // 2] * 1000)


def main() -> None:
    from transformers import AutoModelForCausalLM

    from expertmesh.experts.embedded_model import EMBEDDED_MODEL_DIR

    model_dir = None if sys.argv[1] == "-" else sys.argv[1]
    out_path, rounds = Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 3
    args = ["--model", model_dir] if model_dir else []
    main_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    vocab = b._vocab_size(model_dir)
    servers = {"before": start_server(args, env=main_env), "after": start_server(args)}
    tf = AutoModelForCausalLM.from_pretrained(model_dir or str(EMBEDDED_MODEL_DIR), dtype=torch.float32).eval()
    result: dict = {"model": model_dir or "embedded", "rounds": rounds, "levels": {}}
    keys = ("transformers_1t", "transformers_2t", "before", "after", "before_itl", "after_itl")
    try:
        for server in servers.values():
            serve_rate(server.target, vocab, 2, 99)  # warm-up
        tf_rate(tf, vocab, 1, 1)
        raw = {level: {k: [] for k in (*keys, "errors")} for level in LEVELS}
        for r in range(rounds):
            for level in LEVELS:
                d = raw[level]
                d["transformers_1t"].append(tf_rate(tf, vocab, level, 1))
                d["transformers_2t"].append(tf_rate(tf, vocab, level, 2))
                for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    rate, errors, itl = serve_rate(servers[name].target, vocab, level, r)
                    d[name].append(rate)
                    d[name + "_itl"].append(itl)
                    d["errors"] += errors
                print(r, level, {k: round(d[k][-1], 1) for k in keys}, flush=True)
        for level in LEVELS:
            d = raw[level]
            tf_best = max(d["transformers_1t"] + d["transformers_2t"])
            tf_median = max(statistics.median(d["transformers_1t"]), statistics.median(d["transformers_2t"]))
            med = {name: statistics.median(d[name]) for name in ("before", "after")}
            result["levels"][str(level)] = {
                "transformers_best": round(tf_best, 1), "transformers_median": round(tf_median, 1),
                "before_best": round(max(d["before"]), 1), "after_best": round(max(d["after"]), 1),
                "before_median": round(med["before"], 1), "after_median": round(med["after"], 1),
                "eta_before_best": round(max(d["before"]) / tf_best, 3),
                "eta_after_best": round(max(d["after"]) / tf_best, 3),
                "eta_before_median": round(med["before"] / tf_median, 3),
                "eta_after_median": round(med["after"] / tf_median, 3),
                "itl_p50_ms_median": {n: round(statistics.median(d[n + "_itl"]), 2) for n in ("before", "after")},
                "errors": d["errors"], "raw": {k: [round(x, 2) for x in d[k]] for k in keys}}
    finally:
        result["server_exit"] = {name: server.stop() for name, server in servers.items()}
        result["load"] = os.getloadavg()
        write_report(result, out_path, echo=False, indent=1)


if __name__ == "__main__":
    main()
