"""Per-layer dispatch: group the routed tokens by expert actor, make one call per actor that has tokens, all
calls in flight together, then combine the outputs with the gate weights. Failover happens here too: a failed call's
tokens go to another replica of the same shard within the step, so the step's result is the fault-free one.

`RemoteExperts` is the ExpertBackend the router's decoder uses: a thin shell wiring a Transport to state objects and
pure functions that do the work, each Ray-free and unit-tested on its own:

  dispatch_plan.py   planning a layer's calls and combining their outputs
  replica_health.py  dead actors, breakers, the reviver: which replicas may take a call
  call_retry.py      where a failed call's rows go, and a layer's calls over retry rounds
  table_switch.py    live remap: the table a step uses, switched only between steps
  pending_layers.py  a layer's round between submit and wait, and the rounds still out
  shedding.py        overload shedding's policy; prefetch.py the next layer's experts as hints

Nothing here imports Ray at import time (replica_health.py tells a dead actor from a failed call with Ray's exception
type, looked up then).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

import torch

from ..cluster.breaker import BreakerBoard
from ..cluster.routing_table import RoutingTable, Shard
from ..experts.arrays import HostStager, pack
from ..experts.device_rule import gather_rows, layer_to_host
from ..experts.gating import Routing, degrade
from .call_retry import MAX_CALL_ROUNDS, MAX_LAYER_ATTEMPTS, CallRounds, replan_failed
from .dispatch_plan import ActorCall, combine, plan_calls
from .failover_config import NO_REPLICA_POLICIES, FailoverConfig  # noqa: F401  (re-exported; torch-free there)
from .pending_layers import InFlight, PendingLayer
from .prefetch import address_hints
from .replica_health import ReplicaHealth
from .shedding import ShedPolicy, apply_shed
from .step_profile import StageClock
from .table_switch import TableSwitch
from .transports.base import Transport


class NoReplicaError(RuntimeError):
    """A shard has no live replica and the policy is `wait`, and none came back in time (gRPC UNAVAILABLE)."""


def _kept_on(holder: str, name: str, doc: str) -> property:
    """An attribute that lives on one of RemoteExperts' state objects, read and set under its old name."""
    return property(lambda self: getattr(getattr(self, holder), name),
                    lambda self, value: setattr(getattr(self, holder), name, value), doc=doc)


