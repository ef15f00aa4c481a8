"""Running a drill: start (or attach to) Ray and a server, put greedy load on it, kill on a schedule, poll the
cluster -- and write down what happened as a DrillRecord. Scoring is ops/drill/report.py's job.

Timeline, all from one asyncio event loop (grpc.aio):

  warm-up | baseline (no faults)  | faults: a kill every `every` s for `duration` s | recovery tail
           C greedy Generate streams loop over a fixed set of prompts the whole time ------------------------->
           Admin.GetClusterState every 0.5 s (live replicas, controller events) ----------------------------->
           with the degrade policy: held-out perplexity through Score, in baseline and repeatedly after

After the schedule the load stays on until every kill has recovered (at most config.settle seconds), then TAIL_S more.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import platform
import random
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from ...cluster.naming import is_expert_actor_name
from ...protos import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from ...protos import inference_pb2 as pb
from ...router_service.admin_auth import admin_metadata
from ...router_service.ray_join import prepare_join
from ..server_process import ServerProcess, start_server
from .chaos import plan_chaos_tick
from .config import CLUSTER_KILLS, DrillConfig, serve_args
from .ray_start import FAST_HEALTH_CHECKS, leave_loopback_mode, start_local_ray, start_node_cluster
from .record import DrillRecord, KillRecord, PollRecord, RequestRecord
from .report import all_recovered, last_good_poll
from .resources import sample_tree
from .workload import PPL_WINDOW, held_out_chunk, make_prompts, training_perplexity

POLL_EVERY_S = 0.5
REQUEST_TIMEOUT_S = 120.0
FAILURE_BACKOFF_S = 0.25  # a client pauses this long after a failed request before its next one
TAIL_S = 5.0  # and then at least this long, so "after the last fault" has data
STOP_GRACE_S = 45.0  # when the load stops, in-flight requests get this long (> the server's 30 s wait timeout)


def say(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"[drill {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _code_name(exc: Exception) -> str:
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    return code.name if code is not None else type(exc).__name__


class _Drill:
    """One drill against a ready server: fills `self.rec` while it runs."""

    def __init__(self, config: DrillConfig, rec: DrillRecord, prompts: list[list[int]], cluster,
                 ray_connected: bool, ppl_ids: list[int] | None, verbose: bool):
        self.o = config
        self.rec = rec
        self.prompts = prompts
        self.cluster = cluster
        self.ray_connected = ray_connected
        self.ppl_ids = ppl_ids
        self.verbose = verbose
        self.rng = random.Random(config.seed)
        self.last_shards: list[list[str]] | None = None  # actors per (layer, expert) shard, from the last poll
        self.event_keys: set[tuple] = set()  # (time, kind, actor): each event once, over controller lives
        self.stop_load = asyncio.Event()
        self.stop_side = asyncio.Event()
        self.removed_nodes: set[str] = set()
        self.watchers: list[asyncio.Task] = []

    # ---- load --------------------------------------------------------------------------------------------

    def _request(self, index: int) -> pb.GenerateRequest:
        request = pb.GenerateRequest(max_tokens=self.o.max_tokens, temperature=0.0, ignore_eos=True)
        request.token_ids.ids.extend(self.prompts[index])
        return request

    async def _one(self, worker: int, index: int) -> RequestRecord:
        rec = RequestRecord(worker=worker, prompt=index, start=time.time())
        try:
            async for message in self.stub.Generate(self._request(index), timeout=REQUEST_TIMEOUT_S):
                if message.HasField("token"):
                    rec.chunks.append([time.time(), len(message.token.token_ids)])
                    rec.tokens.extend(message.token.token_ids)
                else:
                    rec.finish_reason = message.done.finish_reason
                    rec.degraded = message.done.routing.degraded_tokens
        except grpc.RpcError as exc:
            rec.code = _code_name(exc)
        except asyncio.CancelledError:  # the drill stopped waiting for it (still running STOP_GRACE_S after the end)
            rec.code = "HUNG_AT_END"
            rec.end = time.time()
            self.rec.requests.append(rec)
            raise
        except Exception as exc:  # a stream must never take the drill down
            rec.code = type(exc).__name__
        rec.end = time.time()
        return rec

    async def _worker(self, worker: int) -> None:
        k = 0
        n = len(self.prompts)
        concurrency = self.o.concurrency
        while not self.stop_load.is_set():
            index = (worker + k * concurrency) % n if n > concurrency else (worker + k) % n
            k += 1
            rec = await self._one(worker, index)
            self.rec.requests.append(rec)
            if rec.code != "OK":
                await asyncio.sleep(FAILURE_BACKOFF_S)

    # ---- observation -------------------------------------------------------------------------------------

    async def _poll_once(self) -> PollRecord:
        sent = time.time()
        try:
            state = await self.admin.GetClusterState(admin_pb2.ClusterStateRequest(), timeout=10)
        except grpc.RpcError as exc:
            return PollRecord(t=time.time(), sent=sent, ok=False, error=_code_name(exc))
        poll = PollRecord(t=time.time(), sent=sent, ok=True, expected=len(state.replicas),
                          controller_alive=state.controller_alive, epoch=state.epoch,
                          router_replica=state.router.replica, degraded_slots=state.router.degraded_slots,
                          kv_blocks_free=state.router.kv_blocks_free, kv_blocks_total=state.router.kv_blocks_total,
                          live_kv_caches=state.router.live_kv_caches)
        for rep in state.replicas:
            # A replica the controller is still restoring can answer `info` before the call ends: not serving yet.
            serving = rep.alive and not rep.restoring
            poll.alive[rep.actor] = serving
            if serving:
                poll.live += 1
                poll.nodes[rep.actor] = rep.node_id
                poll.generations[rep.actor] = rep.generation
        for ev in state.events:
            key = (round(ev.time, 6), ev.kind, ev.actor)
            if key not in self.event_keys:
                self.event_keys.add(key)
                self.rec.events.append({"t": ev.time, "kind": ev.kind, "actor": ev.actor,
                                        "detail": json.loads(ev.detail_json or "{}")})
        self.rec.policy = state.no_replica_policy or self.rec.policy
        self.last_shards = [list(shard.replicas) for shard in state.shards]  # chaos's disruption budget
        return poll

    async def _poller(self) -> None:
        while not self.stop_side.is_set():
            started = time.time()
            self.rec.polls.append(await self._poll_once())
            await asyncio.sleep(max(0.0, POLL_EVERY_S - (time.time() - started)))

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
                errors[_code_name(exc)] += 1
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
            self.rec.ppl_passes.append(await self._ppl_pass())
            await asyncio.sleep(1.0)

    # ---- faults ------------------------------------------------------------------------------------------

    def _live_experts(self) -> list[str]:
        poll = last_good_poll(self.rec.polls)
        alive = {a for a, up in poll.alive.items() if up} if poll else set()
        if self.ray_connected:
            import ray

            registered = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                          if a.get("namespace") == self.o.names.namespace and is_expert_actor_name(a["name"])}
            alive = alive & registered if alive else registered
        return sorted(alive)

    def _prewarm_ray(self) -> None:
        import ray

        names = self._live_experts()
        if names:
            ray.get_actor(names[0], namespace=self.o.names.namespace)
        try:
            ray.get_actor(self.o.names.controller, namespace=self.o.names.namespace)
        except ValueError:
            pass

    def _kill_experts(self, names: list[str]) -> tuple[float, str]:
        if not self.ray_connected:  # attached without --address: through the Admin API (the controller kills)
            t = time.time()
            chan = grpc.insecure_channel(self.rec.target)
            try:
                stub = admin_pb2_grpc.AdminStub(chan)
                # force: a drill kills on purpose, the last live replica of a shard included (the controller
                # restores it; the report shows what the policy did meanwhile).
                notes = [stub.KillReplica(admin_pb2.ReplicaRequest(actor=n, force=True), timeout=15,
                                          metadata=admin_metadata(self.o.admin_token)).message for n in names]
            finally:
                chan.close()
            return t, "; ".join(notes)
        import ray

        handles = []
        for name in names:
            try:
                handles.append(ray.get_actor(name, namespace=self.o.names.namespace))
            except ValueError:
                pass
        t = time.time()
        for handle in handles:
            ray.kill(handle, no_restart=True)
        return t, ""

    def _kill_router(self) -> tuple[float, list[str], str]:
        import ray

        replicas = sorted((a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
                          if self.o.names.is_router_replica(a["name"]))
        if not replicas:
            raise RuntimeError("no router replica registered at the tick (the replacement is not up yet)")
        name, namespace = self.rng.choice(replicas)
        handle = ray.get_actor(name, namespace=namespace)
        t = time.time()
        ray.kill(handle, no_restart=True)
        return t, [name], f"{len(replicas)} router replica(s) before the kill"

    def _kill_controller(self, kill: KillRecord) -> str | None:
        """Kill the controller; returns its actor id (None when there was none to kill)."""
        import ray

        try:
            old = ray.get_actor(self.o.names.controller, namespace=self.o.names.namespace)
        except ValueError:
            kill.error = "no controller registered at the tick (not recreated since an earlier kill?)"
            return None
        old_id = old._actor_id.hex()
        kill.t = time.time()
        ray.kill(old, no_restart=True)
        return old_id

    def _wait_controller(self, kill: KillRecord, old_id: str, limit_s: float = 120.0) -> None:
        """Until a controller with another actor id is registered (the serve process recreates it)."""
        import ray

        deadline = kill.t + limit_s
        while time.time() < deadline and not self.stop_side.is_set():
            try:
                if ray.get_actor(self.o.names.controller, namespace=self.o.names.namespace)._actor_id.hex() != old_id:
                    kill.recreated_t = time.time()
                    return
            except ValueError:
                pass
            time.sleep(0.1)

    def _kill_node(self, kill: KillRecord, node_id: str | None = None) -> None:
        """Remove a worker node: `node_id`, else a random one that hosts expert actors."""
        poll = last_good_poll(self.rec.polls)
        on_node: dict[str, list[str]] = {}
        for actor, node in (poll.nodes if poll else {}).items():
            on_node.setdefault(node, []).append(actor)
        workers = [w for w in self.cluster.worker_nodes if w.node_id not in self.removed_nodes]
        candidates = [w for w in workers if on_node.get(w.node_id)] or workers
        if node_id is not None:
            candidates = [w for w in workers if w.node_id == node_id]
        if not candidates:
            kill.note = "no worker node left to remove"
            return
        node = self.rng.choice(sorted(candidates, key=lambda w: w.node_id))
        kill.targets = sorted(on_node.get(node.node_id, []))
        kill.note = f"node {node.node_id[:12]} with {len(kill.targets)} expert actors"
        kill.t = time.time()
        self.cluster.remove_node(node, allow_graceful=False)
        self.removed_nodes.add(node.node_id)

    def _blank_kill(self, index: int, mode: str) -> KillRecord:
        poll = last_good_poll(self.rec.polls)
        return KillRecord(index=index, mode=mode, t=time.time(), targets=[],
                          pre_nodes=dict(poll.nodes) if poll else {},
                          pre_generations=dict(poll.generations) if poll else {},
                          pre_epoch=poll.epoch if poll else None)

    async def _kill_controller_async(self, kill: KillRecord) -> None:
        kill.targets = [self.o.names.controller]
        old_id = await asyncio.to_thread(self._kill_controller, kill)
        if old_id is not None:
            self.watchers.append(asyncio.create_task(asyncio.to_thread(self._wait_controller, kill, old_id)))

    async def _do_kill(self, index: int) -> list[KillRecord]:
        mode = self.o.kill
        if mode == "none":  # a soak: load and sampling only
            return []
        if mode == "chaos":
            return await self._chaos_tick(index)
        kill = self._blank_kill(index, mode)
        if mode in ("actor", "fraction"):
            live = await asyncio.to_thread(self._live_experts)
            if not live:
                return []
            count = 1 if mode == "actor" else max(1, round(self.o.fraction * len(live)))
            kill.targets = sorted(self.rng.sample(live, min(count, len(live))))
            kill.t, kill.note = await asyncio.to_thread(self._kill_experts, kill.targets)
        elif mode == "router":
            kill.t, kill.targets, kill.note = await asyncio.to_thread(self._kill_router)
        elif mode == "controller":
            await self._kill_controller_async(kill)
        elif mode == "node":
            if self.removed_nodes:
                return []  # a node goes only once
            await asyncio.to_thread(self._kill_node, kill)
        return [kill]

    async def _chaos_tick(self, index: int) -> list[KillRecord]:
        """ops/drill/chaos.py's plan for this tick, carried out at once: node, controller, then actors."""
        live = set(await asyncio.to_thread(self._live_experts))
        poll = last_good_poll(self.rec.polls)
        actors_on = {a: n for a, n in (poll.nodes if poll else {}).items() if a in live}
        workers = [w.node_id for w in self.cluster.worker_nodes]
        plan = plan_chaos_tick(index, actors_on, workers, self.removed_nodes, self.o.fraction, self.rng,
                               shards=self.last_shards)
        kills = []
        if plan.node is not None:
            kill = self._blank_kill(index, "node")
            await asyncio.to_thread(self._kill_node, kill, plan.node)
            kills.append(kill)
        if plan.controller:
            kill = self._blank_kill(index, "controller")
            await self._kill_controller_async(kill)
            kills.append(kill)
        if plan.actors:
            kill = self._blank_kill(index, "fraction")
            kill.targets = plan.actors
            kill.t, kill.note = await asyncio.to_thread(self._kill_experts, kill.targets)
            kills.append(kill)
        return kills

    async def _faults(self) -> None:
        every, duration = self.o.every, self.o.duration
        ticks = [self.rec.fault_start + k * every for k in range(int(duration // every) + 1)
                 if k * every + every <= duration + 1e-9] or [self.rec.fault_start]
        for index, tick in enumerate(ticks):
            await asyncio.sleep(max(0.0, tick - time.time()))
            if self.stop_side.is_set():
                return
            try:
                done = await self._do_kill(index)
            except Exception as exc:  # record and go on: one failed kill must not end the drill
                done = [KillRecord(index=index, mode=self.o.kill, t=time.time(), targets=[],
                                   error=f"{type(exc).__name__}: {exc}"[:300])]
            for kill in done:
                kill.scheduled_t = tick
                self.rec.kills.append(kill)
                say(self.verbose, f"kill {index}: {kill.mode} {', '.join(kill.targets) or '-'} {kill.note}"
                                  f"{' ERROR ' + kill.error if kill.error else ''}")

    async def _sampler(self) -> None:
        """Resident memory and descriptors of everything this process started (the server, Ray, its workers),
        every `sample_every` s; only for a self-started drill (attached, the processes are not ours)."""
        while not self.stop_side.is_set():
            started = time.time()
            sample = await asyncio.to_thread(sample_tree, [os.getpid()])
            if sample is not None:
                self.rec.resources.append(sample)
            await asyncio.sleep(max(0.0, self.o.sample_every - (time.time() - started)))

    # ---- run ---------------------------------------------------------------------------------------------

    async def run(self) -> None:
        o, rec = self.o, self.rec
        options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        async with grpc.aio.insecure_channel(rec.target, options=options) as chan:
            await asyncio.wait_for(chan.channel_ready(), 60)
            self.stub = inference_pb2_grpc.InferenceStub(chan)
            self.admin = admin_pb2_grpc.AdminStub(chan)
            first = await self._poll_once()
            if not first.ok:
                raise RuntimeError(f"GetClusterState failed on {rec.target}: {first.error}")
            rec.polls.append(first)
            if self.ray_connected:  # the first Ray lookups of a driver are slow; pay for them before the clock runs
                await asyncio.to_thread(self._prewarm_ray)
            say(self.verbose, f"warm-up: {o.concurrency} streams ...")
            # Warm up with every prompt once (at most `concurrency` at a time): each prompt then has a fault-free
            # output to compare against even if the baseline phase is too short to reach it.
            gate = asyncio.Semaphore(o.concurrency)

            async def warm_one(index: int) -> RequestRecord:
                async with gate:
                    return await self._one(index % o.concurrency, index)

            rec.warm_requests = list(await asyncio.gather(*(warm_one(i) for i in range(len(self.prompts)))))
            rec.t0 = time.time()
            say(self.verbose, f"baseline {o.baseline} s with {o.concurrency} streams ...")
            workers = [asyncio.create_task(self._worker(i)) for i in range(o.concurrency)]
            side = [asyncio.create_task(self._poller())]
            if self.o.self_started:
                side.append(asyncio.create_task(self._sampler()))
            if self.ppl_ids is not None:
                side.append(asyncio.create_task(self._perplexity()))
            try:
                await asyncio.sleep(max(0.0, rec.t0 + o.baseline - time.time()))
                rec.fault_start = time.time()
                say(self.verbose, f"faults: kill {o.kill} every {o.every} s for {o.duration} s ...")
                faults = asyncio.create_task(self._faults())
                side.append(faults)
                await asyncio.sleep(max(0.0, rec.fault_start + o.duration - time.time()))
                rec.fault_end = time.time()
                await faults
                # Keep the load on until every kill recovered (bounded), then a short tail.
                settle_deadline = rec.fault_end + o.settle
                recovered, last = all_recovered(rec)
                while not recovered and time.time() < settle_deadline:
                    await asyncio.sleep(0.5)
                    recovered, last = all_recovered(rec)
                if not recovered:
                    say(self.verbose, "not every kill recovered within the settle time")
                tail_end = (last or time.time()) + TAIL_S
                await asyncio.sleep(max(0.0, min(tail_end, settle_deadline + TAIL_S) - time.time()))
                say(self.verbose, "stopping the load ...")
                self.stop_load.set()
                _, hung = await asyncio.wait(workers, timeout=STOP_GRACE_S)
                for task in hung:  # recorded as HUNG_AT_END by _one
                    task.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                rec.load_end = time.time()
            finally:
                self.stop_load.set()
                self.stop_side.set()
                for task in workers + side + self.watchers:
                    if not task.done():
                        task.cancel()
                await asyncio.gather(*workers, *side, *self.watchers, return_exceptions=True)
            rec.polls.append(await self._poll_once())  # final state
            rec.ray_at_end = await asyncio.to_thread(_ray_snapshot) if self.ray_connected else None
        rec.events.sort(key=lambda e: e["t"])


def _ray_snapshot() -> dict | None:
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


# ------------------------------------------------------------------------------------------- start-up


def _start_ray(config: DrillConfig, verbose: bool):
    """Ray for a self-started drill: (Cluster or None, GCS address). A Cluster for node and chaos kills. Both on
    loopback; the Cluster with Ray's fast node health checks (ops/drill/ray_start.py)."""
    if config.kill in CLUSTER_KILLS:
        gpus = f", {config.node_gpus} GPUs" if config.node_gpus else ""
        say(verbose, f"starting a Ray cluster on loopback: head (1 CPU) + {config.nodes} workers ({config.node_cpus} "
                     f"CPUs{gpus} each), node health checks {FAST_HEALTH_CHECKS} ...")
        return start_node_cluster(config.nodes, config.node_cpus, config.node_gpus, config.names.namespace)
    say(verbose, f"starting Ray on loopback ({config.num_cpus or max(2, os.cpu_count() or 2)} CPUs) ...")
    return None, start_local_ray(config.num_cpus, config.names.namespace)


def _server_policy(target: str) -> str:
    """The no-replica policy of a running server ('' when it does not say)."""
    with grpc.insecure_channel(target) as chan:
        state = admin_pb2_grpc.AdminStub(chan).GetClusterState(admin_pb2.ClusterStateRequest(), timeout=30)
    return state.no_replica_policy


def record_drill(config: DrillConfig, verbose: bool = True) -> DrillRecord:
    """Run the drill `config` describes and return what happened (config must be valid; the server's log goes to
    config.out). Everything it started (server subprocess, Ray or Cluster) is stopped on return, error or
    Ctrl-C (SIGTERM too, when called from the main thread)."""
    out_dir = Path(config.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    server: ServerProcess | None = None
    cluster = None
    ray_connected = False
    prompts = make_prompts(config.model_dir)
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

        if config.target is None:
            cluster, gcs = _start_ray(config, verbose)
            ray_connected = True
            args = serve_args(config, gcs, out_dir / "serve_config.json")
            say(verbose, f"starting expertmesh serve {' '.join(args)} ...")
            t_srv = time.time()
            server = start_server(args, out_dir / "serve.log", timeout=config.ready_timeout, new_session=True)
            target = server.target
            say(verbose, f"serving {server.model_name} on {target} (ready after {time.time() - t_srv:.1f} s)")
            policy = config.no_replica_policy
        else:
            target = config.target
            if config.address is not None:
                prepare_join(config.address, field="address")
                ray.init(address=config.address, namespace=config.names.namespace, logging_level=logging.WARNING,
                         log_to_driver=False)
                ray_connected = True
            policy = _server_policy(target) or config.no_replica_policy

        rec = DrillRecord(options=config.to_dict(), target=target, policy=policy, prompts=len(prompts),
                          training_ppl=training_perplexity(config.model_dir))
        ppl_ids = None
        if policy == "degrade":
            say(verbose, "preparing the held-out text for perplexity ...")
            ppl_ids, rec.ppl_info = held_out_chunk(config.model_dir)
        asyncio.run(_Drill(config, rec, prompts, cluster, ray_connected, ppl_ids, verbose).run())
    finally:
        if server is not None:
            say(verbose, "stopping the server ...")
            code = server.stop()
            say(verbose, f"server exited with {code}")
        if ray_connected:
            import ray

            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        leave_loopback_mode()
        if in_main:
            signal.signal(signal.SIGTERM, old_term)
        sys.stdout = real_stdout

    rec.server = {"exit_code": server.proc.returncode, "log": str(server.log_path)} if server else None
    rec.machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    rec.wall_s = round(time.time() - started, 3)
    return rec
