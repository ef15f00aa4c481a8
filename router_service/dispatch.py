"""Per-layer dispatch: group the routed tokens by expert actor, make one call per actor that has tokens, all
calls in flight together, then combine the outputs with the gate weights. Failover lives here too: a failed call's
tokens go to another replica of the same shard within the step, so the step's result is the fault-free one.

The planning and the combine are pure functions in dispatch_plan.py; `RemoteExperts` is the ExpertBackend the
router's decoder uses, wiring the plan to a Transport, the breakers and the no-replica policy. Nothing here imports
Ray at import time (it tells a dead actor from a failed call with Ray's exception type, looked up then).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from ..cluster.breaker import BreakerBoard
from ..cluster.routing_table import RoutingTable, Shard, split_tokens
from ..experts.arrays import HostStager, pack
from ..experts.device_rule import layer_to_host
from ..experts.gating import Routing, degrade
from .dispatch_plan import ActorCall, add_rows, all_served, combine, plan_calls
from .failover_config import NO_REPLICA_POLICIES, FailoverConfig  # noqa: F401  (re-exported; torch-free there)
from .shedding import ShedPolicy, apply_shed
from .step_profile import StageClock
from .transports.base import Transport

MAX_LAYER_ATTEMPTS = 8  # a layer whose calls keep failing (not just moving to another replica) gives up
MAX_CALL_ROUNDS = 4  # retry rounds within one attempt


class NoReplicaError(RuntimeError):
    """A shard has no live replica and the policy is `wait`, and none came back in time (gRPC UNAVAILABLE)."""


@dataclass
class _PendingLayer:
    """A layer's expert round between `submit` and `wait`."""

    layer: int
    hidden: torch.Tensor  # [T, H] on the router's device: where the combine adds up
    host_hidden: torch.Tensor  # [T, H] the same in host memory: the rows every call sends are gathered from it
    routing: Routing  # as the gate chose, in host memory (experts/device_rule.py)
    served: Routing  # after the no-replica policy
    calls: list[ActorCall]
    handles: list  # the first round's transport handles
    shed: torch.Tensor | None  # [E] slots moved off each expert by overload shedding (None: shedding off)
    deadline: float  # the `wait` policy's bound (clock)
    give_up: float  # the whole layer's bound (clock)
    carrier: dict[str, str] | None  # trace context sent with every call
    span: object | None  # the layer's dispatch span (ended in wait)
    started: float  # perf_counter at submit
    busy_s: float = 0.0  # time submit took