class RemoteExperts:
    """ExpertBackend whose experts live in actors behind a Transport, with retries, breakers and a no-replica
    policy. `reviver` (optional) looks dead replicas up again, e.g. by actor name after the controller restored
    them; it returns the names that are back."""

    table = _kept_on("switch", "table", "The routing table this step uses (RoutingTable).")
    on_table_applied = _kept_on("switch", "on_table_applied", "Called with the epoch after each table switch.")
    dead = _kept_on("health", "dead", "Actors known to be gone (set of names).")
    breakers = _kept_on("health", "breakers", "The replicas' circuit breakers (BreakerBoard).")
    reviver = _kept_on("health", "reviver", "Looks dead replicas up again; returns the names that are back.")

    def __init__(self, table: RoutingTable, transport: Transport, failover: FailoverConfig | None = None,
                 breakers: BreakerBoard | None = None, reviver: Callable[[set[str]], set[str]] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.transport = transport
        self.failover = (failover or FailoverConfig()).validate()
        self.clock = clock
        self.health = ReplicaHealth(self.failover, breakers, reviver, clock)
        self.switch = TableSwitch(table, self._adopt)
        self._in_flight = InFlight()
        self.calls_per_layer: dict[int, int] = {}  # of the most recent forward; tests check calls == actors hit
        # A layer's routing and rows leave the router's device through pinned buffers with one synchronisation
        # (experts/device_rule.py; tests count them).
        self.stager = HostStager()
        self.round_seconds = 0.0  # wall time spent in expert rounds since creation (benchmarks read it)
        self.profile = StageClock()  # per-stage seconds (router_service/step_profile.py); the router shares one
        self.retried_calls = 0
        self.node_lost_actors = 0  # actors the node watch handed over as dead before a call to them failed
        self.degraded_slots = 0
        self.shed_slots = 0  # slots moved off an overloaded shard (overload shedding)
        # Overload shedding: the policy (created at the first round, when E is known) and each layer's last decision.
        self.shed_policy: ShedPolicy | None = None
        # layer -> (slots to shed [E], experts they may go to [E] bool) of its most recent round: what the
        # in-process reference needs to make the same moves (shedding.apply_shed)
        self.last_shed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.effective: dict[int, Routing] = {}  # layer -> routing actually served (after degrade)
        # Observability (router_service/observability.py); None = off, and then no call is made at all.
        self.observer = None  # .on_layer(layer, served, calls, seconds), .on_retry(actor)
        self.tracer = None  # OpenTelemetry tracer: a span per layer, its context sent along with every call
        # Prefetch (README: Offload): predicts the next MoE layer's experts (router_service/prefetch.py); the
        # prediction rides with this layer's calls to the actors hosting those shards. None = off.
        self.prefetcher = None
        self._step_began: float | None = None  # perf_counter at begin_step, for the prefetch governor
        # Node watch (router_service/node_watch.py): hands over actors found on dead nodes. None = off.
        self.node_watch = None
        self.prefetch_calls = 0  # hints sent as calls of their own (to actors this layer does not call)
        self.prefetch_riding = 0  # hints that rode with an actor's call of this layer

    # ---- health --------------------------------------------------------------------------------------------

    def live_replicas(self, shard: Shard) -> list[str]:
        """Replicas that may take this step's calls (may grant a half-open replica its probe: replica_health.py)."""
        return self.health.live_replicas(self.table, shard)

    def has_live_replica(self, shard: Shard) -> bool:
        return self.health.has_live_replica(self.table, shard)

    def mark_failed(self, actor: str, error: BaseException) -> None:
        self.health.mark_failed(actor, error)

    def effective_routing(self, layer: int, routing: Routing) -> Routing:
        return self.effective.get(layer, routing)

    # ---- live remap (table_switch.py) ----------------------------------------------------------------------

    def stage_table(self, table: RoutingTable, new_actors: dict, gone: Collection[str] = ()) -> None:
        """Switch to `table` when the next step starts (never within a step, so a step uses one placement, unless
        the step is held for lack of a replica: TableSwitch.apply_while_held).
        new_actors: handles of actors the current table does not name yet (already loaded and warm).
        gone: actors the controller lost, which `table` retires: dead to this router from now on."""
        self.dead.update(a for a in gone if a in self.table.actors and a not in table.actors)
        self.switch.stage(table, new_actors)

    def _adopt(self, table: RoutingTable, new_actors: dict) -> None:
        """Just before `table` becomes current: its new actors' handles in, the actors it retires out."""
        actors = self.transport.actors  # every transport keeps its name -> handle map here
        actors.update(new_actors)
        for name in [n for n in actors if n not in table.actors]:
            # Retired by the controller: no call of a later step goes to it. Calls of the step that just ended
            # are done; the controller stops the actor only after every router reported this epoch.
            del actors[name]
            self.health.forget(name)

    def _apply_staged_while_held(self) -> bool:
        """Switch inside a held step unless the staged table retires an actor that may still answer a call of it."""
        return self.switch.apply_while_held(lambda: self._in_flight.actors() - self.health.gone())

    def begin_step(self, lengths: list[int] | None = None) -> None:
        """The decoder starts a forward over sequences feeding `lengths` tokens each: switch to a staged table now,
        then no switch until end_step (same thread)."""
        self.switch.begin_step(self._new_step)
        governor = getattr(self.prefetcher, "governor", None)
        if governor is not None and lengths is not None:
            governor.begin(decode=all(n == 1 for n in lengths), rows=len(lengths))
            self._step_began = time.perf_counter()

    def _new_step(self) -> None:
        self.calls_per_layer = {}
        self.health.new_step()
        self._in_flight.clear()  # a step that failed may have left layers it never waited for

    def end_step(self) -> None:
        self.switch.end_step()
        governor = getattr(self.prefetcher, "governor", None)
        if governor is not None and self._step_began is not None:
            governor.end(time.perf_counter() - self._step_began)
            self._step_began = None

    def apply_if_idle(self, idle_s: float) -> bool:
        """Switch to a staged table now when no step is running and none ended within idle_s."""
        return self.switch.apply_if_idle(idle_s)

    # ---- one layer -----------------------------------------------------------------------------------------

    def run(self, layer: int, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        """hidden: [T, H] -> the routed experts' combined output [T, H]."""
        with self.switch.step_guard:
            return self.wait(self.submit(layer, hidden, routing))

    def submit(self, layer: int, hidden: torch.Tensor, routing: Routing) -> PendingLayer:
        """Start a layer's expert round: apply the no-replica policy, plan the calls and send them. The
        retries, failover and combine happen in `wait`; other work can run in between (the decoder's overlap).
        hidden [T, H] and routing are on the router's device; this is where they cross to the host, once (the
        routing alone when the transport sends device rows: the rows are then gathered on the device)."""
        started = time.perf_counter()
        device_rows = hidden.device.type != "cpu" and getattr(self.transport, "takes_device_rows", False)
        routing, staged = layer_to_host(routing, [] if device_rows else [hidden], self.stager,
                                        wide=self._needs_probs())
        rows_from = hidden if device_rows else staged[0]
        span = None
        if self.tracer is not None:
            span = self.tracer.start_span("expertmesh.dispatch", attributes={"layer": layer})
        try:
            carrier = None
            if span is not None:
                from ..experts.telemetry import carrier_of

                carrier = carrier_of(span)
            if self.node_watch is not None:
                lost = self.node_watch.take_lost()
                if lost:
                    self.node_lost_actors += len(lost)
                    self.health.nodes_lost(lost)
            self.health.revive()
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
            calls = plan_calls(layer, served, self.table, self.health.replicas_of(self.table))
            self.profile.since("dispatch.plan", planning)
            hints = self._prefetch_hints(layer, hidden, served) if self.prefetcher is not None else None
            handles = self._send(layer, rows_from, calls, range(len(calls)), carrier, hints)
        except BaseException:
            if span is not None:
                span.end()
            raise
        pending = PendingLayer(layer, hidden, rows_from, routing, served, calls, handles, shed, deadline, give_up,
                               carrier, span, started)
        pending.busy_s = time.perf_counter() - started
        self.profile.add("dispatch.submit", pending.busy_s)
        self._in_flight.add(pending)
        return pending

    def wait(self, pending: PendingLayer) -> torch.Tensor:
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
                    calls = plan_calls(p.layer, served, self.table, self.health.replicas_of(self.table))
                    self.profile.since("dispatch.plan", planning)
                outputs = self._execute(p.layer, p.rows_from, calls, p.give_up, p.carrier,
                                        p.handles if attempt == 0 else None)
                if outputs is not None:
                    break
            with self.switch.step_lock:  # micro-batches of one step add up; a bare `run` reports its own calls
                before = self.calls_per_layer.get(p.layer, 0) if self.switch.steps_running else 0
                self.calls_per_layer[p.layer] = before + len(calls)
            self.effective[p.layer] = served
            self.degraded_slots += served.degraded
            self.shed_slots += served.shed
            combining = time.perf_counter()
            # Outputs arrive in host memory (or on hidden's device, read there by a device-rows transport) and the
            # plan is host bookkeeping: combine sends what is on the host to hidden's device in one batch of
            # non-blocking copies and adds up there.
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
            self._in_flight.discard(p)
            if p.span is not None:
                p.span.end()
            self.switch.round_done()

    def _needs_probs(self) -> bool:
        """Whether a layer's gate probabilities ([T, E], and the selection scores) must come to the host with its
        routing: for the load statistics' entropy, degrading around a lost shard, or shedding."""
        return (self.observer is not None or self.failover.no_replica_policy == "degrade"
                or self.failover.shed.enabled)

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
        live = self.health.live_replica_counts(self.table, layer, num_experts)  # [E]
        return self.shed_policy.observe(layer, self.clock(), offered, live)

    def _shed_targets(self, layer: int, served: Routing) -> torch.Tensor:
        """[E] bool: experts a shed slot may go to: served by a live replica and not shedding themselves."""
        return self.health.live_mask(self.table, layer, served.probs.shape[1]) & ~self.shed_policy.shedding(layer)

    def _apply_policy(self, layer: int, routing: Routing, deadline: float) -> Routing:
        """Make sure every routed expert has a live replica: wait for one, or degrade to the next-best expert."""
        while True:
            missing = self.health.missing_experts(self.table, layer, routing)
            if not missing:
                return routing
            if self.failover.no_replica_policy == "degrade":
                return degrade(routing, self.health.live_mask(self.table, layer, routing.probs.shape[1]))
            if self._apply_staged_while_held():
                continue  # a stand-in for the lost replicas may be in the new table
            if self.clock() >= deadline:
                raise NoReplicaError(
                    f"no live replica of layer {layer} expert(s) {missing} within {self.failover.wait_timeout_s:.0f}s"
                )
            time.sleep(0.05)
            self.health.revive(force=True)

    def _send(self, layer: int, hidden: torch.Tensor, calls: list[ActorCall], which, trace: dict[str, str] | None,
              hints: dict[str, list[Shard]] | None = None):
        """Submit calls[i] for i in `which` through the transport; -> their handles.
        hidden [T, H] is the layer's host copy (submit brought it over with the routing in one wait): every call's
        rows are gathered from it here, on the host, with no further device work. For a transport that sends
        device rows it is the device hidden itself, and the rows are gathered there (experts/device_rule.py).
        hints: actor -> shards to prefetch; they ride with the actor's call where the transport takes them (refs,
        grpc, socket), otherwise, and for actors without a call, go as `prefetch` calls of their own after the calls."""
        # `trace` only when tracing is on, so a transport without it still works with tracing off.
        extra = {} if trace is None else {"trace": trace}
        sending = time.perf_counter()
        staged = gather_rows(hidden, [calls[i].tokens for i in which])  # [n_i, H] each
        hints = dict(hints or {})
        rides = getattr(self.transport, "takes_prefetch", False)
        handles = []
        for i, rows in zip(which, staged):
            call = calls[i]
            hint = {"prefetch": hints.pop(call.actor)} if rides and call.actor in hints else {}
            self.prefetch_riding += bool(hint)
            wire = pack(rows) if rows.device.type == "cpu" else rows  # device rows: the transport moves them
            handles.append(self.transport.submit(call.actor, layer, call.experts, call.counts, wire, **extra, **hint))
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
        return {} if predicted is None else address_hints(*predicted, self.table.replicas, self.dead)

    def _execute(self, layer: int, hidden: torch.Tensor, calls: list[ActorCall],
                 give_up: float = float("inf"), trace: dict[str, str] | None = None,
                 sent: list | None = None) -> list[torch.Tensor] | None:
        """Run the calls; re-send a failed call's tokens to other replicas of the same shards until all succeed.
        Returns outputs aligned with `calls` (which it extends in place), or None when a shard ran out of replicas
        or calls still fail after MAX_CALL_ROUNDS (the caller re-routes the layer).
        sent: handles of the first round when `submit` already sent it."""
        rounds = CallRounds(calls)
        for _ in range(MAX_CALL_ROUNDS):
            if not rounds.pending:
                break
            handles = sent if sent is not None else self._send(layer, hidden, calls, rounds.pending, trace)
            sent = None
            remaining = give_up - self.clock()
            if remaining <= 0:
                raise NoReplicaError(f"layer {layer}: expert calls did not complete within "
                                     f"{max(self.failover.call_timeout_s, self.failover.wait_timeout_s):.0f}s")
            gathering = time.perf_counter()
            results = self.transport.gather_settled(handles, min(self.failover.call_timeout_s, remaining))
            self.profile.since("dispatch.gather", gathering)
            if not rounds.settle(results, self.health.record_ok, lambda call, error: self._failed(layer, call, error)):
                return None
        return rounds.outputs()

    def _failed(self, layer: int, call: ActorCall, error: BaseException) -> list[ActorCall] | None:
        """A call failed: count it, mark its actor, and send its rows to the shards' other live replicas."""
        self.retried_calls += 1
        if self.observer is not None:
            self.observer.on_retry(call.actor)
        self.mark_failed(call.actor, error)
        return replan_failed(layer, call, self.live_replicas)
