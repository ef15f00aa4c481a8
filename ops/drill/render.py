"""Rendering a drill report: the timeline PNG (matplotlib), drill_report.md, and the short terminal summary.

Reads only the report dict that ops/drill/report.py builds.
"""

from __future__ import annotations

from pathlib import Path

from .report import P99_FACTOR


def plot_timeline(report: dict, path: Path) -> None:
    """The report's timeline as a PNG: throughput and failures, p99 latency, live replicas (and perplexity)."""
    timeline = report["timeline"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(12, 8.5), sharex=True)
    t = timeline["t_s"]
    centers = [x + 0.5 for x in t]
    axes[0].bar(centers, timeline["tokens_per_s"], width=1.0, color="tab:blue", alpha=0.8, label="tokens/s")
    fails = [(c, f) for c, f in zip(centers, timeline["failures"]) if f]
    if fails:
        ax_f = axes[0].twinx()
        ax_f.bar([c for c, _ in fails], [f for _, f in fails], width=0.6, color="tab:red", alpha=0.7)
        ax_f.set_ylabel("failed requests", color="tab:red")
    axes[0].set_ylabel("tokens / s (1 s buckets)")
    nan = float("nan")
    axes[1].plot(centers, [nan if v is None else v for v in timeline["p99_latency_s"]], ".-", color="tab:orange",
                 label="p99 of requests ending in the bucket")
    base = report["latency_s"]["baseline"]["p99_s"]
    if base:
        axes[1].axhline(base, color="gray", ls="--", lw=1, label=f"baseline p99 {base:.2f} s")
        axes[1].axhline(P99_FACTOR * base, color="tab:red", ls=":", lw=1, label=f"{P99_FACTOR:g}x baseline p99")
    axes[1].set_ylabel("request latency p99 (s)")
    axes[1].legend(loc="upper right", fontsize=8)
    live = timeline["live_replicas"]
    axes[2].plot([x for x, _ in live], [nan if y is None else y for _, y in live], ".", color="tab:green", ms=4,
                 label="GetClusterState poll (at its answer)")
    exact = timeline["live_replicas_from_events"]
    axes[2].step([x for x, _ in exact], [y for _, y in exact], where="post", color="tab:green", lw=1.5,
                 label="from kill and restored-event times")
    if timeline["perplexity"]:
        ax_p = axes[2].twinx()
        ax_p.plot([x for x, _ in timeline["perplexity"]], [y for _, y in timeline["perplexity"]], "s-",
                  color="tab:brown", ms=3, lw=1)
        ax_p.set_ylabel("held-out perplexity (Score)", color="tab:brown")
    expected = report["cluster"]["replicas_expected"]
    if timeline["controller_down_s"]:
        axes[2].plot(timeline["controller_down_s"], [expected + 0.5] * len(timeline["controller_down_s"]), "|",
                     color="tab:purple", ms=10, label="poll: controller down")
    axes[2].legend(loc="lower right", fontsize=8)
    down = [x for x, y in timeline["live_replicas"] if y is None]
    if down:
        axes[2].plot(down, [0] * len(down), "x", color="tab:red", label="GetClusterState failed")
        axes[2].legend(loc="lower right", fontsize=8)
    axes[2].set_ylim(-0.5, max(expected, 1) + 1)
    axes[2].set_ylabel("live expert replicas")
    axes[2].set_xlabel("seconds since the baseline began")
    phases = report["phases_s"]
    for ax in axes:
        ax.axvspan(phases["baseline"][0], phases["baseline"][1], color="gray", alpha=0.08)
        for x, _mode, _who in timeline["kills_s"]:
            ax.axvline(x, color="tab:red", lw=1, alpha=0.8)
        for a, b in timeline["recovery_windows_s"]:
            ax.axvspan(a, b, color="tab:red", alpha=0.07)
        ax.grid(alpha=0.3)
    for x, mode, who in timeline["kills_s"]:
        short = ",".join(("router#" + w.split("#")[-1]) if "#" in w else w.replace("expert-", "")
                         for w in who.split(",")) if who else mode
        axes[0].annotate(f"kill {short}", (x, 1), xycoords=("data", "axes fraction"), rotation=90,
                         fontsize=7, va="top", ha="right", color="tab:red")
    d = report["drill"]
    fig.suptitle(f"expertmesh drill: kill {d['kill']} every {d['every']} s for {d['duration']} s, "
                 f"{d['concurrency']} streams, {d['replicas_per_expert']} replicas/expert, "
                 f"policy {d['server_policy']}  (grey: baseline; red: kill until recovered)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_resources(report: dict, path: Path) -> bool:
    """Resident memory and descriptors per role, KV blocks free and live expert replicas over the run, as a PNG.
    False (nothing written) when the drill took no samples (attached to a running server)."""
    res = report.get("resources") or {}
    series = res.get("series") or {}
    if not series.get("t_s"):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(12, 10), sharex=True)
    t = series["t_s"]
    for role, values in series["rss_mib"].items():
        if any(series["procs"][role]):
            axes[0].plot(t, values, label=role)
            axes[1].plot(t, series["fds"][role], label=role)
    axes[0].plot(t, [sum(v) for v in zip(*series["rss_mib"].values())], "k-", lw=1.5, label="total")
    axes[1].plot(t, [sum(v) for v in zip(*series["fds"].values())], "k-", lw=1.5, label="total")
    axes[0].set_ylabel("resident memory (MiB)")
    axes[1].set_ylabel("open descriptors")
    flat = res.get("flatness") or {}
    if flat.get("enough_samples"):
        for ax in axes[:2]:
            ax.axvspan(t[0], t[0] + flat["warmup_s"], color="gray", alpha=0.15, label="warm-up")
    axes[0].legend(loc="upper left", fontsize=7, ncol=4)
    axes[1].legend(loc="upper left", fontsize=7, ncol=4)
    kv = res["kv_blocks"]["series"]
    if kv:
        axes[2].plot([x for x, _, _ in kv], [f for _, f, _ in kv], ".-", ms=3, label="KV blocks free")
        if res["kv_blocks"]["total"]:
            axes[2].axhline(res["kv_blocks"]["total"], color="gray", ls="--", lw=1, label="KV blocks in all")
        axes[2].legend(loc="lower left", fontsize=8)
    axes[2].set_ylabel("KV blocks (router)")
    live = res["live_actors"]
    axes[3].plot([x for x, _, _ in live], [n for _, n, _ in live], ".", ms=3, color="tab:green", label="serving")
    axes[3].plot([x for x, _, _ in live], [e for _, _, e in live], "-", lw=1, color="gray", label="expected")
    axes[3].set_ylabel("expert replicas")
    axes[3].set_xlabel("seconds since the baseline started")
    axes[3].legend(loc="lower left", fontsize=8)
    fig.suptitle(f"expertmesh drill ({report['drill']['kill']}): resources")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _resources_markdown(report: dict) -> list[str]:
    res = report.get("resources") or {}
    flat = res.get("flatness") or {}
    if not flat.get("enough_samples"):
        return []
    lines = ["", "## Resources", "",
             f"{flat['samples']} samples; the first {flat['warmup_s']} s are warm-up; drift over the next "
             f"{flat['window_s']} s = least-squares slope x window / mean (flat within +-{flat['limit']:.0%}).", "",
             "| metric | first | last | min | max | drift | flat |", "|---|---|---|---|---|---|---|"]
    for name, row in flat["metrics"].items():
        in_mib = name.startswith("rss")

        def fmt(v, in_mib=in_mib):
            return f"{v / 2**20:.1f} MiB" if in_mib else str(v)

        lines.append(f"| {name} | {fmt(row['first'])} | {fmt(row['last'])} | {fmt(row['min'])} | {fmt(row['max'])} "
                     f"| {row['drift']:+.2%} | {'yes' if row['flat'] else '**NO**'} |")
    kv = res["kv_blocks"]
    lines += ["", f"KV blocks: {kv['total']} in all, fewest free {kv['min_free']}, free after the load stopped "
                  f"{kv['free_at_end']}.", "", "![resources](drill_resources.png)"]
    return lines


