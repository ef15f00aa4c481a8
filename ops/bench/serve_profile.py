"""The step profile and η_serve of `expertmesh bench serve`, as pure functions (no Ray, gRPC or torch).

`profile_table` turns the router's stage clocks (router_service/step_profile.py), read through Admin GetRouterStats
before and after a measured stretch, into milliseconds per step. Rows are the serial path of one step, in order;
each is a raw stage or a difference of nested ones, so they partition the stretch's wall time, and "unaccounted"
is what the clocks did not see (the stretch measured by the client minus the rows' sum). Work that runs beside the
step rather than inside it (the gRPC front writing messages in its own process; the replica's event loop turning
events into proto messages while the forward thread runs) is listed apart, under `concurrent`: its time is not in
the step's sum, it competes with the step for the cores.
"""

from __future__ import annotations

# (row name, what it holds). Derived rows subtract the stages nested inside them (step_profile.py lists the nesting).
ROWS: tuple[tuple[str, str], ...] = (
    ("waiting for requests", "no sequence active: a request on its way client -> front -> Serve -> router"),
    ("scheduling", "release finished sequences, admit, plan the step (KV blocks)"),
    ("dense", "embedding, attention over the KV cache, norms, residuals, shared experts"),
    ("gating", "router logits and top-k"),
    ("dispatch planning", "no-replica policy, grouping rows by actor"),
    ("transport send", "staging rows, one transport submit per actor"),
    ("experts' compute", "the actors' forward time (summed over actors, at most the wait)"),
    ("transport wait", "waiting for the answers beyond the actors' compute: the transport's round trip"),
    ("combine", "weighted sum of the expert outputs"),
    ("dispatch bookkeeping", "breakers, failover checks, spans, load statistics"),
    ("lm_head", "final norm and logits of each sequence's last row"),
    ("routing statistics", "per-sequence routed-slot counts after the forward"),
    ("event-loop hand-back", "the forward thread's result reaching the batcher loop (Serve's sends share that loop)"),
    ("sampling", "choosing each next token"),
    ("detokenising", "ids -> the text to stream"),
    ("streaming", "token events to each stream, routing counts, finishing"),
    ("loop other", "the rest of a batcher loop iteration"),
)
CONCURRENT: tuple[tuple[str, str, str], ...] = (
    ("Serve message conversion", "serve.emit", "batcher events -> proto messages on the replica's event loop"),
    ("gRPC front relay", "front.relay", "the front writing each message to its client (server process)"),
)


def stage_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Seconds per stage between two GetRouterStats snapshots (a stage missing from `before` started at 0)."""
    return {k: after[k] - before.get(k, 0.0) for k in after}


def profile_table(delta: dict[str, float], steps: int, wall_s: float,
                  actor_compute_s: float | None = None) -> dict:
    """delta: stage seconds over the stretch (stage_deltas); steps: forward steps taken in it; wall_s: the
    stretch's wall time as the client measured it; actor_compute_s: the actors' compute_s summed over actors for
    the stretch (None: not known, then the whole gather is "transport wait").
    -> {"step_ms", "steps", "rows": [{stage, ms, share, note}], "concurrent": [...], "accounted_share"}."""
    if steps <= 0 or wall_s <= 0:
        raise ValueError(f"need steps > 0 and wall_s > 0, got {steps}, {wall_s}")
    d = {k: max(0.0, v) for k, v in delta.items()}
    g = d.get
    gather = g("dispatch.gather", 0.0)
    compute = min(gather, actor_compute_s) if actor_compute_s is not None else 0.0
    dispatch_total = g("dispatch.submit", 0.0) + g("dispatch.wait", 0.0)
    dispatch_parts = g("dispatch.plan", 0.0) + g("dispatch.send", 0.0) + gather + g("dispatch.combine", 0.0)
    model_parts = g("model.gating", 0.0) + g("model.lm_head", 0.0) + dispatch_total
    post_parts = g("post.detokenise", 0.0)
    seconds = {
        "waiting for requests": g("loop.idle", 0.0),
        "scheduling": g("loop.schedule", 0.0),
        "dense": g("forward.model", 0.0) - model_parts,
        "gating": g("model.gating", 0.0),
        "dispatch planning": g("dispatch.plan", 0.0),
        "transport send": g("dispatch.send", 0.0),
        "experts' compute": compute,
        "transport wait": gather - compute,
        "combine": g("dispatch.combine", 0.0),
        "dispatch bookkeeping": dispatch_total - dispatch_parts,
        "lm_head": g("model.lm_head", 0.0),
        "routing statistics": g("forward.thread", 0.0) - g("forward.model", 0.0) - g("forward.sampling", 0.0),
        "event-loop hand-back": g("loop.executor", 0.0) - g("forward.thread", 0.0),
        "sampling": g("forward.sampling", 0.0),
        "detokenising": g("post.detokenise", 0.0),
        "streaming": g("loop.post", 0.0) - post_parts,
        "loop other": g("loop.busy", 0.0) - g("loop.schedule", 0.0) - g("loop.executor", 0.0) - g("loop.post", 0.0),
    }
    step_ms = 1000.0 * wall_s / steps

    def row(stage: str, secs: float, note: str) -> dict:
        ms = 1000.0 * secs / steps
        return {"stage": stage, "ms": round(ms, 4), "share": round(ms / step_ms, 4), "note": note}

    rows = [row(stage, max(0.0, seconds[stage]), note) for stage, note in ROWS]
    accounted = sum(r["ms"] for r in rows)
    rows.append({"stage": "unaccounted", "ms": round(step_ms - accounted, 4),
                 "share": round((step_ms - accounted) / step_ms, 4),
                 "note": "the client's stretch minus the clocked stages (negative: the clocks saw more)"})
    concurrent = [row(stage, g(key, 0.0), note) for stage, key, note in CONCURRENT if key in d]
    return {"step_ms": round(step_ms, 4), "steps": steps, "rows": rows, "concurrent": concurrent,
            "accounted_share": round(accounted / step_ms, 4)}


def eta_serve(ours: dict[str, float | None], theirs: dict[str, float | None]) -> dict[str, float | None]:
    """η_serve per level: our served tokens/s ÷ in-process `transformers` generate tokens/s at the same level
    (keys: stream counts as strings). None where either side is missing or theirs is not positive."""
    out: dict[str, float | None] = {}
    for level in ours:
        a, b = ours[level], theirs.get(level)
        out[level] = round(a / b, 4) if a is not None and b is not None and b > 0 else None
    return out


def status_profile_line(stage_seconds: dict[str, float], steps: int) -> str | None:
    """`expertmesh status`: the router's largest stages since it started, ms per step (None before any step)."""
    if steps <= 0 or not stage_seconds.get("loop.busy"):
        return None
    # Since start the stretch is the loop's own time (idle included), so "unaccounted" is near 0 by construction.
    wall = stage_seconds.get("loop.busy", 0.0) + stage_seconds.get("loop.idle", 0.0)
    rows = [r for r in profile_table(stage_seconds, steps, wall)["rows"]
            if r["stage"] not in ("waiting for requests", "unaccounted")]
    top = sorted(rows, key=lambda r: -r["ms"])[:6]
    busy_ms = 1000.0 * stage_seconds["loop.busy"] / steps
    return (f"router step profile: {busy_ms:.2f} ms per busy step; "
            + ", ".join(f"{r['stage']} {r['ms']:.2f}" for r in top))
