"""The step-profile chart of `expertmesh bench serve`: one stacked bar per (transport, stream count), ms per step
split by stage (ops/bench/serve_profile.py rows), so the biggest stage is the one to cut first."""

from __future__ import annotations

from pathlib import Path

from .serve_profile import ROWS

# Stages grouped by colour family: router-side CPU (blues), the expert round (oranges/reds), per-token work
# (greens), waiting (greys).
COLOURS = {
    "waiting for requests": "#d9d9d9", "scheduling": "#9ecae1", "dense": "#3182bd", "gating": "#6baed6",
    "dispatch planning": "#fdd0a2", "transport send": "#fdae6b", "experts' compute": "#e6550d",
    "transport wait": "#a63603", "combine": "#fd8d3c", "dispatch bookkeeping": "#fee6ce", "lm_head": "#08519c",
    "routing statistics": "#c6dbef", "event-loop hand-back": "#756bb1", "sampling": "#74c476",
    "detokenising": "#31a354", "streaming": "#006d2c", "loop other": "#bcbddc", "unaccounted": "#969696",
}


def write_profile_chart(bars: list[tuple[str, dict]], path: Path, title: str) -> Path:
    """bars: (label, profile_table result) in display order -> a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [name for name, _ in ROWS] + ["unaccounted"]
    fig, ax = plt.subplots(figsize=(11, max(3.6, 1.0 + 0.45 * len(bars))))
    labels = [label for label, _ in bars]
    left = [0.0] * len(bars)
    for stage in stages:
        widths = []
        for _, table in bars:
            ms = next((r["ms"] for r in table["rows"] if r["stage"] == stage), 0.0)
            widths.append(max(0.0, ms))
        if not any(widths):
            continue
        ax.barh(labels, widths, left=left, color=COLOURS.get(stage, "#cccccc"), label=stage, edgecolor="white",
                linewidth=0.4)
        left = [a + b for a, b in zip(left, widths)]
    for y, (_, table) in enumerate(bars):  # the client-measured step; the stack ends there unless clocks overran
        ax.plot([table["step_ms"]] * 2, [y - 0.4, y + 0.4], color="black", linewidth=1)
        ax.text(max(left[y], table["step_ms"]), y, f" {table['step_ms']:.1f} ms", va="center", fontsize=8)
    ax.set_xlim(0, 1.12 * max([*left, *(t["step_ms"] for _, t in bars)]))  # room for the labels
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds per forward step")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def chart_from_result(result_path: Path, chart_path: Path | None = None) -> Path:
    """Redraw the chart of a saved `bench serve` JSON (default: next to it, same name, .png)."""
    import json

    result = json.loads(result_path.read_text())
    bars = [(f"{t} · {c} stream{'s' if int(c) > 1 else ''}", level["profile"])
            for t, run in result["runs"].items() for c, level in run["levels"].items() if level.get("profile")]
    title = f"expertmesh bench serve: {result['model']}, {result['max_tokens']} new tokens, where a step goes"
    return write_profile_chart(bars, chart_path or result_path.with_suffix(".png"), title)


if __name__ == "__main__":  # python -m expertmesh.ops.bench.serve_chart RESULT.json [CHART.png]
    import sys

    print(chart_from_result(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None))
