"""`bench serve --peer`'s pure parts (ops/bench/peer_plan.py, openai_load.level_record, peer_chart): workloads and
their prompt texts, the alternating schedule, medians and ratios. No server, no Ray."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from expertmesh.ops.bench.openai_load import Reply, Target, body, level_record
from expertmesh.ops.bench.peer_plan import (
    PromptBook,
    Slot,
    Workload,
    check_fits,
    schedule,
    summarize,
    text_of_tokens,
    workloads,
)


def words(text: str) -> list[int]:
    """A stand-in tokenizer: one token per space-separated word, plus one per newline."""
    return [hash(w) for w in text.replace("\n", " \n ").split(" ") if w]


def test_workloads_lengths_and_refusals_name_the_field():
    distinct, shared = workloads(["distinct", "shared"], prompt_tokens=16, system_tokens=400, suffix_tokens=12)
    assert (distinct.streamed, distinct.prompt_tokens, shared.streamed, shared.shared_tokens, shared.prompt_tokens) \
        == (False, 16, True, 400, 412)
    (long,) = workloads(["long"], prompt_tokens=16, system_tokens=400, suffix_tokens=12)
    assert (long.shared_tokens, long.own_tokens) == (0, 412)
    with pytest.raises(ValueError, match="workloads: \\['nope'\\]"):
        workloads(["distinct", "nope"], prompt_tokens=16, system_tokens=400, suffix_tokens=12)
    with pytest.raises(ValueError, match="suffix_tokens: must be >= 1"):
        workloads(["shared"], prompt_tokens=16, system_tokens=400, suffix_tokens=0)


def test_check_fits_counts_prompt_max_tokens_and_bos():
    shared = Workload("shared", True, 400, 16)
    check_fits([shared], max_tokens=95, context=512)  # 400 + 16 + 95 + 1 = 512
    with pytest.raises(ValueError, match="system_tokens \\+ suffix_tokens \\+ max_tokens: .* 513 .* 512"):
        check_fits([shared], max_tokens=96, context=512)
    check_fits([shared], max_tokens=10_000, context=None)  # unknown context: nothing to check


def test_text_of_tokens_hits_the_length_and_is_deterministic():
    for n in (1, 7, 400):
        text = text_of_tokens(words, n, seed=3)
        assert len(words(text)) == n
        assert text == text_of_tokens(words, n, seed=3)
    assert text_of_tokens(words, 50, seed=3) != text_of_tokens(words, 50, seed=4)


def test_text_of_tokens_stops_below_when_a_word_would_overshoot():
    def two_per_word(text: str) -> list[int]:
        return [0, 0] * len(text.split(" "))

    assert len(two_per_word(text_of_tokens(two_per_word, 7, seed=0))) == 6


def test_prompt_book_same_text_for_both_servers_never_repeated_elsewhere():
    book = PromptBook(words, seed=1)
    distinct = Workload("distinct", False, 0, 16)
    shared = Workload("shared", True, 400, 16)
    # The book has no server argument: both servers get prompt(w, r, c, i) for the same level, by construction.
    assert book.prompt(distinct, 0, 8, 3) == PromptBook(words, seed=1).prompt(distinct, 0, 8, 3)
    seen = Counter(book.prompt(distinct, r, c, i) for r in range(-1, 3) for c in (1, 8, 32) for i in range(c))
    assert max(seen.values()) == 1  # every request of the run its own prompt: a prefix cache never hits
    first_words = Counter(p.split(" ")[0] + p.split(" ")[1] for p in seen)
    assert max(first_words.values()) < len(seen) / 4  # not one shared opening
    system = book.system(400)
    prompts = [book.prompt(shared, r, 8, i) for r in range(2) for i in range(8)]
    assert all(p.startswith(system + "\n") for p in prompts) and len(set(prompts)) == len(prompts)
    assert all(len(words(p)) == 400 + 1 + 16 for p in prompts)


def test_schedule_pairs_every_level_and_swaps_who_goes_first():
    slots = list(schedule(4, ["distinct", "shared"], [1, 8, 32]))
    assert len(slots) == 4 * 2 * 3 * 2
    pairs = [slots[i:i + 2] for i in range(0, len(slots), 2)]
    for a, b in pairs:  # each level on both servers, back to back
        assert (a.round, a.workload, a.concurrency) == (b.round, b.workload, b.concurrency)
        assert {a.server, b.server} == {"expertmesh", "peer"}
    firsts = Counter(a.server for a, _ in pairs)
    assert firsts["expertmesh"] == firsts["peer"]
    for level in {(a.workload, a.concurrency) for a, _ in pairs}:  # the same level alternates its first server
        order = [a.server for a, _ in pairs if (a.workload, a.concurrency) == level]
        assert order == ["expertmesh", "peer", "expertmesh", "peer"] or order == ["peer", "expertmesh"] * 2
    odd = [a.server for a, _ in zip(*[iter(schedule(2, ["distinct"], [1, 8, 32]))] * 2)]
    assert odd == ["expertmesh", "peer", "expertmesh", "peer", "expertmesh", "peer"]
    assert slots[0] == Slot(0, "distinct", 1, "expertmesh")
    with pytest.raises(ValueError, match="rounds"):
        list(schedule(0, ["distinct"], [1]))


def _level(r: int, server: str, tps: float, ttft: float | None = None, c: int = 8, errors: dict | None = None):
    return {"round": r, "workload": "distinct" if ttft is None else "shared", "concurrency": c, "server": server,
            "tokens_per_s": tps, "ttft_p50_ms": ttft, "errors": errors or {}}


def test_summarize_medians_ranges_and_ratios():
    levels = [_level(0, "expertmesh", 100.0), _level(0, "peer", 200.0),
              _level(1, "expertmesh", 300.0), _level(1, "peer", 100.0),
              _level(2, "expertmesh", 120.0, errors={"HTTP 500": 2}), _level(2, "peer", 150.0),
              _level(0, "expertmesh", 50.0, ttft=10.0), _level(0, "peer", 40.0, ttft=40.0)]
    out = summarize(levels)
    d = out["distinct"]["8"]
    assert d["expertmesh"]["tokens_per_s"] == {"median": 120.0, "min": 100.0, "max": 300.0,
                                               "rounds": [100.0, 300.0, 120.0]}
    assert d["peer"]["tokens_per_s"]["median"] == 150.0
    assert d["expertmesh"]["errors"] == 2 and d["peer"]["errors"] == 0
    assert d["ratio"]["tokens_per_s"] == 0.8  # 120 / 150
    assert d["ratio"]["tokens_per_s_paired_median"] == 0.8  # per round 0.5, 3.0, 0.8
    assert d["ratio"]["ttft"] is None and d["ratio"]["rounds_paired"] == 3
    s = out["shared"]["8"]
    assert s["ratio"]["ttft"] == 0.25 and s["ratio"]["tokens_per_s"] == 1.25


def test_summarize_unpaired_round_and_missing_values():
    levels = [_level(0, "expertmesh", 100.0), _level(0, "peer", None), _level(1, "expertmesh", 80.0)]
    d = summarize(levels)["distinct"]["8"]
    assert d["peer"]["tokens_per_s"] == {"median": None, "min": None, "max": None, "rounds": [None]}
    assert d["ratio"]["tokens_per_s"] is None and d["ratio"]["tokens_per_s_paired_median"] is None
    assert d["ratio"]["rounds_paired"] == 1


def test_level_record_counts_server_tokens_ttft_and_errors():
    replies = [Reply(started=0.0, finished=1.0, first_token=0.1, completion_tokens=32, prompt_tokens=417),
               Reply(started=0.0, finished=2.0, first_token=0.3, completion_tokens=20, prompt_tokens=417),
               Reply(started=0.5, finished=2.0, completion_tokens=None),
               Reply(started=0.0, finished=0.2, error="HTTP 500")]
    rec = level_record(replies, wall_s=2.0, max_tokens=32)
    assert rec["completion_tokens"] == 52 and rec["tokens_per_s"] == 26.0
    assert (rec["requests"], rec["completed"], rec["exact_max_tokens"], rec["uncounted"]) == (4, 3, 1, 1)
    assert rec["ttft_p50_ms"] == 200.0 and rec["errors"] == {"HTTP 500": 1}
    assert rec["prompt_tokens_median"] == 417
    assert level_record([Reply(0.0, 1.0, error="timeout")], 1.0, 32)["tokens_per_s"] is None


def test_request_body_is_the_same_for_every_server_except_ignore_eos_where_taken():
    ours, peer = Target("expertmesh", "http://a", model="m", ignore_eos=True), Target("peer", "http://b", model="m")
    a, b = body(ours, "def f", 32, stream=True), body(peer, "def f", 32, stream=True)
    assert a.pop("ignore_eos") is True and a == b
    assert b == {"prompt": "def f", "max_tokens": 32, "temperature": 0.0, "model": "m", "stream": True,
                 "stream_options": {"include_usage": True}}
    assert "stream" not in body(peer, "x", 4, stream=False)


def test_chart_draws_from_a_summary(tmp_path: Path):
    from expertmesh.ops.bench.peer_chart import write_peer_chart

    levels = [_level(r, s, 100.0 + r, c=c) for r in range(2) for s in ("expertmesh", "peer") for c in (1, 8)]
    levels += [_level(r, s, 50.0, ttft=20.0 + r, c=c) for r in range(2) for s in ("expertmesh", "peer") for c in (1, 8)]
    result = {"summary": summarize(levels), "model": "embedded", "max_tokens": 32, "rounds": 2}
    json.dumps(result)
    out = write_peer_chart(result, tmp_path / "peer.png")
    assert out.stat().st_size > 10_000


# ------------------------------------------------------------------------------ the launcher, on fake commands
# (the real `transformers serve` start and stop: tests/integration/test_bench_peer.py)

def _fake(script: str) -> list[str]:
    return [sys.executable, "-c", script]


def test_launch_reads_the_port_from_the_log_and_stop_escalates_past_an_ignored_sigint(tmp_path: Path):
    from expertmesh.ops.bench.peer_server import group_members, launch

    # Like transformers serve with continuous batching: SIGINT ends uvicorn but a thread keeps the process alive.
    server = launch(_fake("import signal, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                          "print('INFO:     Uvicorn running on http://localhost:43123 (Press CTRL+C to quit)'); "
                          "sys.stdout.flush(); time.sleep(60)"), timeout=30, log_path=tmp_path / "log")
    assert server.base_url == "http://127.0.0.1:43123"
    assert group_members(server.proc.pid) == [server.proc.pid]
    assert server.stop(grace_s=0.5) == -signal.SIGTERM and server.stop_signal == "SIGTERM"
    assert group_members(server.proc.pid) == []


def test_stop_kills_a_group_member_left_after_the_server_exits(tmp_path: Path):
    from expertmesh.ops.bench.peer_server import group_members, launch

    # The server forks a child that ignores SIGINT and SIGTERM, then exits on SIGINT itself: the child stays.
    child = "import signal, time; [signal.signal(s, signal.SIG_IGN) for s in (2, 15)]; time.sleep(60)"
    server = launch(_fake(f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); "
                          "time.sleep(0.5); "
                          "print('INFO:     Uvicorn running on http://localhost:43124 (Press CTRL+C to quit)'); "
                          "sys.stdout.flush(); time.sleep(60)"), timeout=30, log_path=tmp_path / "log")
    assert len(group_members(server.proc.pid)) == 2
    assert server.stop(grace_s=2) != 0 and server.stop_signal in ("SIGINT", "SIGTERM")  # the server itself went
    assert server.stragglers_killed == 1 and group_members(server.proc.pid) == []


def test_launch_failures_name_the_cause_with_the_log(tmp_path: Path):
    from expertmesh.ops.bench.peer_server import PeerError, launch, start_peer

    with pytest.raises(PeerError, match="exited with 3 before listening(.|\n)*no such model family"):
        launch(_fake("import sys; print('no such model family'); sys.exit(3)"), timeout=30)
    started = time.perf_counter()
    with pytest.raises(PeerError, match="did not listen within 1 s"):
        launch(_fake("import time; time.sleep(60)"), timeout=1)
    assert time.perf_counter() - started < 20  # the silent process was stopped, not waited for
    with pytest.raises(PeerError, match="--model: .* not a checkpoint folder with a config.json"):
        start_peer(str(tmp_path))


def test_peer_command_and_cache_sizing():
    from expertmesh.ops.bench.peer_server import cache_args, peer_command

    cmd = peer_command("/m", ("--log-level", "info"))
    assert cmd[1:6] == ["-m", "transformers.cli.transformers", "serve", "/m", "--device"]
    assert cmd[cmd.index("--port") + 1] == "0" and "--continuous-batching" in cmd and cmd[-2:] == ["--log-level",
                                                                                                    "info"]
    assert cache_args((), 32, 512) == ["--cb-num-blocks", "65"]  # 32 clients x 2 pages of 256 tokens, + 1
    assert cache_args(("--cb-num-blocks=8",), 32, 512) == [] and cache_args((), 32, None) == []


def test_tree_cpu_seconds_sums_a_process_and_its_descendants_only():
    from expertmesh.ops.bench.peer_server import proc_stats, tree_cpu_seconds

    stats = {10: (1, 1.0), 11: (10, 2.0), 12: (11, 0.5), 13: (1, 7.0), 14: (13, 3.0)}  # pid: (ppid, cpu s)
    assert tree_cpu_seconds(10, stats) == 3.5 and tree_cpu_seconds(13, stats) == 10.0
    assert tree_cpu_seconds(99, stats) is None
    import os

    here = proc_stats()
    assert here[os.getpid()][0] == os.getppid() and tree_cpu_seconds(os.getpid(), here) > 0


def test_summarize_carries_cpu_of_both_servers():
    levels = [dict(_level(0, "expertmesh", 100.0), cpu_s=2.0, other_server_cpu_s=0.1),
              dict(_level(0, "peer", 90.0), cpu_s=1.0, other_server_cpu_s=0.4)]
    d = summarize(levels)["distinct"]["8"]
    assert d["expertmesh"]["cpu_s"]["median"] == 2.0 and d["expertmesh"]["other_server_cpu_s"]["median"] == 0.1
    assert d["peer"]["other_server_cpu_s"]["median"] == 0.4


def test_cli_flags_build_peer_params_and_refuse_what_does_not_apply():
    from expertmesh.ops.bench.peer import PeerParams
    from expertmesh.ops.cli import build_parser

    parser = build_parser()
    params = PeerParams.from_args(parser.parse_args(
        ["bench", "serve", "--peer", "--rounds", "5", "--workloads", "distinct,long", "--transports", "grpc",
         "--serve-arg=--overlap", "--peer-arg=--cb-num-blocks=9", "--out", "/tmp/x.json"]))
    assert (params.rounds, params.workloads, params.transport, params.serve_args, params.peer_args) == \
        (5, ("distinct", "long"), "grpc", ("--overlap",), ("--cb-num-blocks=9",))
    assert params.requests_per_stream == 1 and str(params.chart) == "/tmp/x.png"
    with pytest.raises(SystemExit, match="--target: not with --peer"):
        PeerParams.from_args(parser.parse_args(["bench", "serve", "--peer", "--target", "h:1"]))
    with pytest.raises(SystemExit, match="--transports: .* one transport"):
        PeerParams.from_args(parser.parse_args(["bench", "serve", "--peer", "--transports", "socket,grpc"]))


def test_bad_settings_are_refused_before_any_server_starts():
    from expertmesh.ops.bench.peer import PeerParams, run_peer_bench

    with pytest.raises(SystemExit, match="workloads: \\['nope'\\]"):
        run_peer_bench(PeerParams(workloads=("nope",)), verbose=False)
    with pytest.raises(SystemExit, match="system_tokens \\+ suffix_tokens \\+ max_tokens: .* 549 .* 512"):
        run_peer_bench(PeerParams(system_tokens=500), verbose=False)  # 500 + 16 + 32 + 1 > 512 positions
    with pytest.raises(SystemExit, match="--concurrency"):
        run_peer_bench(PeerParams(concurrencies=(0,)), verbose=False)
    with pytest.raises(SystemExit, match="--rounds: must be >= 1"):
        run_peer_bench(PeerParams(rounds=0), verbose=False)