def markdown(report: dict) -> str:
    """drill_report.md: targets, requests per phase, kills, perplexity and cluster, with the timeline image."""
    d, q, lat, tg = report["drill"], report["requests"], report["latency_s"], report["targets"]
    lines = [
        f"# expertmesh drill: kill {d['kill']}",
        "",
        f"Every {d['every']} s for {d['duration']} s after a {d['baseline']} s baseline; {d['concurrency']} greedy "
        f"streams x {d['max_tokens']} tokens; {d['replicas_per_expert']} replicas per expert; no-replica policy "
        f"{d['server_policy']}; seed {d['seed']}; target {d['target']}"
        f"{' (self-started)' if d['self_started'] else ''}.",
        "",
        "## Targets",
        "",
        "| target | value | met |",
        "|---|---|---|",
    ]
    for name, t in tg.items():
        met = ("yes" if t["met"] else "**NO**") if t["applicable"] else "n/a"
        lines.append(f"| {name} | {t['value']} | {met} |")
    lines += [
        "",
        "## Requests",
        "",
        f"Sent {q['sent']}, succeeded {q['succeeded']}, failed {q['failed']} {q['failed_by_code'] or ''}. "
        f"Tokens generated {report['tokens']['generated']}, degraded {report['tokens']['degraded']}. "
        f"Greedy outputs differing from the baseline: {report['outputs']['mismatches']} of "
        f"{report['outputs']['compared']} compared ({report['outputs']['unverified']} unverified).",
        "",
        "| phase | window (s) | requests | failed | latency p50 (s) | p99 (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("baseline", "faults", "after"):
        w = report["phases_s"][name]
        ph = q["by_phase"][name]
        lines.append(f"| {name} | {w[0]}-{w[1]} | {ph['sent']} | {ph['failed_by_code'] or 0} | "
                     f"{lat[name]['p50_s']} | {lat[name]['p99_s']} |")
    lines += ["", "## Kills", "", "| # | t (s) | mode | target | detect (s) | restore / recovery (s) | notes |",
              "|---|---|---|---|---|---|---|"]
    for k in report["kills"]:
        notes = [k.get("note") or ""]
        if k["mode"] == "controller":
            notes.append(f"recreated {k.get('recreated_s')} s, placement unchanged {k.get('placement_unchanged')}, "
                         f"epoch {k.get('epoch_before')}->{k.get('epoch_after')}")
        if k["mode"] == "router":
            notes.append(f"failed until success {k.get('failed_until_success')}")
        if k.get("error"):
            notes.append(f"ERROR {k['error']}")
        lines.append(f"| {k['index']} | {k['t_s']} | {k['mode']} | {', '.join(k['targets'])} | {k.get('detect_s')} | "
                     f"{k.get('restore_s')} | {'; '.join(n for n in notes if n)} |")
    ppl = report.get("perplexity")
    if ppl:
        lines += ["", "## Held-out perplexity (degrade policy)", "",
                  f"{ppl['tokens']} held-out tokens in {ppl['window']}-token windows ({ppl['source']}). Healthy "
                  f"baseline {ppl['baseline']}; during faults mean {ppl['during_faults_mean']}, max "
                  f"{ppl['during_faults_max']}; passes overlapping an outage mean {ppl['during_outage_mean']}, "
                  f"passes wholly inside one mean {ppl['inside_outage_mean']}; after the last restore "
                  f"{ppl['after_mean']}. "
                  f"(Training report: {ppl['training_report_held_out_perplexity']} over the whole held-out set.)"]
    c = report["cluster"]
    lines += ["", "## Cluster", "",
              f"Expected {c['replicas_expected']} expert replicas; fewest live {c['min_live_replicas']}; "
              f"{c['polls']} polls, failed {c['failed_polls'] or 0}; controller reported down in "
              f"{c['controller_down_polls']} polls; events {c['events_by_kind']}; epoch {c['epoch_start']} -> "
              f"{c['epoch_end']}.", "", "![timeline](drill_timeline.png)"]
    lines += _resources_markdown(report) + [""]
    return "\n".join(lines)


def summary(report: dict) -> str:
    """A few lines for a person at a terminal: requests, p99 per phase, each kill, each target."""
    q, lat, tg = report["requests"], report["latency_s"], report["targets"]
    lines = [f"requests {q['sent']} sent, {q['failed']} failed {q['failed_by_code'] or ''}; "
             f"mismatches {report['outputs']['mismatches']}; degraded tokens {report['tokens']['degraded']}",
             f"p99 latency: baseline {lat['baseline']['p99_s']} s, faults {lat['faults']['p99_s']} s, "
             f"after {lat['after']['p99_s']} s"]
    for k in report["kills"]:
        lines.append(f"kill {k['index']} at {k['t_s']} s {k['mode']} {','.join(k['targets'])}: detect "
                     f"{k.get('detect_s')} s, restore {k.get('restore_s')} s")
    if report.get("perplexity"):
        p = report["perplexity"]
        lines.append(f"perplexity: baseline {p['baseline']}, faults mean {p['during_faults_mean']}, "
                     f"overlapping an outage {p['during_outage_mean']}, inside one {p['inside_outage_mean']}, "
                     f"after {p['after_mean']}")
    for name, t in tg.items():
        lines.append(f"target {name}: {t['value']} -> {'met' if t['met'] else 'NOT met'}"
                     f"{'' if t['applicable'] else ' (n/a)'}")
    return "\n".join(lines)
