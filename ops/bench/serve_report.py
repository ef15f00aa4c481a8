"""How `expertmesh bench serve` turns measured rates into its report (pure: no server, no Ray): each level's
transformers rate (before and after the served run, combined), eta_serve, and the in-process engine's ratios; checked
on crafted rates in tests/unit/test_bench_reports.py."""

from __future__ import annotations

from .serve_profile import eta_serve


def add_eta(run: dict, before: dict[str, dict], after: dict[str, dict], engine: dict[str, dict] | None = None
             ) -> None:
    """Fill each level's reference rate (before and after its server ran, combined) and η_serve; with the in-process
    engine's rates, also served ÷ engine (what distribution keeps of the engine's rate)."""
    for c, level in run["levels"].items():
        theirs = combine_rates(before[c], after[c])
        level["transformers"] = theirs
        level["eta_serve"] = eta_serve({c: level["aggregate_tokens_per_s"]}, {c: theirs["tokens_per_s"]})[c]
        run["eta_serve"][c] = level["eta_serve"]
        if engine is not None:
            level["served_vs_engine"] = eta_serve({c: level["aggregate_tokens_per_s"]},
                                                  {c: engine[c]["tokens_per_s"]})[c]


def engine_levels(engine: dict[str, dict], transformers: dict[str, dict]) -> dict[str, dict]:
    """The in-process engine's rate per level and its ratio to transformers' (measured right after it)."""
    return {c: rate | {"vs_transformers": eta_serve({c: rate["tokens_per_s"]},
                                                    {c: transformers[c]["tokens_per_s"]})[c]}
            for c, rate in engine.items()}


def combine_rates(before: dict, after: dict) -> dict:
    """The reference measured before and after a served level: tokens over time of both, and each run's rate."""
    tokens, wall = before["tokens"] + after["tokens"], before["wall_s"] + after["wall_s"]
    return {"tokens": tokens, "wall_s": round(wall, 4), "tokens_per_s": round(tokens / wall, 3),
            "before_tokens_per_s": before["tokens_per_s"], "after_tokens_per_s": after["tokens_per_s"],
            "batch": before["batch"], "rounds": before["rounds"] + after["rounds"],
            "torch_threads": before["torch_threads"]}