class RemoteExperts:
    """ExpertBackend whose experts live in actors behind a Transport, with retries, breakers and a no-replica
    policy. `reviver` (optional) looks dead replicas up again, e.g. by actor name after the controller restored
    them; it returns the names that are back."""

    def __init__(self, table: RoutingTable, transport: Transport, failover: FailoverConfig | None = None,
                 breakers: BreakerBoard | None = None, reviver: Callable[[set[str]], set[str]] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.table = table
        self.transport = transport
        self.failover = (failover or FailoverConfig()).validate()
        self.breakers = breakers or BreakerBoard()
        self.reviver = reviver
        self.clock = clock
        self.dead: set[str] = set()
        # Actors a call failed on (death, error or timeout) since the current step began: a held step may switch
        # to a table that retires them (see _apply_staged_while_held).
        self._failed_in_step: set[str] = set()
        self._in_flight: list[_PendingLayer] = []  # submitted layers not yet waited for (their calls may be out)
        self._last_revive = 0.0
        self.calls_per_layer: dict[int, int] = {}  # of the most recent forward; tests check calls == actors hit
        # A layer's routing and rows leave the router's device through pinned buffers with one synchronisation
        # (experts/device_rule.py; tests count them).
        self.stager = HostStager()
        self.round_seconds = 0.0  # wall time spent in expert rounds since creation (benchmarks read it)
        self.profile = StageClock()  # per-stage seconds (router_service/step_profile.py); the router shares one
        self.retried_calls = 0
        self.degraded_slots = 0
        self.shed_slots = 0  # slots moved off an overloaded shard (overload shedding)
        # Overload shedding: the policy (created at the first round, when E is known) and each layer's last decision.
        self.shed_policy: ShedPolicy | None = None
        # layer -> (slots to shed [E], experts they may go to [E] bool) of its most recent round: what the
        # in-process reference needs to make the same moves (shedding.apply_shed)
        self.last_shed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # live replicas per shard, [E] per layer, for one (table, dead set)
        self._replica_counts: tuple[tuple, dict[int, torch.Tensor]] | None = None
        self.effective: dict[int, Routing] = {}  # layer -> routing actually served (after degrade)
        # Observability (router_service/observability.py); None = off, and then no call is made at all.
        self.observer = None  # .on_layer(layer, served, calls, seconds), .on_retry(actor)
        self.tracer = None  # OpenTelemetry tracer: a span per layer, its context sent along with every call
        # Live remap: a newer table (and handles to its new actors) waits here until the next step starts. The
        # decoder marks steps with begin_step/end_step (with overlap, a step's layers run as two interleaved
        # micro-batches, so no layer order can tell where a step starts).
        self._staged: tuple[RoutingTable, dict] | None = None
        self._staged_lock = threading.Lock()
        self._step_lock = threading.Lock()  # guards _steps_running / _last_active against the idle-time switch
        # Held from begin_step to end_step (and through a bare `run`): forwards from several threads take turns
        # per step, so no two rounds share a transport at once and no switch lands inside a step.
        self._step_guard = threading.RLock()
        self._steps_running = 0
        self._last_active = 0.0  # when the last step ended or the last bare `run` finished
        self.on_table_applied: Callable[[int], None] | None = None  # called with the epoch after each switch
        # Prefetch (README: Offload): predicts the next MoE layer's experts (router_service/prefetch.py); the
        # prediction rides with this layer's calls to the actors hosting those shards. None = off.
        self.prefetcher = None
        self.prefetch_calls = 0  # hints sent as calls of their own (to actors this layer does not call)
        self.prefetch_riding = 0  # hints that rode with an actor's call of this layer

    # ---- health --------------------------------------------------------------------------------------------

    def live_replicas(self, shard: Shard) -> list[str]:
        """Replicas that may take this step's calls. Asking may grant a half-open replica its one probe, so call
        it only for replicas that will then get a call (plan_calls, _replan)."""
        return self.breakers.usable_replicas(self.table.replicas.get(shard, ()), self.clock(), frozenset(self.dead))

    def has_live_replica(self, shard: Shard) -> bool:
        """Whether the shard can be served at all, without touching the breakers (usable_replicas is never empty
        while one replica is alive)."""
        return any(actor not in self.dead for actor in self.table.replicas.get(shard, ()))

    def _revive(self, force: bool = False) -> None:
        now = self.clock()
        if not self.dead or self.reviver is None:
            return
        if not force and now - self._last_revive < self.failover.revive_interval_s:
            return
        self._last_revive = now
        back = self.reviver(set(self.dead))
        for actor in back:
            self.dead.discard(actor)
            self.breakers.states.pop(actor, None)  # a restored replica starts with a closed breaker

    def mark_failed(self, actor: str, error: BaseException) -> None:
        self.breakers.record(actor, self.clock(), ok=False)
        self._failed_in_step.add(actor)
        if _is_actor_death(error):
            self.dead.add(actor)

    def effective_routing(self, layer: int, routing: Routing) -> Routing:
        return self.effective.get(layer, routing)

    # ---- live remap --------------------------------------------------------------------------------------------

    def stage_table(self, table: RoutingTable, new_actors: dict, gone: Collection[str] = ()) -> None:
        """Switch to `table` when the next step starts (never within a step, so a step uses one placement, unless
        the step is held for lack of a replica: _apply_staged_while_held).
        new_actors: handles of actors the current table does not name yet (already loaded and warm).
        gone: actors the controller lost, which `table` retires: dead to this router from now on."""
        self.dead.update(a for a in gone if a in self.table.actors and a not in table.actors)
        with self._staged_lock:
            self._staged = (table, dict(new_actors))

    def _apply_staged(self) -> None:
        with self._staged_lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            self._switch_to(*staged)

    def _switch_to(self, table: RoutingTable, new_actors: dict) -> None:
        actors = self.transport.actors  # every transport keeps its name -> handle map here
        actors.update(new_actors)
        for name in [n for n in actors if n not in table.actors]:
            # Retired by the controller: no call of a later step goes to it. Calls of the step that just ended
            # are done; the controller stops the actor only after every router reported this epoch.
            del actors[name]
            self.dead.discard(name)
            self.breakers.states.pop(name, None)
        self.table = table
        if self.on_table_applied is not None:
            self.on_table_applied(table.epoch)

    def _apply_staged_while_held(self) -> bool:
        """Inside a step held by the `wait` policy, or retrying a layer whose calls failed: switch to a staged table
        now unless it retires an actor that may still answer a call of this step (one in flight to it from a layer
        submitted but not yet waited for, and it is neither dead nor failed). So the switch strands no call that
        could succeed, and a step waiting for lost replicas reaches the stand-ins the controller starts under new
        names when the survivors have no room to restore them as they were. (The controller stops a retired
        actor only after this router acknowledges the table, which the switch does; a call to an actor on a lost
        node can hang until its timeout instead of failing as a death, hence "failed" counts as gone too.)"""
        with self._step_lock:
            with self._staged_lock:
                staged = self._staged
                if staged is None:
                    return False
                gone = self.dead | self._failed_in_step
                busy = {c.actor for p in self._in_flight for c in p.calls} - gone
                if any(a in busy for a in self.table.actors if a not in staged[0].actors):
                    return False
                self._staged = None
            self._switch_to(*staged)
        return True

    def begin_step(self) -> None:
        """The decoder starts a forward: switch to a staged table now, then no switch until end_step (same
        thread)."""
        self._step_guard.acquire()
        try:
            with self._step_lock:
                if self._staged is not None:
                    self._apply_staged()
                self._steps_running += 1
                self.calls_per_layer = {}
                self._failed_in_step = set()
                self._in_flight = []  # a step that failed may have left layers it never waited for
        except BaseException:
            self._step_guard.release()
            raise

    def end_step(self) -> None:
        with self._step_lock:
            self._steps_running = max(0, self._steps_running - 1)
            self._last_active = time.monotonic()
        self._step_guard.release()

    def apply_if_idle(self, idle_s: float) -> bool:
        """Switch to a staged table now when no step is running and none ended within idle_s (an idle router
        would otherwise hold on to the old table, and the controller wait for it, until its next request)."""
        if self._staged is None or not self._step_guard.acquire(blocking=False):
            return False
        try:
            with self._step_lock:
                if self._steps_running or time.monotonic() - self._last_active < idle_s or self._staged is None:
                    return False
                self._apply_staged()
                return True
        finally:
            self._step_guard.release()

    # ---- one layer -----------------------------------------------------------------------------------------

    def run(self, layer: int, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        """hidden: [T, H] -> the routed experts' combined output [T, H]."""
        with self._step_guard:
            return self.wait(self.submit(layer, hidden, routing))

    def submit(self, layer: int, hidden: torch.Tensor, routing: Routing) -> _PendingLayer:
        """Start a layer's expert round: apply the no-replica policy, plan the calls and send them. The
        retries, failover and combine happen in `wait`; other work can run in between (the decoder's overlap).
        hidden [T, H] and routing are on the router's device; this is where they cross to the host, once."""
        started = time.perf_counter()
        routing, (host_hidden,) = layer_to_host(routing, [hidden], self.stager, wide=self._needs_probs())
        span = None
        if self.tracer is not None:
            span = self.tracer.start_span("expertmesh.dispatch", attributes={"layer": layer})
        try:
            carrier = None
            if span is not None:
                from ..experts.telemetry import carrier_of

                carrier = carrier_of(span)
            self._revive()
            deadline = self.clock() + self.failover.wait_timeout_s
            # One bound for the whole layer, however many retries it takes: calls queued on actors that never come
            # up (e.g. restores pending on a full cluster) end in NoReplicaError (UNAVAILABLE), not a hang.
            give_up = self.clock() + max(self.failover.call_timeout_s, self.failover.wait_timeout_s)
            planning = time.perf_counter()
            served = self._apply_policy(layer, routing, deadline)
            shed = self._shed_decision(layer, routing)
            if shed is not None:
                targets = self._shed_targets(layer, served)
                self.last_shed[layer] = (shed, targets)
                served = apply_shed(served, shed, targets)
            calls = plan_calls(layer, served, self.table, self._replicas_of())
            self.profile.since("dispatch.plan", planning)
            hints = self._prefetch_hints(layer, hidden, served) if self.prefetcher is not None else None
            handles = self._send(layer, host_hidden, calls, range(len(calls)), carrier, hints)
        except BaseException:
            if span is not None:
                span.end()
            raise
        pending = _PendingLayer(layer, hidden, host_hidden, routing, served, calls, handles, shed, deadline, give_up,
                                carrier, span, started)
        pending.busy_s = time.perf_counter() - started
        self.profile.add("dispatch.submit", pending.busy_s)
        self._in_flight.append(pending)
        return pending

    def wait(self, pending: _PendingLayer) -> torch.Tensor:
        """Finish a submitted layer: gather, re-send failed calls' tokens to other replicas, re-route the layer
        when a shard ran out of replicas, combine. -> [T, H]."""
        waited = time.perf_counter()
        p = pending
        try:
            calls, served, outputs = p.calls, p.served, None
            for attempt in range(MAX_LAYER_ATTEMPTS + 1):
                if attempt == MAX_LAYER_ATTEMPTS:
                    raise NoReplicaError(f"layer {p.layer}: expert calls kept failing over {attempt} attempts")
                if attempt:
                    # A shard lost its last replica mid-step: route again under the policy (the step is redone,
                    # so its result is still exactly that of the served routing), on a newer table if one retires
                    # the actors that failed.
                    planning = time.perf_counter()
                    self._apply_staged_while_held()
                    served = self._apply_policy(p.layer, p.routing, p.deadline)
                    if p.shed is not None:  # the round's shedding decision stands; only the targets' health moved
                        served = apply_shed(served, p.shed, self._shed_targets(p.layer, served))
                    calls = plan_calls(p.layer, served, self.table, self._replicas_of())
                    self.profile.since("dispatch.plan", planning)
                outputs = self._execute(p.layer, p.host_hidden, calls, p.give_up, p.carrier,
                                        p.handles if attempt == 0 else None)
                if outputs is not None:
                    break
            with self._step_lock:  # micro-batches of one step add up; a bare `run` reports its own calls
                before = self.calls_per_layer.get(p.layer, 0) if self._steps_running else 0
                self.calls_per_layer[p.layer] = before + len(calls)
            self.effective[p.layer] = served
            self.degraded_slots += served.degraded
            self.shed_slots += served.shed
            combining = time.perf_counter()
            # Outputs arrive in host memory and the plan is host bookkeeping: combine sends them to hidden's device
            # in one batch of non-blocking copies and adds up there.
            result = combine(p.hidden, served, calls, outputs)
            self.profile.since("dispatch.combine", combining)
            # Time this thread spent on the round (submit + wait), not the work it did while the round flew.
            self.round_seconds += p.busy_s + time.perf_counter() - waited
            if self.observer is not None:
                self.observer.on_layer(p.layer, served, calls, time.perf_counter() - p.started)
            if p.span is not None:
                p.span.set_attribute("calls", len(calls))
            return result
        finally:
            self.profile.since("dispatch.wait", waited)
            if p in self._in_flight:
                self._in_flight.remove(p)
            if p.span is not None:
                p.span.end()
            if not self._steps_running:
                self._last_active = time.monotonic()

    def _needs_probs(self) -> bool:
        """Whether a layer's gate probabilities ([T, E], and the selection scores) must come to the host with its
        routing: for the load statistics' entropy, degrading around a lost shard, or shedding."""
        return (self.observer is not None or self.failover.no_replica_policy == "degrade"
                or self.failover.shed.enabled)

    def _replicas_of(self) -> Callable[[Shard], list[str]] | None:
        """How plan_calls picks a shard's replicas: None (the table's, planned without a Python step per expert)
        while no replica is dead and every breaker is closed - then live_replicas would return exactly those and
        change no breaker - else live_replicas."""
        return None if not self.dead and self.breakers.all_closed() else self.live_replicas

    def _shed_decision(self, layer: int, routing: Routing) -> torch.Tensor | None:
        """Overload shedding's decision for this round: [E] slots to move off each expert (None: shedding off).
        Measured on the gate's routing (the offered load), so shedding does not hide the load that triggered it."""
        config = self.failover.shed
        if not config.enabled:
            return None
        num_experts = routing.probs.shape[1]
        if self.shed_policy is None:
            self.shed_policy = ShedPolicy(config, num_experts)
        offered = routing.tokens_per_expert(num_experts)  # [E]
        return self.shed_policy.observe(layer, self.clock(), offered, self._live_replica_counts(layer, num_experts))

    def _shed_targets(self, layer: int, served: Routing) -> torch.Tensor:
        """[E] bool: experts a shed slot may go to: served by a live replica and not shedding themselves."""
        live = self._live_replica_counts(layer, served.probs.shape[1]) > 0
        return live & ~self.shed_policy.shedding(layer)

    def _live_replica_counts(self, layer: int, num_experts: int) -> torch.Tensor:
        """[E] int64 replicas of each of the layer's shards that are not dead (cached per table and dead set)."""
        key = (id(self.table), self.table.epoch, frozenset(self.dead))
        if self._replica_counts is None or self._replica_counts[0] != key:
            self._replica_counts = (key, {})
        per_layer = self._replica_counts[1]
        if layer not in per_layer:
            replicas = self.table.replicas
            per_layer[layer] = torch.tensor([  # host: policy bookkeeping
                sum(1 for a in replicas.get((layer, e), ()) if a not in self.dead) for e in range(num_experts)
            ], dtype=torch.int64)
        return per_layer[layer]

    def _apply_policy(self, layer: int, routing: Routing, deadline: float) -> Routing:
        """Make sure every routed expert has a live replica: wait for one, or degrade to the next-best expert."""
        if not self.dead and all_served(self.table, layer, routing.experts):
            return routing  # nothing is dead and the table serves every routed expert (no Python step per expert)
        while True:
            hit = torch.unique(routing.experts[routing.experts >= 0]).tolist()
            missing = [e for e in hit if not self.has_live_replica((layer, e))]
            if not missing:
                return routing
            if self.failover.no_replica_policy == "degrade":
                available = torch.tensor(  # host: policy bookkeeping
                    [self.has_live_replica((layer, e)) for e in range(routing.probs.shape[1])])
                return degrade(routing, available)
            if self._apply_staged_while_held():
                continue  # a stand-in for the lost replicas may be in the new table
            if self.clock() >= deadline:
                raise NoReplicaError(
                    f"no live replica of layer {layer} expert(s) {missing} within {self.failover.wait_timeout_s:.0f}s"
                )
            time.sleep(0.05)
            self._revive(force=True)

    def _send(self, layer: int, hidden: torch.Tensor, calls: list[ActorCall], which, trace: dict[str, str] | None,
              hints: dict[str, list[Shard]] | None = None):
        """Submit calls[i] for i in `which` through the transport; -> their handles.
        hidden [T, H] is the layer's host copy (submit brought it over with the routing in one wait): every call's
        rows are gathered from it here, on the host, with no further device work.
        hints: actor -> shards to prefetch; they ride with the actor's call where the transport takes them (refs,
        grpc, socket), otherwise, and for actors without a call, go as `prefetch` calls of their own after the calls."""
        # `trace` only when tracing is on, so a transport without it still works with tracing off.
        extra = {} if trace is None else {"trace": trace}
        sending = time.perf_counter()
        staged = [hidden[calls[i].tokens] for i in which]  # [n_i, H] each
        hints = dict(hints or {})
        rides = getattr(self.transport, "takes_prefetch", False)
        handles = []
        for i, rows in zip(which, staged):
            call = calls[i]
            hint = {"prefetch": hints.pop(call.actor)} if rides and call.actor in hints else {}
            self.prefetch_riding += bool(hint)
            handles.append(self.transport.submit(call.actor, layer, call.experts, call.counts, pack(rows), **extra,
                                                 **hint))
        for actor, shards in hints.items():
            handle = self.transport.actors.get(actor)
            if handle is not None:
                handle.prefetch.remote(shards)  # fire and forget: a lost hint costs a stall, never a result
                self.prefetch_calls += 1
        self.profile.since("dispatch.send", sending)
        return handles

    def _prefetch_hints(self, layer: int, hidden: torch.Tensor, served: Routing) -> dict[str, list[Shard]]:
        """Score the prediction made for this layer, predict the next one, and address the predicted shards to
        the live actors hosting them: actor -> [(layer, expert)]."""
        self.prefetcher.observe(layer, served.experts)
        predicted = self.prefetcher.predict(layer, hidden)
        if predicted is None:
            return {}
        nxt, experts = predicted
        hints: dict[str, list[Shard]] = {}
        for expert in experts:
            for actor in self.table.replicas.get((nxt, expert), ()):
                if actor not in self.dead:
                    hints.setdefault(actor, []).append((nxt, expert))
        return hints

    def _execute(self, layer: int, hidden: torch.Tensor, calls: list[ActorCall],
                 give_up: float = float("inf"), trace: dict[str, str] | None = None,
                 sent: list | None = None) -> list[torch.Tensor] | None:
        """Run the calls; re-send a failed call's tokens to other replicas of the same shards until all succeed.
        Returns outputs aligned with `calls` (which it extends in place), or None when a shard ran out of replicas.
        sent: handles of the first round when `submit` already sent it."""
        done: dict[int, torch.Tensor] = {}
        pending = list(range(len(calls)))
        for _ in range(MAX_CALL_ROUNDS):
            if not pending:
                break
            handles = sent if sent is not None else self._send(layer, hidden, calls, pending, trace)
            sent = None
            remaining = give_up - self.clock()
            if remaining <= 0:
                raise NoReplicaError(f"layer {layer}: expert calls did not complete within "
                                     f"{max(self.failover.call_timeout_s, self.failover.wait_timeout_s):.0f}s")
            gathering = time.perf_counter()
            results = self.transport.gather_settled(handles, min(self.failover.call_timeout_s, remaining))
            self.profile.since("dispatch.gather", gathering)
            retry: list[int] = []
            for i, result in zip(pending, results):
                call = calls[i]
                if not isinstance(result, BaseException):
                    self.breakers.record(call.actor, self.clock(), ok=True)
                    done[i] = result
                    continue
                self.retried_calls += 1
                if self.observer is not None:
                    self.observer.on_retry(call.actor)
                self.mark_failed(call.actor, result)
                replacement = self._replan(layer, call)
                if replacement is None:
                    return None
                for new_call in replacement:
                    calls.append(new_call)
                    retry.append(len(calls) - 1)
            pending = retry
        if pending:
            return None  # still failing after every round: let the caller re-route the layer
        # Drop the failed calls; keep outputs aligned with the calls that served.
        served = sorted(done)
        calls[:] = [calls[i] for i in served]
        return [done[i] for i in served]

    def _replan(self, layer: int, failed: ActorCall) -> list[ActorCall] | None:
        replan: dict[str, ActorCall] = {}
        for expert, token_idx, slot_idx in zip(failed.experts, failed.token_idx, failed.slot_idx):
            others = [a for a in self.live_replicas((layer, expert)) if a != failed.actor]
            if not others:
                return None
            for actor, start, end in split_tokens(others, int(token_idx.numel())):
                add_rows(replan, actor, expert, token_idx[start:end], slot_idx[start:end])
        return list(replan.values())


def _is_actor_death(error: BaseException) -> bool:
    """An actor that is gone (killed, node lost), as opposed to a slow or erroring one."""
    import ray

    return isinstance(error, ray.exceptions.RayActorError)
