"""Expert calls through a Ray Compiled Graph: one graph over every expert actor, executed once per layer round.

    (layer, {actor: (experts, counts, x)}, trace) ──InputNode──► actor_i.forward_step ──► MultiOutputNode

Within a node the input and outputs travel over shared-memory channels that the actors' execution loops poll, so a
round skips Ray's per-call task submission, scheduling and object-store puts. Every actor reads the one input and
picks its own part; an actor without rows this round returns None at once (one cheap channel round-trip).

The graph is built for one set of actor incarnations (name -> actor id). It is not rebuilt under a running step:
  - while it is (re)built, in a background thread, calls go through `RayRefTransport`;
  - when a compiled round fails (an actor died, a call raised, a timeout), the graph is torn down in the
    background and that round is re-sent as plain Ray calls, so dispatch sees Ray's own per-call errors
    (RayActorError for the dead actor) and its failover works unchanged;
  - it is rebuilt once every actor answers `ready` again, e.g. after NameReviver swapped a restored replica in
    (a new actor id), or after `rebuild_interval_s`.
  - it is torn down after `idle_teardown_s` without a round: in Ray 2.60 every actor's execution loop busy-polls
    its input channel (measured: ~0.24 CPU per idle actor, 8 actors ≈ 2 cores), so an idle graph would burn the
    node's CPUs; the next round goes through plain calls while it is rebuilt (~1 s).
Expert actors keep taking normal calls while a graph runs (its loop runs in Ray's `_ray_system` concurrency group),
so `ready`/`info` pings from the reviver and the controller still work.

GPU tensors: the router hands the graph host rows (HostTensor: raw bytes + dtype tag, staged off its device by
dispatch), so every edge here is driver <-> actor, which Ray serves with shared memory (or RPC across nodes); NCCL
channels only apply between actors and are not used.
Tracing: the W3C carrier rides in the input tuple and reaches `ExpertActor.forward(..., trace=)`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from ...experts.arrays import HostTensor, to_tensor
from .refs import RayRefTransport

log = logging.getLogger(__name__)

WARMUP_TIMEOUT_S = 120.0  # the first execution of a fresh graph imports the channel code in every actor


@dataclass
class _Pending:
    """A call submitted but not yet sent: the compiled transport sends a whole round at once in gather_settled."""

    actor: str
    layer: int
    experts: list[int]
    counts: list[int]
    x: HostTensor
    trace: dict[str, str] | None = None


@dataclass
class _Graph:
    key: tuple[tuple[str, str], ...]  # (name, actor id) of every actor it was built on
    dag: Any  # ray.dag.CompiledDAG
    index: dict[str, int] = field(default_factory=dict)  # actor name -> output position


def incarnations(actors: dict[str, ray.actor.ActorHandle]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((name, handle._actor_id.hex()) for name, handle in actors.items()))


class CompiledGraphTransport:
    def __init__(self, actors: dict[str, ray.actor.ActorHandle], rebuild_interval_s: float = 5.0,
                 buffer_size_bytes: int = 1 << 20, background: bool = True, idle_teardown_s: float | None = 30.0):
        """background=False builds and tears down in the calling thread (deterministic tests);
        idle_teardown_s=None keeps an idle graph (and its polling loops) up."""
        self.actors = actors  # NameReviver swaps restored replicas in here
        self.fallback = RayRefTransport(actors)
        self.rebuild_interval_s = rebuild_interval_s
        self.buffer_size_bytes = buffer_size_bytes
        self.background = background
        self.graph: _Graph | None = None
        self._lock = threading.Lock()
        self._builder: threading.Thread | None = None
        self._teardowns: list[threading.Thread] = []
        self._failed_key: tuple | None = None  # incarnations whose graph last failed or could not be built
        self._failed_at = 0.0
        self._closed = False
        self.idle_teardown_s = idle_teardown_s
        self._last_round = time.monotonic()
        self._in_round = False
        self._idle_stop = threading.Event()
        self._idle_watch: threading.Thread | None = None
        if idle_teardown_s is not None:
            self._idle_watch = threading.Thread(target=self._watch_idle, daemon=True, name="expertmesh-idle")
            self._idle_watch.start()
        # Counters for tests and benchmarks.
        self.builds = 0
        self.compiled_rounds = 0
        self.fallback_rounds = 0
        self.torn_down = 0

    # ---- Transport -----------------------------------------------------------------------------------------

    def submit(self, actor: str, layer: int, experts: list[int], counts: list[int], x: HostTensor,
               trace: dict[str, str] | None = None) -> _Pending:
        return _Pending(actor, layer, experts, counts, x, trace)

    def gather_settled(self, handles: list[_Pending], timeout: float) -> list[torch.Tensor | BaseException]:
        self._in_round = True
        try:
            graph = self._current_graph()
            if graph is not None and self._fits(graph, handles):
                try:
                    return self._run_compiled(graph, handles, timeout)
                except Exception as exc:  # an actor died, a call raised or timed out: fall back for this round
                    log.warning("compiled expert graph failed (%s: %s); tearing it down, plain Ray calls meanwhile",
                                type(exc).__name__, exc)
                    self._retire(graph, failed=True)
            return self._run_fallback(handles, timeout)
        finally:
            self._in_round = False
            self._last_round = time.monotonic()

    # ---- rounds --------------------------------------------------------------------------------------------

    @staticmethod
    def _fits(graph: _Graph, handles: list[_Pending]) -> bool:
        actors = [h.actor for h in handles]
        return (bool(handles) and len(set(actors)) == len(actors) and all(a in graph.index for a in actors)
                and len({h.layer for h in handles}) == 1)

    def _run_compiled(self, graph: _Graph, handles: list[_Pending], timeout: float) -> list[torch.Tensor]:
        trace = next((h.trace for h in handles if h.trace), None)
        calls = {h.actor: (h.experts, h.counts, h.x) for h in handles}
        outputs = ray.get(graph.dag.execute((handles[0].layer, calls, trace)), timeout=timeout)
        self.compiled_rounds += 1
        # Copy out of the channel buffers, which the next round overwrites (dispatch may hold outputs across
        # retry rounds).
        return [to_tensor(outputs[graph.index[h.actor]]).clone() for h in handles]

    def _run_fallback(self, handles: list[_Pending], timeout: float) -> list[torch.Tensor | BaseException]:
        self.fallback_rounds += 1
        refs = [self.fallback.submit(h.actor, h.layer, h.experts, h.counts, h.x, **_trace_kw(h.trace))
                for h in handles]
        return self.fallback.gather_settled(refs, timeout)

    # ---- graph lifecycle -----------------------------------------------------------------------------------

    def _current_graph(self) -> _Graph | None:
        """The graph for the current incarnations, or None (and a build started when one is due)."""
        key = incarnations(self.actors)
        with self._lock:
            graph = self.graph
        if graph is not None and graph.key == key:
            return graph
        if graph is not None:  # placement changed (a replica was restored): this graph is stale
            self._retire(graph, failed=False)
        self._maybe_build(key)
        with self._lock:
            graph = self.graph
        return graph if graph is not None and graph.key == key else None

    def _maybe_build(self, key: tuple) -> None:
        if self._closed or (self._builder is not None and self._builder.is_alive()):
            return
        if key == self._failed_key and time.monotonic() - self._failed_at < self.rebuild_interval_s:
            return
        handles = dict(self.actors)
        if self.background:
            self._builder = threading.Thread(target=self._build, args=(key, handles), daemon=True,
                                             name="expertmesh-compile")
            self._builder.start()
        else:
            self._build(key, handles)

    def _build(self, key: tuple, handles: dict[str, ray.actor.ActorHandle]) -> None:
        from ray.dag import InputNode, MultiOutputNode

        dag = None
        try:
            names = _live(handles)
            if not names:
                raise RuntimeError("no expert actor is alive")
            with InputNode() as step:
                outputs = MultiOutputNode([handles[name].forward_step.bind(step) for name in names])
            dag = outputs.experimental_compile(_buffer_size_bytes=self.buffer_size_bytes)
            ray.get(dag.execute((-1, {}, None)), timeout=WARMUP_TIMEOUT_S)  # every actor's loop is up
        except Exception as exc:
            log.warning("could not build the compiled expert graph (%s: %s); plain Ray calls meanwhile",
                        type(exc).__name__, exc)
            self._failed_key, self._failed_at = key, time.monotonic()
            if dag is not None:
                _teardown(dag)
            return
        with self._lock:
            if self._closed or self.graph is not None:
                stale = True
            else:
                self.graph = _Graph(key, dag, {name: i for i, name in enumerate(names)})
                self.builds += 1
                stale = False
        if stale:
            _teardown(dag)

    def _retire(self, graph: _Graph, failed: bool) -> None:
        with self._lock:
            if self.graph is graph:
                self.graph = None
        if failed:
            self._failed_key, self._failed_at = graph.key, time.monotonic()
        self.torn_down += 1
        if self.background:
            thread = threading.Thread(target=_teardown, args=(graph.dag,), daemon=True, name="expertmesh-teardown")
            thread.start()
            self._teardowns.append(thread)
        else:
            _teardown(graph.dag)

    def _watch_idle(self) -> None:
        period = min(1.0, self.idle_teardown_s / 4)
        while not self._idle_stop.wait(period):
            with self._lock:
                graph = self.graph
            if graph is not None and not self._in_round and time.monotonic() - self._last_round > self.idle_teardown_s:
                log.info("compiled expert graph idle for %.0f s: tearing it down", self.idle_teardown_s)
                self._retire(graph, failed=False)

    def wait_built(self, timeout: float = WARMUP_TIMEOUT_S) -> bool:
        """Start a build if none is running and wait for it; True when a graph for the current actors is up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._current_graph() is not None:
                return True
            if self._builder is not None:
                self._builder.join(timeout=max(0.0, deadline - time.monotonic()))
            if self._current_graph() is not None:
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        """Tear the graph down and wait for every teardown, so no execution loop or channel is left behind."""
        self._closed = True
        self._idle_stop.set()
        if self._idle_watch is not None:
            self._idle_watch.join()
        if self._builder is not None:
            self._builder.join()
        with self._lock:
            graph, self.graph = self.graph, None
        if graph is not None:
            _teardown(graph.dag)
        for thread in self._teardowns:
            thread.join()
        self._teardowns.clear()


def _live(handles: dict[str, ray.actor.ActorHandle]) -> list[str]:
    """Names of the actors that answer `ready`, sorted. A dead one (drained, or lost and not restored) is left out
    of the graph, which would otherwise fail to compile or hang; calls to it go through plain Ray calls and fail
    there as dispatch expects. An actor that is merely slow raises GetTimeoutError (no build this time)."""
    refs = {name: handle.ready.remote() for name, handle in handles.items()}
    live = []
    for name in sorted(refs):
        try:
            ray.get(refs[name], timeout=WARMUP_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            continue
        live.append(name)
    return live


def _teardown(dag: Any) -> None:
    try:
        dag.teardown()
    except Exception as exc:  # a graph whose actor died may fail to cancel that actor's loop; nothing left to do
        log.warning("compiled expert graph teardown: %s: %s", type(exc).__name__, exc)


def _trace_kw(trace: dict[str, str] | None) -> dict:
    """Pass the carrier on only when there is one, so a transport without the keyword still works."""
    return {"trace": trace} if trace else {}
