"""`expertmesh drill`: a failover drill under load, with a report.

The drill (by default) starts its own Ray -- one local node, or for `--kill node` a `ray.cluster_utils.Cluster`
with a head and `--nodes` workers -- and runs `expertmesh serve --address <that cluster>` as a subprocess. Being a
driver on the same cluster, it can kill actors directly. With `--target HOST:PORT --address ADDR` it attaches to a
server and cluster that are already running instead (without `--address` only expert actors can be killed, through
Admin.KillReplica).

Timeline, all from one asyncio event loop (grpc.aio):

  warm-up | baseline (no faults)  | faults: a kill every `every` s for `duration` s | recovery tail
           C greedy Generate streams loop over a fixed set of prompts the whole time ------------------------->
           Admin.GetClusterState every 0.5 s (live replicas, controller events) ----------------------------->
           with --no-replica-policy degrade: held-out perplexity through Score, in baseline and repeatedly after

Kills: `actor` one random live expert actor per tick; `fraction` a random share of them per tick; `node` one worker
node, once (only on a cluster the drill started); `router` one Serve replica of the router deployment; `controller`
the controller actor (the serve process recreates it). Per kill the report gives the time to detection (the
controller's `lost` event) and to restore (its `restored` event), or for router / controller kills the time until
requests succeed / GetClusterState reports the controller again.

Outputs in `--out`: drill_report.json, drill_report.md, drill_timeline.png (and serve.log for a self-started server).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import platform
import random
import re
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from ..protos import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from ..protos import inference_pb2 as pb
from .measure import percentile
from .server_process import ServerProcess, start_server

log = logging.getLogger(__name__)

KILL_MODES = ("actor", "fraction", "node", "router", "controller")
NAMESPACE = "expertmesh"  # cluster/naming.py; repeated here so attaching without Ray never imports it
CONTROLLER_NAME = "controller"  # cluster/controller.py
EXPERT_ACTOR = re.compile(r"expert-(?:e[0-9]+-r|g[0-9]+-v)[0-9]+")  # default pool, or one actor per GPU
POLL_EVERY_S = 0.5
REQUEST_TIMEOUT_S = 120.0
FAILURE_BACKOFF_S = 0.25  # a client pauses this long after a failed request before its next one
ROUTER_TARGET_S = 30.0  # a killed router replica: new requests succeed within this
RESTORE_TARGET_S = 15.0
P99_FACTOR = 3.0
SETTLE_MAX_S = 30.0  # after `duration`: keep the load on until every kill recovered, at most this long
TAIL_S = 5.0  # and then at least this long, so "after the last fault" has data
STOP_GRACE_S = 45.0  # when the load stops, in-flight requests get this long (> the server's 30 s wait timeout)
PPL_WINDOW = 256
PPL_TOKENS = 2048
# Fixed prompts (code, like the embedded model's training text); encoded with the checkpoint's tokenizer.
PROMPT_TEXTS = (
    "def parse(self, text):", "import os\nimport sys\n", "class Config(object):\n    def __init__(self",
    "for i in range(len(", "    return self._", "if __name__ == '__main__':\n", "try:\n    import ",
    "    def __repr__(self):\n        return", "from collections import", "with open(path) as f:\n",
    "raise ValueError(", "    @property\n    def", "def test_", "# Copyright", "self.assertEqual(", "while True:\n",
)  # fmt: skip


# --------------------------------------------------------------------------------------------- small helpers


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _latency(values: list[float]) -> dict:
    return {"requests": len(values), "p50_s": _r(percentile(values, 50)), "p99_s": _r(percentile(values, 99)),
            "mean_s": _r(sum(values) / len(values)) if values else None, "max_s": _r(max(values, default=None))}


def _say(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"[drill {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _model_dir(model_dir: str | None) -> Path:
    from ..experts.tokenizer import DEFAULT_MODEL_DIR

    return Path(model_dir) if model_dir else DEFAULT_MODEL_DIR


def make_prompts(model_dir: str | None) -> list[list[int]]:
    """The drill's fixed prompts as token ids: PROMPT_TEXTS through the checkpoint's tokenizer, or (no tokenizer)
    short deterministic id sequences within the vocabulary."""
    from ..experts.tokenizer import load_tokenizer

    folder = _model_dir(model_dir)
    tok = load_tokenizer(folder)
    if tok is not None:
        return [tok.encode(text).ids for text in PROMPT_TEXTS]
    vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    bound = max(2, min(vocab, 256)) - 1
    return [[1 + (7 + 13 * k + 31 * i + (i * k) % 17) % bound for k in range(4 + i % 5)]
            for i in range(len(PROMPT_TEXTS))]


def held_out_chunk(model_dir: str | None, n_tokens: int = PPL_TOKENS) -> tuple[list[int], dict]:
    """The first `n_tokens` of the held-out split of the embedded model's training text (stdlib files whose
    crc32(relative path) % 20 == 0, concatenated with <|eos|> between files, as ops/train_demo.py builds it)."""
    from ..experts.tokenizer import load_tokenizer

    source = "expertmesh.ops.train_demo.load_corpus"
    try:
        from .train_demo import load_corpus

        _, held, root = load_corpus()
    except Exception:  # not importable here (e.g. transformers missing): the same split, replicated
        held, root = _held_out_texts()
        source = "replicated split (crc32(relative path) % 20 == 0)"
    tok = load_tokenizer(_model_dir(model_dir))
    if tok is None:
        raise ValueError("perplexity: the checkpoint has no tokenizer.json")
    eos = tok.token_to_id("<|eos|>")
    ids: list[int] = []
    for text in held:
        ids.extend(tok.encode(text).ids)
        if eos is not None:
            ids.append(eos)
        if len(ids) >= n_tokens:
            break
    ids = ids[: n_tokens // PPL_WINDOW * PPL_WINDOW]
    return ids, {"source": source, "stdlib_path": str(root), "held_out_files": len(held), "tokens": len(ids),
                 "window": PPL_WINDOW, "python": platform.python_version()}


def _held_out_texts() -> tuple[list[str], Path]:
    import sysconfig
    import zlib

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    held: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if skip & set(rel.parts[:-1]) or path.stat().st_size > 200_000:
            continue
        if zlib.crc32(rel.as_posix().encode()) % 20 == 0:
            held.append(path.read_text(encoding="utf-8", errors="replace"))
    return held, root


# -------------------------------------------------------------------------------------------- server / Ray


# ------------------------------------------------------------------------------------------------ records


@dataclass
class _Request:
    worker: int
    prompt: int
    start: float
    end: float = 0.0
    code: str = "OK"
    tokens: list[int] = field(default_factory=list)
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, tokens in the message)
    degraded: int = 0
    finish_reason: str | None = None


@dataclass
class _Poll:
    t: float  # when the answer came (a call can take seconds while a replica is restoring)
    ok: bool
    sent: float = 0.0
    live: int = 0
    expected: int = 0
    controller_alive: bool | None = None
    epoch: int | None = None
    nodes: dict = field(default_factory=dict)  # actor -> node id (alive replicas)
    generations: dict = field(default_factory=dict)  # actor -> generation (alive replicas)
    alive: dict = field(default_factory=dict)  # actor -> alive and not restoring (serving)
    router_replica: str | None = None
    degraded_slots: int | None = None
    error: str | None = None


@dataclass
class _Kill:
    index: int
    mode: str
    t: float
    targets: list[str]
    note: str = ""
    # filled in while running (router / controller / node)
    pre_nodes: dict = field(default_factory=dict)
    pre_generations: dict = field(default_factory=dict)
    pre_epoch: int | None = None
    recreated_t: float | None = None
    error: str | None = None
    scheduled_t: float | None = None


# --------------------------------------------------------------------------------------------------- drill


class _Drill:
    def __init__(self, opts: dict, target: str, prompts: list[list[int]], cluster, owns_cluster: bool,
                 ray_connected: bool, ppl_ids: list[int] | None, verbose: bool):
        self.o = opts
        self.target = target
        self.prompts = prompts
        self.warm_requests: list[_Request] = []
        self.cluster = cluster
        self.owns_cluster = owns_cluster
        self.ray_connected = ray_connected
        self.ppl_ids = ppl_ids
        self.verbose = verbose
        self.rng = random.Random(opts["seed"])
        self.requests: list[_Request] = []
        self.polls: list[_Poll] = []
        self.events: dict[tuple, dict] = {}  # (time, kind, actor) -> event, accumulated over controller lives
        self.kills: list[_Kill] = []
        self.ppl_passes: list[dict] = []
        self.stop_load = asyncio.Event()
        self.stop_side = asyncio.Event()
        self.t0 = self.fault_start = self.fault_end = self.load_end = 0.0
        self.removed_nodes: set[str] = set()
        self.watchers: list[asyncio.Task] = []
        self.ray_at_end: dict | None = None

    # ---- load --------------------------------------------------------------------------------------------

    def _request(self, index: int) -> pb.GenerateRequest:
        request = pb.GenerateRequest(max_tokens=self.o["max_tokens"], temperature=0.0, ignore_eos=True)
        request.token_ids.ids.extend(self.prompts[index])
        return request

    async def _one(self, worker: int, index: int) -> _Request:
        rec = _Request(worker=worker, prompt=index, start=time.time())
        try:
            async for message in self.stub.Generate(self._request(index), timeout=REQUEST_TIMEOUT_S):
                if message.HasField("token"):
                    rec.chunks.append((time.time(), len(message.token.token_ids)))
                    rec.tokens.extend(message.token.token_ids)
                else:
                    rec.finish_reason = message.done.finish_reason
                    rec.degraded = message.done.routing.degraded_tokens
        except grpc.RpcError as exc:
            code = exc.code() if callable(getattr(exc, "code", None)) else None
            rec.code = code.name if code is not None else type(exc).__name__
        except asyncio.CancelledError:  # the drill stopped waiting for it (still running STOP_GRACE_S after the end)
            rec.code = "HUNG_AT_END"
            rec.end = time.time()
            self.requests.append(rec)
            raise
        except Exception as exc:  # a stream must never take the drill down
            rec.code = type(exc).__name__
        rec.end = time.time()
        return rec

    async def _worker(self, worker: int) -> None:
        k = 0
        n = len(self.prompts)
        while not self.stop_load.is_set():
            index = (worker + k * self.o["concurrency"]) % n if n > self.o["concurrency"] else (worker + k) % n
            k += 1
            rec = await self._one(worker, index)
            self.requests.append(rec)
            if rec.code != "OK":
                await asyncio.sleep(FAILURE_BACKOFF_S)

    # ---- observation -------------------------------------------------------------------------------------

    async def _poll_once(self) -> _Poll:
        sent = time.time()
        try:
            state = await self.admin.GetClusterState(admin_pb2.ClusterStateRequest(), timeout=10)
        except grpc.RpcError as exc:
            code = exc.code() if callable(getattr(exc, "code", None)) else None
            return _Poll(t=time.time(), sent=sent, ok=False,
                         error=code.name if code is not None else type(exc).__name__)
        poll = _Poll(t=time.time(), sent=sent, ok=True, expected=len(state.replicas),
                     controller_alive=state.controller_alive, epoch=state.epoch, router_replica=state.router.replica,
                     degraded_slots=state.router.degraded_slots)
        for rep in state.replicas:
            # A replica the controller is still restoring can answer `info` before the call ends: not serving yet.
            serving = rep.alive and not rep.restoring
            poll.alive[rep.actor] = serving
            if serving:
                poll.live += 1
                poll.nodes[rep.actor] = rep.node_id
                poll.generations[rep.actor] = rep.generation
        for ev in state.events:
            self.events.setdefault((round(ev.time, 6), ev.kind, ev.actor),
                                   {"t": ev.time, "kind": ev.kind, "actor": ev.actor,
                                    "detail": json.loads(ev.detail_json or "{}")})
        self.policy = state.no_replica_policy or getattr(self, "policy", None)
        return poll

    async def _poller(self) -> None:
        while not self.stop_side.is_set():
            started = time.time()
            self.polls.append(await self._poll_once())
            await asyncio.sleep(max(0.0, POLL_EVERY_S - (time.time() - started)))

    def _last_good_poll(self) -> _Poll | None:
        return next((p for p in reversed(self.polls) if p.ok), None)

    # ---- perplexity --------------------------------------------------------------------------------------

    async def _ppl_pass(self) -> dict:
        started = time.time()
        nll, n, errors = 0.0, 0, Counter()
        ids = self.ppl_ids
        for w in range(0, len(ids), PPL_WINDOW):
            window = ids[w:w + PPL_WINDOW]
            try:
                resp = await self.stub.Score(pb.ScoreRequest(token_ids=window, log_probs=True),
                                             timeout=REQUEST_TIMEOUT_S)
            except grpc.RpcError as exc:
                errors[exc.code().name if callable(getattr(exc, "code", None)) else type(exc).__name__] += 1
                continue
            vocab = resp.vocab_size
            values = resp.values
            for i in range(len(window) - 1):
                nll -= values[i * vocab + window[i + 1]]
                n += 1
        ended = time.time()
        return {"start": started, "end": ended, "tokens_scored": n, "windows": len(ids) // PPL_WINDOW,
                "failed_windows": dict(errors), "nll": nll / n if n else None,
                "perplexity": math.exp(nll / n) if n else None}

    async def _perplexity(self) -> None:
        """Back-to-back passes for the whole run, so baseline and fault-phase latencies carry the same Score load
        (a Score call holds the router's batcher for its forward). Phases are assigned in the report."""
        while not self.stop_side.is_set():
            self.ppl_passes.append({"phase": None, **await self._ppl_pass()})
            await asyncio.sleep(1.0)

    # ---- faults ------------------------------------------------------------------------------------------

    def _live_experts(self) -> list[str]:
        poll = self._last_good_poll()
        alive = {a for a, up in poll.alive.items() if up} if poll else set()
        if self.ray_connected:
            import ray

            registered = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                          if a.get("namespace") == NAMESPACE and EXPERT_ACTOR.fullmatch(a["name"])}
            alive = alive & registered if alive else registered
        return sorted(alive)

    def _prewarm_ray(self) -> None:
        import ray

        names = self._live_experts()
        if names:
            ray.get_actor(names[0], namespace=NAMESPACE)
        try:
            ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
        except ValueError:
            pass

    def _kill_experts(self, names: list[str]) -> tuple[float, str]:
        if not self.ray_connected:  # attached without --address: through the Admin API (the controller kills)
            t = time.time()
            chan = grpc.insecure_channel(self.target)
            try:
                stub = admin_pb2_grpc.AdminStub(chan)
                notes = [stub.KillReplica(admin_pb2.ReplicaRequest(actor=n), timeout=15).message for n in names]
            finally:
                chan.close()
            return t, "; ".join(notes)
        import ray

        handles = []
        for name in names:
            try:
                handles.append(ray.get_actor(name, namespace=NAMESPACE))
            except ValueError:
                pass
        t = time.time()
        for handle in handles:
            ray.kill(handle, no_restart=True)
        return t, ""

    def _kill_router(self) -> tuple[float, list[str], str]:
        import ray

        replicas = sorted((a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
                          if "SERVE_REPLICA" in a["name"] and "router" in a["name"])
        if not replicas:
            raise RuntimeError("no router replica registered at the tick (the replacement is not up yet)")
        name, namespace = self.rng.choice(replicas)
        handle = ray.get_actor(name, namespace=namespace)
        t = time.time()
        ray.kill(handle, no_restart=True)
        return t, [name], f"{len(replicas)} router replica(s) before the kill"

    def _kill_controller(self, kill: _Kill) -> str | None:
        """Kill the controller; returns its actor id (None when there was none to kill)."""
        import ray

        try:
            old = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
        except ValueError:
            kill.error = "no controller registered at the tick (not recreated since an earlier kill?)"
            return None
        old_id = old._actor_id.hex()
        kill.t = time.time()
        ray.kill(old, no_restart=True)
        return old_id

    def _wait_controller(self, kill: _Kill, old_id: str, limit_s: float = 120.0) -> None:
        """Until a controller with another actor id is registered (the serve process recreates it)."""
        import ray

        deadline = kill.t + limit_s
        while time.time() < deadline and not self.stop_side.is_set():
            try:
                if ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)._actor_id.hex() != old_id:
                    kill.recreated_t = time.time()
                    return
            except ValueError:
                pass
            time.sleep(0.1)

    def _kill_node(self, kill: _Kill) -> None:
        poll = self._last_good_poll()
        on_node: dict[str, list[str]] = {}
        for actor, node in (poll.nodes if poll else {}).items():
            on_node.setdefault(node, []).append(actor)
        workers = [w for w in self.cluster.worker_nodes if w.node_id not in self.removed_nodes]
        candidates = [w for w in workers if on_node.get(w.node_id)] or workers
        if not candidates:
            kill.note = "no worker node left to remove"
            return
        node = self.rng.choice(sorted(candidates, key=lambda w: w.node_id))
        kill.targets = sorted(on_node.get(node.node_id, []))
        kill.note = f"node {node.node_id[:12]} with {len(kill.targets)} expert actors"
        kill.t = time.time()
        self.cluster.remove_node(node, allow_graceful=False)
        self.removed_nodes.add(node.node_id)

    async def _do_kill(self, index: int) -> _Kill | None:
        mode = self.o["kill"]
        poll = self._last_good_poll()
        kill = _Kill(index=index, mode=mode, t=time.time(), targets=[],
                     pre_nodes=dict(poll.nodes) if poll else {},
                     pre_generations=dict(poll.generations) if poll else {},
                     pre_epoch=poll.epoch if poll else None)
        if mode in ("actor", "fraction"):
            live = await asyncio.to_thread(self._live_experts)
            if not live:
                return None
            count = 1 if mode == "actor" else max(1, round(self.o["fraction"] * len(live)))
            kill.targets = sorted(self.rng.sample(live, min(count, len(live))))
            kill.t, kill.note = await asyncio.to_thread(self._kill_experts, kill.targets)
        elif mode == "router":
            kill.t, kill.targets, kill.note = await asyncio.to_thread(self._kill_router)
        elif mode == "controller":
            kill.targets = [CONTROLLER_NAME]
            old_id = await asyncio.to_thread(self._kill_controller, kill)
            if old_id is not None:
                self.watchers.append(asyncio.create_task(asyncio.to_thread(self._wait_controller, kill, old_id)))
        elif mode == "node":
            if self.removed_nodes:
                return None  # a node goes only once
            await asyncio.to_thread(self._kill_node, kill)
        return kill

    async def _faults(self) -> None:
        every, duration = self.o["every"], self.o["duration"]
        ticks = [self.fault_start + k * every for k in range(int(duration // every) + 1)
                 if k * every + every <= duration + 1e-9] or [self.fault_start]
        for index, tick in enumerate(ticks):
            await asyncio.sleep(max(0.0, tick - time.time()))
            if self.stop_side.is_set():
                return
            try:
                kill = await self._do_kill(index)
            except Exception as exc:  # record and go on: one failed kill must not end the drill
                kill = _Kill(index=index, mode=self.o["kill"], t=time.time(), targets=[],
                             error=f"{type(exc).__name__}: {exc}"[:300])
            if kill is not None:
                self.kills.append(kill)
            if self.kills and self.kills[-1].index == index:
                self.kills[-1].scheduled_t = tick
            last = self.kills[-1] if self.kills else None
            if last is not None and last.index == index:
                _say(self.verbose, f"kill {index}: {last.mode} {', '.join(last.targets) or '-'} {last.note}"
                                   f"{' ERROR ' + last.error if last.error else ''}")

    # ---- recovery ----------------------------------------------------------------------------------------

    def _event_after(self, kind: str, actor: str, after: float, before: float | None = None) -> dict | None:
        hits = sorted((e for e in self.events.values() if e["kind"] == kind and e["actor"] == actor
                       and e["t"] >= after - 0.05 and (before is None or e["t"] < before)), key=lambda e: e["t"])
        return hits[0] if hits else None

    def _next_kill_of(self, kill: _Kill, actor: str) -> float | None:
        later = [k.t for k in self.kills if k.t > kill.t and actor in k.targets]
        return min(later) if later else None

    def _restore_seen_by_poll(self, kill: _Kill, actor: str) -> float | None:
        """First poll after the kill that shows the actor alive again as a new generation."""
        before = kill.pre_generations.get(actor, 0)
        for poll in self.polls:
            if poll.ok and poll.sent > kill.t and poll.alive.get(actor) and poll.generations.get(actor, 0) > before:
                return poll.t
        return None

    def _kill_recovery(self, kill: _Kill) -> dict:
        """Per kill: detect / restore seconds (expert kills), or recovery seconds (router, controller)."""
        out: dict = {"index": kill.index, "mode": kill.mode, "t_s": _r(kill.t - self.t0), "targets": kill.targets,
                     "late_s": _r(kill.t - kill.scheduled_t) if kill.scheduled_t else None, "note": kill.note,
                     "error": kill.error}
        if kill.error:
            out["recovered_at"] = None
            return out
        if kill.mode in ("actor", "fraction", "node"):
            per_actor = {}
            done_at: list[float | None] = []
            for actor in kill.targets:
                nxt = self._next_kill_of(kill, actor)
                lost = self._event_after("lost", actor, kill.t, nxt)
                restored = self._event_after("restored", actor, lost["t"] if lost else kill.t, nxt)
                failed = self._event_after("restore_failed", actor, kill.t, nxt)
                polled = self._restore_seen_by_poll(kill, actor)
                per_actor[actor] = {
                    "detect_s": _r(lost["t"] - kill.t) if lost else None,
                    "restore_s": _r(restored["t"] - kill.t) if restored else None,
                    "controller_restore_work_s": restored["detail"].get("seconds") if restored else None,
                    "restored_on_node": (restored["detail"].get("node_id") or "")[:12] if restored else None,
                    "same_node": (restored["detail"].get("node_id") == kill.pre_nodes.get(actor))
                    if restored else None,
                    "restore_failed": failed["detail"].get("error") if failed else None,
                    "alive_again_in_poll_s": _r(polled - kill.t) if polled else None,
                }
                done_at.append(restored["t"] if restored else None)
            out["actors"] = per_actor
            detects = [a["detect_s"] for a in per_actor.values() if a["detect_s"] is not None]
            restores = [a["restore_s"] for a in per_actor.values()]
            out["detect_s"] = max(detects) if detects else None
            out["restore_s"] = None if not restores or None in restores else max(restores)
            out["recovered_at"] = None if not done_at or None in done_at else max(done_at)
        elif kill.mode == "router":
            ok = [r for r in self.requests if r.start >= kill.t and r.code == "OK"]
            first = min(ok, key=lambda r: r.end) if ok else None
            failed_after = [r for r in self.requests if r.code != "OK" and r.end >= kill.t
                            and (first is None or r.end <= first.end)]
            out["first_success_s"] = _r(first.end - kill.t) if first else None
            out["restore_s"] = out["first_success_s"]
            out["failed_until_success"] = dict(Counter(r.code for r in failed_after))
            out["recovered_at"] = first.end if first else None
            before = [p.router_replica for p in self.polls if p.ok and p.t < kill.t]
            after = [p.router_replica for p in self.polls if p.ok and p.sent > kill.t]
            out["router_replica_before"] = before[-1] if before else None
            out["router_replica_after"] = after[0] if after else None  # the first poll answered after the kill
        elif kill.mode == "controller":
            polls_after = [p for p in self.polls if p.ok and p.sent > kill.t]
            saw_down = any(p.controller_alive is False for p in polls_after)
            back = None
            if kill.recreated_t is not None:
                back = next((p for p in polls_after if p.sent >= kill.recreated_t and p.controller_alive), None)
            out["recreated_s"] = _r(kill.recreated_t - kill.t) if kill.recreated_t else None
            out["reported_alive_s"] = _r(back.t - kill.t) if back else None
            out["restore_s"] = out["reported_alive_s"]
            out["saw_controller_down_in_poll"] = saw_down
            out["recovered_at"] = back.t if back else None
            if back is not None:
                out["placement_unchanged"] = kill.pre_nodes == back.nodes
                out["generations_unchanged"] = kill.pre_generations == back.generations
                out["epoch_before"], out["epoch_after"] = kill.pre_epoch, back.epoch
                end = self._last_good_poll()
                out["placement_unchanged_at_end"] = kill.pre_nodes == end.nodes if end else None
                lost_later = [e for e in self.events.values() if e["t"] >= kill.t and e["kind"] == "lost"]
                out["lost_events_after_kill"] = len(lost_later)
        return out

    def _all_recovered(self) -> tuple[bool, float | None]:
        times = []
        for kill in self.kills:
            rec = self._kill_recovery(kill)
            if kill.error:
                continue
            if rec.get("recovered_at") is None:
                return False, None
            times.append(rec["recovered_at"])
        return True, max(times) if times else None

    # ---- run ---------------------------------------------------------------------------------------------

    async def run(self) -> None:
        o = self.o
        options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        async with grpc.aio.insecure_channel(self.target, options=options) as chan:
            await asyncio.wait_for(chan.channel_ready(), 60)
            self.stub = inference_pb2_grpc.InferenceStub(chan)
            self.admin = admin_pb2_grpc.AdminStub(chan)
            first = await self._poll_once()
            if not first.ok:
                raise RuntimeError(f"GetClusterState failed on {self.target}: {first.error}")
            self.polls.append(first)
            if self.ray_connected:  # the first Ray lookups of a driver are slow; pay for them before the clock runs
                await asyncio.to_thread(self._prewarm_ray)
            _say(self.verbose, f"warm-up: {o['concurrency']} streams ...")
            # Warm up with every prompt once (at most `concurrency` at a time): each prompt then has a fault-free
            # output to compare against even if the baseline phase is too short to reach it.
            gate = asyncio.Semaphore(o["concurrency"])

            async def warm_one(index: int) -> _Request:
                async with gate:
                    return await self._one(index % o["concurrency"], index)

            warm = await asyncio.gather(*(warm_one(i) for i in range(len(self.prompts))))
            self.warm_requests = list(warm)
            self.warmup = {"requests": len(warm), "failed": sum(r.code != "OK" for r in warm),
                           "seconds": _r(max(r.end for r in warm) - min(r.start for r in warm))}
            self.t0 = time.time()
            self.fault_start_planned = self.t0 + o["baseline"]
            _say(self.verbose, f"baseline {o['baseline']} s with {o['concurrency']} streams ...")
            workers = [asyncio.create_task(self._worker(i)) for i in range(o["concurrency"])]
            side = [asyncio.create_task(self._poller())]
            if self.ppl_ids is not None:
                side.append(asyncio.create_task(self._perplexity()))
            try:
                await asyncio.sleep(max(0.0, self.fault_start_planned - time.time()))
                self.fault_start = time.time()
                _say(self.verbose, f"faults: kill {o['kill']} every {o['every']} s for {o['duration']} s ...")
                faults = asyncio.create_task(self._faults())
                side.append(faults)
                await asyncio.sleep(max(0.0, self.fault_start + o["duration"] - time.time()))
                self.fault_end = time.time()
                await faults
                # Keep the load on until every kill recovered (bounded), then a short tail.
                settle_deadline = self.fault_end + SETTLE_MAX_S
                recovered, last = self._all_recovered()
                while not recovered and time.time() < settle_deadline:
                    await asyncio.sleep(0.5)
                    recovered, last = self._all_recovered()
                if not recovered:
                    _say(self.verbose, "not every kill recovered within the settle time")
                tail_end = (last or time.time()) + TAIL_S
                await asyncio.sleep(max(0.0, min(tail_end, settle_deadline + TAIL_S) - time.time()))
                _say(self.verbose, "stopping the load ...")
                self.stop_load.set()
                _, hung = await asyncio.wait(workers, timeout=STOP_GRACE_S)
                for task in hung:  # recorded as HUNG_AT_END by _one
                    task.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                self.load_end = time.time()
            finally:
                self.stop_load.set()
                self.stop_side.set()
                for task in workers + side + self.watchers:
                    if not task.done():
                        task.cancel()
                await asyncio.gather(*workers, *side, *self.watchers, return_exceptions=True)
            self.polls.append(await self._poll_once())  # final state
            self.ray_at_end = await asyncio.to_thread(self._ray_snapshot) if self.ray_connected else None

    def _ray_snapshot(self) -> dict | None:
        """Named actors that are neither alive nor dead (e.g. a restore Ray cannot place), and free CPUs."""
        import ray

        try:
            actors = ray._private.state.actors()  # GCS directly; the public state API needs the dashboard
            stuck = sorted(f"{a.get('Name')}: {a.get('State')}" for a in actors.values()
                           if a.get("Name") and a.get("State") not in ("ALIVE", "DEAD"))
            return {"not_alive_named_actors": stuck, "available_cpus": ray.available_resources().get("CPU", 0.0),
                    "alive_nodes": sum(1 for n in ray.nodes() if n["Alive"])}
        except Exception as exc:  # internal API: diagnostics only
            return {"error": f"{type(exc).__name__}: {exc}"[:200]}

    # ---- report ------------------------------------------------------------------------------------------

    def report(self) -> dict:
        o = self.o
        kills = [self._kill_recovery(k) for k in self.kills]
        recovered_times = [k.get("recovered_at") for k in kills if not k.get("error")]
        if recovered_times and None not in recovered_times:
            after_from = max(recovered_times)
        else:
            after_from = self.load_end
        after_from = max(after_from, self.fault_start)

        def phase(r: _Request) -> str:  # a request in flight at any moment of the fault window belongs to it
            if r.end < self.fault_start:
                return "baseline"
            return "faults" if r.start < after_from else "after"

        reqs = self.requests
        failed = [r for r in reqs if r.code != "OK"]
        by_phase: dict[str, dict] = {}
        for name in ("baseline", "faults", "after"):
            in_phase = [r for r in reqs if phase(r) == name]
            by_phase[name] = {"sent": len(in_phase), "succeeded": sum(r.code == "OK" for r in in_phase),
                              "failed_by_code": dict(Counter(r.code for r in in_phase if r.code != "OK"))}
        latency = {name: _latency([r.end - r.start for r in reqs if r.code == "OK" and phase(r) == name])
                   for name in ("baseline", "faults", "after")}

        # Reference output per prompt: the most common fault-free output (baseline, else the warm-up).
        refs: dict[int, tuple] = {}
        base_ok = [r for r in reqs if r.code == "OK" and phase(r) == "baseline"]
        warm_ok = [r for r in self.warm_requests if r.code == "OK"]
        for index in range(len(self.prompts)):
            outs = Counter(tuple(r.tokens) for r in base_ok if r.prompt == index) or \
                Counter(tuple(r.tokens) for r in warm_ok if r.prompt == index)
            if outs:
                refs[index] = outs.most_common(1)[0][0]
        mismatch_by_phase: Counter = Counter()
        examples = []
        unverified = 0
        for r in reqs:
            if r.code != "OK":
                continue
            if r.prompt not in refs:
                unverified += 1
                continue
            if tuple(r.tokens) != refs[r.prompt]:
                mismatch_by_phase[phase(r)] += 1
                if len(examples) < 5:
                    examples.append({"prompt": r.prompt, "phase": phase(r), "t_s": _r(r.start - self.t0),
                                     "degraded": r.degraded, "got": r.tokens, "want": list(refs[r.prompt])})
        mismatches = sum(v for k, v in mismatch_by_phase.items() if k != "baseline")

        ok_polls = [p for p in self.polls if p.ok]
        expected = max((p.expected for p in ok_polls), default=0)
        degraded_slots = [p.degraded_slots for p in ok_polls if p.degraded_slots is not None]
        policy = getattr(self, "policy", None) or o.get("no_replica_policy")

        ppl = None
        if self.ppl_ids is not None:
            for p in self.ppl_passes:
                p["phase"] = ("baseline" if p["end"] < self.fault_start
                              else "faults" if p["start"] < after_from else "after")
            base = [p for p in self.ppl_passes if p["phase"] == "baseline" and p["perplexity"] is not None]
            fault = [p for p in self.ppl_passes if p["phase"] == "faults" and p["perplexity"] is not None]
            after = [p for p in self.ppl_passes if p["phase"] == "after" and p["perplexity"] is not None]
            outages = [(kill.t, rec.get("recovered_at") or self.load_end) for kill, rec in zip(self.kills, kills)]
            during_outage = [p for p in fault if any(p["start"] < b and p["end"] > a for a, b in outages)]
            inside_outage = [p for p in fault if any(a <= p["start"] and p["end"] <= b for a, b in outages)]
            ppl = {
                **(self.ppl_info or {}),
                "baseline": _r(sum(p["perplexity"] for p in base) / len(base)) if base else None,
                "baseline_passes": len(base),
                "during_faults_mean": _r(sum(p["perplexity"] for p in fault) / len(fault)) if fault else None,
                "during_faults_max": _r(max((p["perplexity"] for p in fault), default=None)),
                "after_mean": _r(sum(p["perplexity"] for p in after) / len(after)) if after else None,
                "during_outage_mean": _r(sum(p["perplexity"] for p in during_outage) / len(during_outage))
                if during_outage else None,
                "inside_outage_mean": _r(sum(p["perplexity"] for p in inside_outage) / len(inside_outage))
                if inside_outage else None,
                "passes": [{"phase": p["phase"], "t_s": _r(p["start"] - self.t0), "seconds": _r(p["end"] - p["start"]),
                            "perplexity": _r(p["perplexity"]), "tokens_scored": p["tokens_scored"],
                            "failed_windows": p["failed_windows"],
                            "overlaps_outage": any(p["start"] < b and p["end"] > a for a, b in outages),
                            "inside_outage": any(a <= p["start"] and p["end"] <= b for a, b in outages)}
                           for p in self.ppl_passes],
                "training_report_held_out_perplexity": self._training_ppl(),
            }

        base_p99 = latency["baseline"]["p99_s"]
        fault_p99 = latency["faults"]["p99_s"]
        restore_values = [k.get("restore_s") for k in kills if not k.get("error")]
        targets = {
            "zero_failed_requests": {"value": len(failed), "met": len(failed) == 0, "applicable": True},
            "identical_greedy_outputs": {
                "value": mismatches, "met": mismatches == 0 and unverified == 0,
                "applicable": policy == "wait",
                "note": "only meaningful with the wait policy" if policy != "wait" else "",
            },
            "restored_within_15s": {
                "value": max((v for v in restore_values if v is not None), default=None),
                "met": bool(restore_values) and None not in restore_values
                and max(restore_values) <= RESTORE_TARGET_S,
                "applicable": bool(restore_values),
            },
            "p99_during_faults_le_3x_baseline": {
                "value": _r(fault_p99 / base_p99) if base_p99 and fault_p99 is not None else None,
                "met": bool(base_p99 and fault_p99 is not None and fault_p99 <= P99_FACTOR * base_p99),
                "applicable": True,
            },
        }
        if o["kill"] == "router":
            # The target for a router kill: Serve replaces it and new requests succeed within 30 s. Streams
            # in flight on the killed replica fail by nature (with one router replica, so does everything until
            # the replacement is up); run --router-replicas 2 behind it to avoid that.
            note = "not a target for router kills: in-flight streams on the killed replica fail"
            for name in ("zero_failed_requests", "restored_within_15s", "p99_during_faults_le_3x_baseline"):
                targets[name]["applicable"] = False
                targets[name]["note"] = note
            worst = max((v for v in restore_values if v is not None), default=None)
            targets["new_requests_succeed_within_30s"] = {
                "value": worst, "met": bool(restore_values) and None not in restore_values
                and worst <= ROUTER_TARGET_S, "applicable": bool(restore_values),
            }
        all_met = all(t["met"] for t in targets.values() if t["applicable"])
        total_tokens = sum(len(r.tokens) for r in reqs)
        return {
            "drill": {k: o[k] for k in ("kill", "every", "duration", "baseline", "concurrency", "max_tokens",
                                         "replicas_per_expert", "no_replica_policy", "model", "nodes", "fraction",
                                         "seed")} | {"self_started": o["self_started"], "target": self.target,
                                                     "address": o.get("address"), "server_policy": policy},
            "phases_s": {"baseline": [0.0, _r(self.fault_start - self.t0)],
                         "faults": [_r(self.fault_start - self.t0), _r(after_from - self.t0)],
                         "after": [_r(after_from - self.t0), _r(self.load_end - self.t0)],
                         "fault_schedule_end": _r(self.fault_end - self.t0)},
            "warmup": self.warmup,
            "requests": {"sent": len(reqs), "succeeded": len(reqs) - len(failed), "failed": len(failed),
                         "failed_by_code": dict(Counter(r.code for r in failed)), "by_phase": by_phase},
            "tokens": {"generated": total_tokens, "degraded": sum(r.degraded for r in reqs),
                       # the router's own count over the run: Generate and Score (perplexity) slots, all layers
                       "router_degraded_slots_delta": (degraded_slots[-1] - degraded_slots[0])
                       if len(degraded_slots) > 1 else None,
                       "throughput_tokens_per_s": _r(total_tokens / (self.load_end - self.t0))
                       if self.load_end > self.t0 else None},
            "outputs": {"prompts": len(self.prompts), "prompts_with_reference": len(refs),
                        "compared": sum(1 for r in reqs if r.code == "OK" and r.prompt in refs
                                        and phase(r) != "baseline"),
                        "mismatches": mismatches, "mismatches_by_phase": dict(mismatch_by_phase),
                        "unverified": unverified, "examples": examples},
            "latency_s": latency,
            "kills": [{k2: v for k2, v in k.items() if k2 != "recovered_at"}
                      | {"recovered_at_s": _r(k["recovered_at"] - self.t0) if k.get("recovered_at") else None}
                      for k in kills],
            "cluster": {"replicas_expected": expected,
                        "min_live_replicas": min((p.live for p in ok_polls), default=None),
                        "polls": len(self.polls), "failed_polls": dict(Counter(p.error for p in self.polls
                                                                               if not p.ok)),
                        "controller_down_polls": sum(1 for p in ok_polls if p.controller_alive is False),
                        "router_replicas_seen": sorted({p.router_replica for p in ok_polls if p.router_replica}),
                        "events_by_kind": dict(Counter(e["kind"] for e in self.events.values()
                                                       if e["t"] >= self.t0)),
                        "ray_at_end": self.ray_at_end,
                        "epoch_start": ok_polls[0].epoch if ok_polls else None,
                        "epoch_end": ok_polls[-1].epoch if ok_polls else None,
                        "events": [{"t_s": _r(e["t"] - self.t0), "kind": e["kind"], "actor": e["actor"],
                                    **e["detail"]}
                                   for e in sorted(self.events.values(), key=lambda e: e["t"])
                                   if e["t"] >= self.t0][-300:]},
            "perplexity": ppl,
            "targets": targets,
            "all_targets_met": all_met,
        }

    def _training_ppl(self) -> float | None:
        try:
            report = json.loads((_model_dir(self.o["model"]) / "training_report.json").read_text())
            return report["evaluation"]["held_out_perplexity"]
        except Exception:
            return None

    # ---- timeline ----------------------------------------------------------------------------------------

    def timeline(self) -> dict:
        end = max(self.load_end, self.t0 + 1)
        n = int(math.ceil(end - self.t0))
        tokens = [0] * n
        latencies: list[list[float]] = [[] for _ in range(n)]
        failures = [0] * n
        for r in self.requests:
            for t, count in r.chunks:
                b = int(t - self.t0)
                if 0 <= b < n:
                    tokens[b] += count
            b = int(r.end - self.t0)
            if 0 <= b < n:
                if r.code == "OK":
                    latencies[b].append(r.end - r.start)
                else:
                    failures[b] += 1
        return {
            "t_s": list(range(n)),
            "tokens_per_s": tokens,
            "p99_latency_s": [_r(percentile(v, 99)) for v in latencies],
            "failures": failures,
            "live_replicas": [[_r(p.t - self.t0), p.live if p.ok else None] for p in self.polls],
            "live_replicas_from_events": self._live_from_events(),
            "controller_down_s": [_r(p.t - self.t0) for p in self.polls if p.ok and p.controller_alive is False],
            "perplexity": [[_r((p["start"] + p["end"]) / 2 - self.t0), _r(p["perplexity"])] for p in self.ppl_passes
                           if p["perplexity"] is not None],
            "kills_s": [[_r(k.t - self.t0), k.mode, ",".join(k.targets)] for k in self.kills],
            "recovery_windows_s": [[_r(k.t - self.t0), _r((rec.get("recovered_at") or self.load_end) - self.t0)]
                                   for k, rec in ((k, self._kill_recovery(k)) for k in self.kills) if not k.error],
        }

    def _live_from_events(self) -> list[list[float]]:
        """Expert replicas serving over time, from kill times and the controller's restored events: exact where a
        poll of GetClusterState is not (it can block for seconds on a replica that is still warming up)."""
        ok_polls = [p for p in self.polls if p.ok]
        expected = max((p.expected for p in ok_polls), default=0)
        changes: list[tuple[float, int]] = []
        for kill in self.kills:
            if kill.error or kill.mode not in ("actor", "fraction", "node"):
                continue
            rec = self._kill_recovery(kill)
            for info in rec.get("actors", {}).values():
                changes.append((kill.t, -1))
                if info["restore_s"] is not None:
                    changes.append((kill.t + info["restore_s"], +1))
        points = [[_r(ok_polls[0].t - self.t0) if ok_polls else 0.0, expected]]
        live = expected
        for t, delta in sorted(changes):
            live += delta
            points.append([_r(t - self.t0), live])
        points.append([_r(self.load_end - self.t0), live])
        return points


# -------------------------------------------------------------------------------------------------- output


def _plot(report: dict, timeline: dict, path: Path) -> None:
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


def _markdown(report: dict) -> str:
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
              f"{c['epoch_end']}.", "", "![timeline](drill_timeline.png)", ""]
    return "\n".join(lines)


def _human(report: dict) -> str:
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


# ---------------------------------------------------------------------------------------------------- entry


def run_drill(kill: str = "actor", every: float = 10.0, duration: float = 60.0, baseline: float = 15.0,
              concurrency: int = 8, max_tokens: int = 16, replicas_per_expert: int = 2,
              no_replica_policy: str = "wait", model_dir: str | None = None, nodes: int = 2, fraction: float = 0.25,
              seed: int = 0, target: str | None = None, address: str | None = None, out: str = "drill_out",
              num_cpus: int | None = None, verbose: bool = True) -> dict:
    """Run a failover drill and write drill_report.json / .md and drill_timeline.png into `out`; returns the
    report. Everything it started (server subprocess, Ray or Cluster) is stopped on return, error or Ctrl-C."""
    if kill not in KILL_MODES:
        raise ValueError(f"kill: must be one of {KILL_MODES}, got {kill!r}")
    if no_replica_policy not in ("wait", "degrade"):
        raise ValueError(f"no_replica_policy: must be wait or degrade, got {no_replica_policy!r}")
    for name, value in (("every", every), ("duration", duration), ("baseline", baseline)):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name}: must be a positive number of seconds, got {value}")
    if concurrency < 1 or max_tokens < 1 or replicas_per_expert < 1 or nodes < 1:
        raise ValueError("concurrency, max_tokens, replicas_per_expert and nodes must be >= 1")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction: must be in (0, 1], got {fraction}")
    if target is not None and kill in ("node", "router", "controller") and address is None:
        raise ValueError(f"address: --kill {kill} against --target needs --address (the drill kills through Ray)")
    if target is not None and kill == "node":
        raise ValueError("kill: node needs a cluster the drill started itself (no --target)")
    if target is None and address is not None:
        raise ValueError("address: give --target too, or neither (the drill then starts its own Ray)")

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    opts = {"kill": kill, "every": every, "duration": duration, "baseline": baseline, "concurrency": concurrency,
            "max_tokens": max_tokens, "replicas_per_expert": replicas_per_expert,
            "no_replica_policy": no_replica_policy, "model": model_dir, "nodes": nodes, "fraction": fraction,
            "seed": seed, "self_started": target is None, "address": address}
    started = time.time()
    server: ServerProcess | None = None
    cluster = None
    ray_connected = False
    prompts = make_prompts(model_dir)
    old_term = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        signal.signal(signal.SIGTERM, on_term)
    # Ray prints cluster-wide raylet warnings to the driver's sys.stdout; keep stdout for the caller's report.
    real_stdout = sys.stdout
    sys.stdout = sys.stderr
    try:
        import ray

        if target is None:
            cpus = num_cpus or max(2, os.cpu_count() or 2)
            if kill == "node":
                from ray.cluster_utils import Cluster

                _say(verbose, f"starting a Ray cluster: head (1 CPU) + {nodes} workers (2 CPUs each) ...")
                cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
                for _ in range(nodes):
                    cluster.add_node(num_cpus=2)
                cluster.wait_for_nodes()
                ray.init(address=cluster.address, namespace=NAMESPACE, logging_level=logging.WARNING,
                         log_to_driver=False)
                gcs = cluster.address
            else:
                _say(verbose, f"starting Ray ({cpus} CPUs) ...")
                ctx = ray.init(address="local", num_cpus=cpus, namespace=NAMESPACE, include_dashboard=False,
                               logging_level=logging.WARNING, log_to_driver=False)
                gcs = ctx.address_info["gcs_address"]
            ray_connected = True
            extra = ["--address", gcs, "--replicas-per-expert", str(replicas_per_expert),
                     "--no-replica-policy", no_replica_policy]
            if model_dir is not None:
                extra += ["--model", model_dir]
            _say(verbose, f"starting expertmesh serve {' '.join(extra)} ...")
            t_srv = time.time()
            server = start_server(extra, out_dir / "serve.log", new_session=True)
            target_addr = server.target
            _say(verbose, f"serving {server.model_name} on {target_addr} (ready after {time.time() - t_srv:.1f} s)")
        else:
            target_addr = target
            if address is not None:
                ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
                ray_connected = True

        ppl_ids, ppl_info = None, None
        policy = no_replica_policy
        if target is not None:
            with grpc.insecure_channel(target_addr) as chan:
                state = admin_pb2_grpc.AdminStub(chan).GetClusterState(admin_pb2.ClusterStateRequest(), timeout=30)
                policy = state.no_replica_policy or policy
        if policy == "degrade":
            _say(verbose, "preparing the held-out text for perplexity ...")
            ppl_ids, ppl_info = held_out_chunk(model_dir)

        drill = _Drill(opts, target_addr, prompts, cluster, cluster is not None, ray_connected, ppl_ids, verbose)
        drill.ppl_info = ppl_info
        drill.policy = policy
        asyncio.run(drill.run())
        report = drill.report()
        timeline = drill.timeline()
    finally:
        if server is not None:
            _say(verbose, "stopping the server ...")
            code = server.stop()
            _say(verbose, f"server exited with {code}")
        if ray_connected:
            import ray

            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        if in_main:
            signal.signal(signal.SIGTERM, old_term)
        sys.stdout = real_stdout

    report["server"] = {"exit_code": server.proc.returncode, "log": str(server.log_path)} if server else None
    report["timeline"] = timeline
    report["files"] = {"json": str(out_dir / "drill_report.json"), "markdown": str(out_dir / "drill_report.md"),
                       "png": str(out_dir / "drill_timeline.png")}
    report["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                         "python": platform.python_version()}
    report["wall_s"] = _r(time.time() - started)
    _plot(report, timeline, out_dir / "drill_timeline.png")
    (out_dir / "drill_report.md").write_text(_markdown(report))
    (out_dir / "drill_report.json").write_text(json.dumps(report, indent=2) + "\n")
    report["summary"] = _human(report)
    return report
