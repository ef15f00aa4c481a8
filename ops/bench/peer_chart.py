"""The chart of `expertmesh bench serve --peer`: per workload, tokens/s of expertmesh and of `transformers serve`
at each concurrency (bar: the median over rounds; whiskers: the range), and for streamed workloads the time to
first token. `python -m expertmesh.ops.bench.peer_chart RESULT.json [OUT.png]` redraws it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLOURS = {"expertmesh": "#3182bd", "peer": "#e6550d"}
LABELS = {"expertmesh": "expertmesh", "peer": "transformers serve"}


def write_peer_chart(result: dict, path: Path) -> Path:
    """One row per workload: tokens/s on the left; time to first token (log scale) on the right where measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    fig, axes = plt.subplots(len(summary), 2, figsize=(11, 3.6 * len(summary)), squeeze=False)
    for row, (workload, levels) in zip(axes, summary.items()):
        streamed = any(e["expertmesh"]["ttft_p50_ms"]["median"] is not None for e in levels.values())
        _panel(row[0], workload, levels, "tokens_per_s", "tokens/s (completion)")
        if streamed:
            _panel(row[1], workload, levels, "ttft_p50_ms", "time to first token, p50 (ms)")
            row[1].set_yscale("log")
        else:
            row[1].axis("off")
    fig.suptitle(f"expertmesh vs transformers serve: {result.get('model')}, {result.get('max_tokens')} tokens, "
                 f"median of {result.get('rounds')} alternating rounds, whiskers: range (below: expertmesh / peer)",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _panel(ax, workload: str, levels: dict, metric: str, ylabel: str) -> None:
    concurrencies = sorted(levels, key=int)
    for i, server in enumerate(("expertmesh", "peer")):
        stats = [levels[c][server][metric] for c in concurrencies]
        med = [s["median"] or 0.0 for s in stats]
        low = [m - (s["min"] if s["min"] is not None else m) for m, s in zip(med, stats)]
        high = [(s["max"] if s["max"] is not None else m) - m for m, s in zip(med, stats)]
        xs = [k + (i - 0.5) * 0.38 for k in range(len(concurrencies))]
        ax.bar(xs, med, 0.38, yerr=[low, high], capsize=3, color=COLOURS[server], label=LABELS[server])
    ratio_key = "tokens_per_s" if metric == "tokens_per_s" else "ttft"
    labels = []
    for c in concurrencies:
        ratio = levels[c]["ratio"][ratio_key]
        labels.append(f"{c} client{'s' if int(c) > 1 else ''}" + (f"\n{ratio:.2f}x" if ratio is not None else ""))
    ax.set_xticks(range(len(concurrencies)), labels)
    ax.set_ylabel(ylabel)
    what = "tokens/s (higher is better)" if metric == "tokens_per_s" else "TTFT (lower is better)"
    ax.set_title(f"{workload}: {what}", fontsize=10)
    ax.legend(fontsize=8)


if __name__ == "__main__":
    result_path = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else result_path.with_suffix(".png")
    print(write_peer_chart(json.loads(result_path.read_text()), out))
