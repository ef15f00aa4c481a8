"""`expertmesh bench serve --peer`: expertmesh against `transformers serve --continuous-batching` on the same
checkpoint, through the same neutral OpenAI client (ops/bench/openai_load.py), in alternating rounds.

The bench starts both servers itself (ports from the OS) and keeps both up for the whole run: `expertmesh serve
--http-port 0` and `transformers serve FOLDER --continuous-batching --port 0` (ops/bench/peer_server.py). Each round
runs every workload (ops/bench/peer_plan.py: `distinct` short prompts, non-streamed; `shared` ~400-token system
prompt + short suffixes, streamed for time to first token) at every concurrency on both servers back to back, the
first server swapping from level to level, so a shared machine's load falls on both alike. Both get the same prompt
texts at the same level; greedy, a fixed max_tokens (ignore_eos where the server takes it; tokens counted from the
server's usage either way). Before the rounds each server gets an untimed warm-up: one level at the largest
concurrency, and one request with the shared system prompt (each server's prefix cache then holds it, as it would
in a chat service that has run for a while). The JSON has every level of every round, per workload and concurrency
each server's median (and range) of tokens/s and time to first token, and expertmesh ÷ peer; the chart
(ops/bench/peer_chart.py) draws them.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..server_process import ServerProcess, start_server
from .common import machine_info, say_to_stderr
from .openai_load import Target, level_record, probe_target, run_level
from .peer_plan import PromptBook, check_fits, schedule, summarize, workloads
from .peer_server import PeerError, PeerServer, cache_args, proc_stats, start_peer, tree_cpu_seconds

# Issue 27's targets: expertmesh tokens/s ÷ peer's on the `distinct` workload, per concurrency (embedded model).
TARGETS = {"distinct": {"1": 0.5, "8": 0.8, "32": 1.0}}


@dataclass(frozen=True)
class PeerParams:
    """model_dir: "embedded" (default), "mid" or a checkpoint folder with a tokenizer; rounds: alternating rounds;
    workloads: names from peer_plan.workloads; prompt_tokens: the distinct workload's prompt; system_tokens and
    suffix_tokens: the shared workload's two parts; transport: expertmesh's; serve_args / peer_args: extra arguments
    for `expertmesh serve` / `transformers serve`; chart: PNG path or None."""

    model_dir: str | None = None
    concurrencies: tuple[int, ...] = (1, 8, 32)
    max_tokens: int = 32
    requests_per_stream: int = 1
    rounds: int = 3
    workloads: tuple[str, ...] = ("distinct", "shared")
    prompt_tokens: int = 16
    system_tokens: int = 400
    suffix_tokens: int = 16
    transport: str = "socket"  # expertmesh serve --transport (socket: what `auto` picks on the Ray it starts)
    serve_args: tuple[str, ...] = ()
    peer_args: tuple[str, ...] = ()
    chart: Path | None = None

    @classmethod
    def from_args(cls, args) -> PeerParams:
        if args.target:
            raise SystemExit("--target: not with --peer (the bench starts both servers itself)")
        if "," in args.transports:
            raise SystemExit(f"--transports: --peer runs one expertmesh server; give one transport, got "
                             f"{args.transports}")
        chart = args.chart or (str(Path(args.out).with_suffix(".png")) if args.out else None)
        return cls(model_dir=args.model, concurrencies=tuple(int(c) for c in args.concurrency.split(",")),
                   max_tokens=args.max_tokens,
                   requests_per_stream=1 if args.requests_per_stream is None else args.requests_per_stream,
                   rounds=args.rounds,
                   workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
                   prompt_tokens=args.prompt_tokens, system_tokens=args.system_tokens,
                   suffix_tokens=args.suffix_tokens,
                   transport=args.transports, serve_args=tuple(args.serve_arg), peer_args=tuple(args.peer_arg),
                   chart=Path(chart) if chart else None)


def _tokenizer(folder: str):
    from tokenizers import Tokenizer

    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise SystemExit(f"--model: {folder} has no tokenizer.json (both servers take text prompts)")
    tok = Tokenizer.from_file(str(path))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def _context(folder: str) -> int | None:
    try:
        return int(json.loads((Path(folder) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, KeyError, ValueError):
        return None


def run_peer_bench(params: PeerParams = PeerParams(), verbose: bool = True) -> dict:
    from .serve import _model_dir

    say = say_to_stderr(verbose)
    if params.max_tokens < 1 or params.requests_per_stream < 1:
        raise SystemExit("--max-tokens and --requests-per-stream: must be >= 1")
    if params.rounds < 1:
        raise SystemExit(f"--rounds: must be >= 1, got {params.rounds}")
    if not params.concurrencies or min(params.concurrencies) < 1:
        raise SystemExit(f"--concurrency: need positive integers, got {list(params.concurrencies)}")
    try:
        plan = workloads(params.workloads, prompt_tokens=params.prompt_tokens, system_tokens=params.system_tokens,
                         suffix_tokens=params.suffix_tokens)
    except ValueError as exc:  # names the field (workloads, prompt_tokens, ...)
        raise SystemExit(f"bench serve --peer: {exc}") from exc
    run_started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="expertmesh-bench-peer-") as tmp:
        name, folder = _model_dir(params.model_dir, Path(tmp))
        try:
            check_fits(plan, params.max_tokens, _context(folder))
        except ValueError as exc:
            raise SystemExit(f"bench serve --peer: {exc}") from exc
        book = PromptBook(_tokenizer(folder))
        serve_args = ("--transport", params.transport, *params.serve_args)
        result: dict = {
            "benchmark": "serve-peer", "model": name, "peer": "transformers serve --continuous-batching",
            "max_tokens": params.max_tokens, "requests_per_stream": params.requests_per_stream,
            "rounds": params.rounds, "concurrencies": list(params.concurrencies),
            "workloads": [w.__dict__ for w in plan], "serve_args": list(serve_args),
            "peer_args": list(params.peer_args), "targets_tokens_per_s_ratio": TARGETS,
            "load_average_start": _load_average(),
        }
        ours: ServerProcess | None = None
        peer: PeerServer | None = None
        try:
            # The peer first: it starts in seconds, so a bad --peer-arg fails before Ray and Serve spend a minute.
            say("starting transformers serve --port 0 ...")
            peer_args = (*cache_args(params.peer_args, max(params.concurrencies), _context(folder)),
                         *params.peer_args)
            peer = start_peer(folder, peer_args)
            result["peer_start_s"] = peer.start_s
            result["peer_command"] = peer.command[1:]
            say(f"transformers serve on {peer.base_url} ({peer.start_s} s); starting expertmesh serve ...")
            t0 = time.perf_counter()
            ours = start_server(["--model", folder, "--http-port", "0", *serve_args])
            if ours.http_url is None:
                raise RuntimeError("expertmesh serve printed no HTTP address")
            result["expertmesh_start_s"] = round(time.perf_counter() - t0, 3)
            say(f"expertmesh on {ours.http_url} ({result['expertmesh_start_s']} s)")
            targets = {"expertmesh": asyncio.run(probe_target(Target("expertmesh", ours.http_url))),
                       "peer": asyncio.run(probe_target(Target("peer", peer.base_url)))}
            result["servers"] = {k: {"url": t.base_url, "model": t.model, "ignore_eos": t.ignore_eos,
                                     "notes": t.notes} for k, t in targets.items()}
            result["warmup"] = _warm_up(targets, book, plan, params, say)
            pids = {"expertmesh": ours.proc.pid, "peer": peer.proc.pid}
            result["levels"] = _rounds(targets, pids, book, plan, params, say)
        except (PeerError, RuntimeError) as exc:  # a server that did not start or answer: named, no traceback
            raise SystemExit(f"bench serve --peer: {exc}") from exc
        finally:
            if peer is not None:
                say("stopping transformers serve ...")
                result["peer_exit"] = {"code": peer.stop(), "signal": peer.stop_signal, "log": str(peer.log_path),
                                       "stragglers_killed": peer.stragglers_killed}
            if ours is not None:
                say("stopping expertmesh serve ...")
                result["expertmesh_exit"] = {"code": ours.stop(), "log": str(ours.log_path)}
    result["summary"] = summarize(result["levels"])
    result["load_average_end"] = _load_average()
    result["machine"] = machine_info(python=platform.python_version())
    result["run_wall_s"] = round(time.perf_counter() - run_started, 3)
    if params.chart is not None:
        from .peer_chart import write_peer_chart

        result["chart"] = str(write_peer_chart(result, params.chart))
    return result


def _prompts(book: PromptBook, workload, round_: int, c: int, per_stream: int) -> list[list[str]]:
    return [[book.prompt(workload, round_, c, s * per_stream + j) for j in range(per_stream)] for s in range(c)]


def _warm_up(targets: dict[str, Target], book: PromptBook, plan, params: PeerParams, say) -> dict:
    """Untimed: one level of every workload at the largest concurrency, a few tokens each (first-request set-up,
    batch shapes; the shared workload's level leaves the system prompt in each server's prefix cache)."""
    out = {}
    top = max(params.concurrencies)
    for name, target in targets.items():
        say(f"warm-up {name} ...")
        started = time.perf_counter()
        for w in plan:
            prompts = _prompts(book, w, -1, top, 1)
            replies, _ = asyncio.run(run_level(target, prompts, min(4, params.max_tokens), w.streamed))
            bad = [r.error for r in replies if r.error]
            if bad:
                raise RuntimeError(f"{name}: warm-up requests failed ({bad[:3]}); see its log")
        out[name] = {"seconds": round(time.perf_counter() - started, 3)}
    return out


def _cpu(pids: dict[str, int]) -> dict[str, float | None]:
    stats = proc_stats()
    return {name: tree_cpu_seconds(pid, stats) for name, pid in pids.items()}


def _rounds(targets: dict[str, Target], pids: dict[str, int], book: PromptBook, plan, params: PeerParams,
            say) -> list[dict]:
    """Every slot of the schedule; beside each level's figures, the CPU seconds each server's process tree used
    during it (the one measured, and the idle other one: what keeping both up costs the one under test)."""
    by_name = {w.name: w for w in plan}
    levels = []
    for slot in schedule(params.rounds, [w.name for w in plan], params.concurrencies):
        w = by_name[slot.workload]
        prompts = _prompts(book, w, slot.round, slot.concurrency, params.requests_per_stream)
        before = _cpu(pids)
        replies, wall = asyncio.run(run_level(targets[slot.server], prompts, params.max_tokens, w.streamed))
        after = _cpu(pids)
        used = {k: None if before[k] is None or after[k] is None else round(after[k] - before[k], 3) for k in pids}
        other = next(k for k in pids if k != slot.server)
        record = {"round": slot.round, "workload": slot.workload, "concurrency": slot.concurrency,
                  "server": slot.server, **level_record(replies, wall, params.max_tokens),
                  "cpu_s": used[slot.server], "other_server_cpu_s": used[other]}
        levels.append(record)
        ttft = f", TTFT p50 {record['ttft_p50_ms']} ms" if record["ttft_p50_ms"] is not None else ""
        say(f"round {slot.round + 1}/{params.rounds} {slot.workload} x{slot.concurrency} {slot.server}: "
            f"{record['tokens_per_s']} tok/s{ttft}; errors {record['errors'] or 'none'}")
    return levels


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
