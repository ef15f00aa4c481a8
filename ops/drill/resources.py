"""Resident memory and open file descriptors of everything a drill started, sampled from /proc, and whether they
stayed flat: a soak's leak check.

`sample_tree(root_pids)` walks /proc once (Linux only; elsewhere it returns None) and sums, per role, the resident
set and the descriptors of the roots' descendants. Roles come from the process title Ray gives its workers
(`ray::ExpertActor...`, `ray::ServeReplica:...`) or the command line, so a leak can be pinned to the expert actors,
the router replicas, Ray's own daemons or the serve process.

`flatness(samples)` is pure: per role and metric, the drift over the run after a warm-up, from a least-squares line
through the samples (robust to one noisy sample, unlike first-against-last).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

WARMUP_SHARE = 0.2  # the first fifth of a run is warm-up: caches fill, lazy imports land, pools grow
# Ray's daemons each get a role: the first 30-minute soak saw them grow 33 % together (our processes: within 1.2 %)
# and could not say which one.
ROLES = ("expert_actors", "router_replicas", "controller", "serve_process", "ray_gcs", "ray_raylet", "ray_dashboard",
         "ray_other", "other")


def _role(cmdline: str) -> str:
    if "ray::ExpertActor" in cmdline:
        return "expert_actors"
    if "ray::ServeReplica" in cmdline or "ray::ServeController" in cmdline or "ray::ProxyActor" in cmdline:
        return "router_replicas"
    if "ray::Controller" in cmdline or "ray::MeshController" in cmdline:
        return "controller"
    if "expertmesh" in cmdline and " serve" in cmdline:
        return "serve_process"
    if "gcs_server" in cmdline:
        return "ray_gcs"
    if "/raylet" in cmdline or cmdline.startswith("raylet"):
        return "ray_raylet"
    if any(name in cmdline for name in ("dashboard", "DashboardAgent", "RuntimeEnvAgent", "runtime_env")):
        return "ray_dashboard"
    if any(name in cmdline for name in ("log_monitor", "monitor.py", "ray::IDLE", "default_worker.py", "ray::")):
        return "ray_other"
    return "other"


def _read_procs() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) for every process we may read."""
    procs = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            cmd = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        # The command name in stat is in parentheses and may itself hold spaces or parentheses.
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        procs[int(entry.name)] = (ppid, cmd)
    return procs


def _descendants(procs: dict[int, tuple[int, str]], roots: list[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    seen, stack = set(), [r for r in roots if r in procs]
    while stack:
        pid = stack.pop()
        if pid not in seen:
            seen.add(pid)
            stack.extend(children.get(pid, []))
    return seen


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0  # a zombie has no VmRSS


def sample_tree(root_pids: list[int]) -> dict | None:
    """One sample: {t, roles: {role: {procs, rss_bytes, fds}}} over the roots and their descendants."""
    if not Path("/proc/self/status").exists():
        return None
    procs = _read_procs()
    roles = {role: {"procs": 0, "rss_bytes": 0, "fds": 0} for role in ROLES}
    for pid in _descendants(procs, root_pids):
        try:
            rss = _rss_bytes(pid)
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:  # gone between the walk and the read, or not ours
            continue
        row = roles[_role(procs[pid][1])]
        row["procs"] += 1
        row["rss_bytes"] += rss
        row["fds"] += fds
    return {"t": time.time(), "roles": roles}


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def flatness(samples: list[dict], limit: float = 0.05, warmup_share: float = WARMUP_SHARE) -> dict:
    """Per metric (rss_bytes, fds; the total and each role with processes), over the samples after the warm-up:
    `drift` = (least-squares slope x window length) / mean, i.e. how much the fitted line rose over the window,
    as a share of the level; `flat` when |drift| <= limit. Also first/last/min/max of the window.

    A restart (a killed actor replaced) shows as a step, not a slope, in a soak without kills there is none."""
    rows = [s for s in samples if s]
    if len(rows) < 4:
        return {"samples": len(rows), "enough_samples": False, "metrics": {}}
    start = rows[0]["t"] + warmup_share * (rows[-1]["t"] - rows[0]["t"])
    window = [s for s in rows if s["t"] >= start]
    if len(window) < 3:
        return {"samples": len(rows), "enough_samples": False, "metrics": {}}
    xs = [s["t"] for s in window]
    span = xs[-1] - xs[0]
    metrics = {}
    for metric in ("rss_bytes", "fds"):
        series = {"total": [sum(r[metric] for r in s["roles"].values()) for s in window]}
        for role in ROLES:
            values = [s["roles"][role][metric] for s in window]
            if any(s["roles"][role]["procs"] for s in window):
                series[role] = values
        for name, ys in series.items():
            mean = sum(ys) / len(ys)
            drift = _slope(xs, ys) * span / mean if mean else 0.0
            metrics[f"{metric}.{name}"] = {"first": ys[0], "last": ys[-1], "min": min(ys), "max": max(ys),
                                           "mean": round(mean, 1), "drift": round(drift, 4),
                                           "flat": abs(drift) <= limit}
    return {"samples": len(rows), "enough_samples": True, "window_s": round(span, 1),
            "warmup_s": round(start - rows[0]["t"], 1), "limit": limit, "metrics": metrics}
