"""A discrete-event simulation of a DeepSeek-V3-sized expertmesh fleet under published failure rates, running the
project's real policies. Pure (numpy; torch only when shedding runs); no Ray.

The fleet: `gpus` serving GPUs in servers of `gpus_per_node`, plus `spare_nodes` idle servers; one expert actor per
GPU hosting `slots_per_gpu` shards of every MoE layer (DeepSeek-V3: 61 layers, the first 3 dense, so 58 MoE layers
of 256 routed experts, top-8; the shared expert runs on the router and is not placed). Faults come from
cluster/fleet_failures.py, load from cluster/fleet_trace.py, times from cluster/fleet_model.py.

The policies it calls, not copies:
- placement: cluster/planner.py `plan` (the first placement; with `current`, every re-plan), which packs with
  eplb_greedy and checks placements with shard_placement;
- breaker: cluster/breaker.py decides how long routers keep calling a dead replica (fail-fast deaths vs. calls that
  hang until the call timeout on a lost node);
- lost-actor restore: cluster/lost_restore.py `plan_restore` over the rooms cluster/node_choice.py `node_rooms`
  builds from Ray-shaped node tables (full restore in place or on a spare, stand-ins, deferral);
- autoscale: cluster/autoscale.py `decide` sets the replica counts the planner places at each elastic step;
- shedding: router_service/shedding.py `decide` on every segment's offered load against live capacity.

Strategies, on a fault detected by the controller:
- none: no controller; a dead replica is skipped by the routers' breakers and comes back with its hardware (repair);
- restart: plan_restore: in place when the node is alive (software faults), on a spare GPU when one is free, else
  deferred (its shards have other replicas) or a stand-in on the survivors; displaced actors return at repair;
- replan: in place when the node is alive; everything else re-planned by the planner over the live GPUs plus free
  spares (a live remap), and an elastic step (autoscale + planner) every `rebalance_hours` when a layer's imbalance
  passes `rebalance_threshold` or GPUs can rejoin.

Between events nothing changes, so each segment adds rates x its length (cluster/fleet_metrics.py). Overlapping faults
within one restore window are handled approximately (a re-plan supersedes the one in flight).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

import numpy as np

from . import autoscale as autoscale_policy
from .actor_slots import ActorSlot
from .breaker import BreakerConfig
from .fleet_config import (  # noqa: F401  (re-exported: the simulator's public names live here too)
    DEAD,
    DEEPSEEK_V3_SHARD_BYTES,
    DEFERRED,
    EJECTED,
    SERVING,
    STOOD_IN,
    STRATEGIES,
    FleetConfig,
    breaker_window,
)
from .fleet_failures import NODE_SCOPES, FailureModel, Fault
from .fleet_metrics import FaultRecord, FleetMetrics, segment_rates, shard_counts
from .fleet_model import RestoreTimes
from .fleet_trace import FleetTrace, TraceShape
from .lost_restore import LostActor, plan_restore
from .node_choice import node_rooms
from .planner import plan
from .shard_placement import Placement, Topology


@dataclass
class _Open:
    record: FaultRecord
    pending: set[int]  # its GPUs not serving again yet
    uncovered: np.ndarray | None = None  # [L, E] shards it left with no live replica


@dataclass(order=True)
class _Event:
    t: float
    seq: int
    kind: str = field(compare=False)
    data: dict = field(compare=False, default_factory=dict)


class FleetSim:
    def __init__(self, cfg: FleetConfig, times: RestoreTimes | None = None, shape: TraceShape | None = None,
                 failures: FailureModel | None = None, faults: list[Fault] | None = None,
                 breaker: BreakerConfig | None = None, shed_config=None):
        self.cfg = cfg.validate()
        self.times = times or RestoreTimes()
        self.rng = np.random.default_rng([cfg.seed, 7])
        self.horizon = cfg.days * 86400
        self.gpn, self.nodes = cfg.gpus_per_node, cfg.gpus // cfg.gpus_per_node + cfg.spare_nodes
        G = self.G = self.nodes * self.gpn
        if faults is None:  # the serving GPUs' faults depend on the seed only, not on the spares: runs compare
            model = failures or FailureModel()
            faults = model.sample(np.random.default_rng([cfg.seed, 3]), cfg.gpus, self.gpn, self.horizon)
            if cfg.spare_nodes:
                spare = model.sample(np.random.default_rng([cfg.seed, 4]), G - cfg.gpus, self.gpn, self.horizon)
                faults = sorted(faults + [replace(f, gpu=f.gpu + cfg.gpus) for f in spare], key=lambda f: f.t_s)
        self.trace = FleetTrace(shape or TraceShape(), cfg.modelled_layers, cfg.experts, seed=cfg.seed,
                                diurnal=cfg.diurnal)
        self.breaker = breaker or BreakerConfig()
        self.windows = {lat: breaker_window(self.breaker, cfg.call_gap_s, lat) for lat in (0.0, cfg.call_timeout_s)}
        self.active = np.arange(G) < cfg.gpus  # [G] in the fleet (may host shards)
        self.down = np.zeros(G, dtype=bool)  # [G] hardware out
        self.down_by = np.full(G, -1)
        self.actor = np.full(G, SERVING)  # [G] state of an active GPU's actor
        self.node_down = np.zeros(self.nodes, dtype=bool)
        self.controller_node = cfg.controller_node
        self.metrics = FleetMetrics()
        self.open: dict[int, _Open] = {}
        self.events: list[_Event] = []
        self.seq = 0
        self.remap_generation = 0
        self.remap_fids: set[int] = set()
        self.reserved: set[int] = set()  # idle GPUs a restore is starting an actor on
        self.autoscale_state = autoscale_policy.initial_state()
        share, rate = self.trace.hour(0)
        self.offered = cfg.tokens_per_s * cfg.top_k * rate * share  # [L, E] slots/s
        topo = Topology(self.nodes, self.gpn, cfg.slots, frozenset(np.flatnonzero(~self.active).tolist()))
        self.placement = plan(self.offered, topo, max_rounds=64, polish_rounds=8, search_counts=False)
        self.metrics.plans += 1
        # A GPU's capacity per layer (slots/s): the mean GPU at mean traffic runs at mean_utilisation. Its replicas
        # share it in proportion to their load (one GPU computes them all), so a shard's capacity is, summed over
        # its live replicas, the GPU's capacity times the replica's share of that GPU's load.
        self.gpu_capacity = cfg.tokens_per_s * cfg.top_k / cfg.gpus / cfg.mean_utilisation
        self.capacity = self.gpu_capacity / cfg.slots  # one replica's share on an evenly loaded GPU
        self._shed_setup(shed_config)
        self._dirty = True
        for i, f in enumerate(faults):
            self._push(f.t_s, "fault", fault=f, fid=i)
        for h in range(1, int(self.horizon // 3600) + 1):
            self._push(h * 3600.0, "hour", hour=h)

    # ---- the loop ---------------------------------------------------------------------------------------------

    def run(self) -> dict:
        t = 0.0
        while self.events and self.events[0].t < self.horizon:
            ev = heapq.heappop(self.events)
            self._segment(t, ev.t)
            t = ev.t
            getattr(self, f"_on_{ev.kind}")(ev.t, **ev.data)
        self._segment(t, self.horizon)
        out = self.metrics.summary()
        out["config"] = {"strategy": self.cfg.strategy, "gpus": self.cfg.gpus, "spare_gpus": self.cfg.spare_nodes *
                         self.gpn, "days": self.cfg.days, "slots_per_gpu": self.cfg.slots,
                         "replica_capacity_slots_s": round(self.capacity, 3)}
        out["breaker_window_s"] = {"process_died": self.windows[0.0],
                                   "node_lost": self.windows[self.cfg.call_timeout_s]}
        return out

    def _push(self, t: float, kind: str, **data) -> None:
        self.seq += 1
        heapq.heappush(self.events, _Event(t, self.seq, kind, data))

    def _segment(self, t0: float, t1: float) -> None:
        if self._dirty:
            self._recount(t0)
        if t1 <= t0:
            return
        capacity = self._shard_capacity()
        shed = self._shed(t0, capacity)
        rates = segment_rates(self.offered, self.n_table, self.n_dead, self.n_live, capacity, shed)
        idle = ~self.active & ~self.down
        lost = self.down.sum() + (self.active & ~self.down & (self.actor != SERVING) & (self.actor != STOOD_IN)).sum()
        self.metrics.add(rates, t1 - t0, float(lost), float(idle.sum()),
                         float((self.active & (self.actor == SERVING)).sum()))

    def _recount(self, t: float) -> None:
        slots, E = self.placement.slots, self.cfg.experts
        a, st = self.active, self.actor
        self.n_table = shard_counts(slots, (a & (st != DEFERRED)).astype(float), E)
        self.n_dead = shard_counts(slots, (a & ((st == DEAD) | (st == EJECTED))).astype(float), E)
        self.n_live = shard_counts(slots, (a & ((st == SERVING) | (st == STOOD_IN))).astype(float), E)
        self.live_w = np.where(a & (st == SERVING), 1.0, np.where(a & (st == STOOD_IN), self.cfg.stand_in_capacity,
                                                                  0.0))  # [G] capacity of each GPU's actor
        self._dirty = False
        for o in self.open.values():
            if o.uncovered is not None and not (self.n_live[o.uncovered] <= 0).any():
                o.record.covered_s, o.uncovered = t - o.record.t_s, None

    # ---- shedding (router_service/shedding.py) ----------------------------------------------------------------

    def _shed_setup(self, shed_config) -> None:
        self.shed_state = None
        if not self.cfg.shed:
            return
        from ..router_service.failover_config import ShedConfig

        # One expert round here is one second of the fleet's traffic, so a replica's capacity per round is its
        # capacity in slots/s.
        self.shed_config = replace(shed_config or ShedConfig(enabled=True),
                                   replica_tokens_per_step=max(1, round(self.capacity))).validate()
        self.shed_clock = 0.0

    def _shard_capacity(self) -> np.ndarray:
        """[L, E] slots/s each shard's live replicas can take (see __init__)."""
        slots, (L, E) = self.placement.slots, self.offered.shape
        per_replica = np.concatenate([self.offered / np.maximum(self.n_live, 1), np.zeros((L, 1))], axis=1)
        idx = np.where(slots < 0, E, slots).reshape(L, -1)
        replica_load = np.take_along_axis(per_replica, idx, axis=1).reshape(slots.shape)  # [L, G, S]
        live = self.live_w[None, :, None] > 0
        gpu_load = (replica_load * live).sum(axis=2, keepdims=True)  # [L, G, 1]
        share = np.where(gpu_load > 0, replica_load / np.maximum(gpu_load, 1e-300), 0.0)  # [L, G, S]
        weight = share * self.gpu_capacity * self.live_w[None, :, None]
        ok = slots >= 0
        index = (np.arange(L)[:, None, None] * E + slots)[ok]
        return np.bincount(index, weights=weight[ok], minlength=L * E).reshape(L, E)

    def _shed(self, t0: float, capacity: np.ndarray) -> np.ndarray:
        """[L, E] slots/s the policy moves in this segment: its steady state once the segment's load has held for
        the policy's window (a segment lasts minutes; the window is seconds)."""
        if not self.cfg.shed:
            return np.zeros_like(self.offered)
        import torch

        from ..router_service import shedding

        if self.shed_state is None:
            self.shed_state = shedding.LayerShedState.empty(self.offered.size)
        cfg = self.shed_config
        offered = torch.from_numpy(self.offered.ravel())
        replicas = torch.from_numpy(capacity.ravel() / cfg.replica_tokens_per_step)  # capacity in replica units
        now = max(t0, self.shed_clock)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # vectors of ~15k: more threads only contend (100x slower on a 2-core machine)
        try:
            for step in (now, now + max(cfg.window_s, cfg.off_window_s)):
                shed, self.shed_state = shedding.decide(cfg, step, offered, replicas, self.shed_state)
        finally:
            torch.set_num_threads(threads)
        self.shed_clock = step
        out = shed.numpy().astype(np.float64).reshape(self.offered.shape)
        if out.any():
            self.metrics.shed_segments += 1
        return out

    # ---- events -----------------------------------------------------------------------------------------------

    def _on_hour(self, t: float, hour: int) -> None:
        share, rate = self.trace.hour(hour)
        self.offered = self.cfg.tokens_per_s * self.cfg.top_k * rate * share
        if self.cfg.strategy == "replan" and hour % max(1, round(self.cfg.rebalance_hours)) == 0:
            self._elastic(t, periodic=True)

    def _on_fault(self, t: float, fault: Fault, fid: int) -> None:
        gpus = [g for g in fault.gpus(self.gpn) if not self.down[g]]
        hit = [g for g in gpus if self.active[g] and self.actor[g] in (SERVING, STOOD_IN)]
        record = FaultRecord(t, fault.scope, len(hit))
        self.metrics.faults.append(record)
        if fault.scope != "software":
            self.down[gpus] = True
            self.down_by[gpus] = fid
            self._push(t + fault.repair_s, "repair", fid=fid, gpus=gpus)
        if fault.scope in NODE_SCOPES:
            self.node_down[fault.gpu // self.gpn] = True
        if not hit:
            record.how, record.restore_s = "idle", 0.0
            return
        if self._dirty:
            self._recount(t)
        before = self.n_live.copy()
        self.actor[hit] = DEAD
        self._recount(t)
        newly = (self.n_live <= 0) & (before > 0)  # [L, E] shards this fault left without a live replica
        o = _Open(record, set(hit))
        if newly.any():
            o.uncovered, record.degraded_shards = newly, int(newly.sum())
        self.open[fid] = o
        latency = self.cfg.call_timeout_s if fault.scope in NODE_SCOPES else 0.0
        self._push(t + self.windows[latency], "eject", gpus=hit)
        if self.cfg.strategy == "none":
            record.how = "repair"
            if fault.scope == "software":
                self._push(t + fault.repair_s, "repair", fid=fid, gpus=[])
            return
        node = fault.gpu // self.gpn
        controller_lost = fault.scope in NODE_SCOPES and node == self.controller_node
        if controller_lost:
            alive = np.flatnonzero(~self.node_down[: self.cfg.gpus // self.gpn])
            self.controller_node = int(alive[0]) if len(alive) else node
        detect = self.times.detect_seconds(fault.scope in NODE_SCOPES, controller_lost, float(self.rng.random()))
        self._push(t + detect, "detect", fid=fid, scope=fault.scope)

    def _on_eject(self, t: float, gpus: list[int]) -> None:
        for g in gpus:
            if self.actor[g] == DEAD:
                self.actor[g] = EJECTED
                self._dirty = True

    def _on_detect(self, t: float, fid: int, scope: str) -> None:
        o = self.open.get(fid)
        if o is None:
            return
        lost = sorted(g for g in o.pending if self.active[g] and self.actor[g] in (DEAD, EJECTED))
        if not lost:
            return
        spares = self.cfg.strategy == "restart"  # replan places everything that does not fit at home itself
        restore = self._plan_restore(lost, spares)
        self.metrics.restore_plans += 1
        hows = set()
        taken: set[int] = set()
        full = set()
        for name, slot in restore.full.items():
            g = _gpu_of(name)
            at_home = slot.node_id == self._node_id(g // self.gpn) and not self.down[g]
            new = g if at_home else self._idle_gpu(_gpu_of(slot.node_id), taken)
            if new is None:
                continue
            taken.add(new)
            self.reserved.add(new)
            work = self.times.actor_start_s + self.times.load_seconds(self.cfg.shard_bytes, self._shards_of(g))
            self._push(t + work, "restored", fid=fid, old=g, new=new)
            full.add(g)
            hows.add("full")
        rest = [g for g in lost if g not in full]
        if self.cfg.strategy == "replan" and rest:
            self.remap_fids.add(fid)
            self._elastic(t, periodic=False)
            hows.add("remap")
        elif rest:
            stood = sorted({_gpu_of(n) for s in restore.stand_ins.values() for n in s.replaces})
            deferred = sorted(_gpu_of(n) for n in restore.deferred)
            if stood:
                shards = self._all_layers(sum(len(s.shards) for s in restore.stand_ins.values()))
                work = self.times.stand_in_start_s + self.times.load_seconds(self.cfg.shard_bytes, shards)
                self._push(t + work, "stood_in", fid=fid, gpus=stood)
                hows.add("stand_in")
            if deferred:
                self._push(t + self.times.stand_in_start_s, "deferred", gpus=deferred)
                hows.add("deferred")
        o.record.how = "+".join(sorted(hows))

    def _on_restored(self, t: float, fid: int, old: int, new: int) -> None:
        self.reserved.discard(new)
        if not self.active[old]:
            self._done(t, fid, old)  # a re-plan took its shards meanwhile: they serve elsewhere
            return
        if self.down[new]:
            return  # its new home failed meanwhile: it waits for that GPU's repair
        if new != old:
            slots = self.placement.slots.copy()
            slots[:, new], slots[:, old] = slots[:, old], -1
            self.active[old], self.active[new] = False, True
            self._set_placement(slots)
        self.actor[new] = SERVING
        self._dirty = True
        self._done(t, fid, old)

    def _on_stood_in(self, t: float, fid: int, gpus: list[int]) -> None:
        for g in gpus:
            if self.active[g] and self.actor[g] in (DEAD, EJECTED):
                self.actor[g] = STOOD_IN
                self._dirty = True
            self._done(t, fid, g)

    def _on_deferred(self, t: float, gpus: list[int]) -> None:
        for g in gpus:
            if self.active[g] and self.actor[g] in (DEAD, EJECTED):
                self.actor[g] = DEFERRED
                self._dirty = True

    def _on_repair(self, t: float, fid: int, gpus: list[int]) -> None:
        back = [g for g in gpus if self.down_by[g] == fid]
        self.down[back] = False
        self.down_by[back] = -1
        for n in {g // self.gpn for g in back}:
            self.node_down[n] = self.down[n * self.gpn:(n + 1) * self.gpn].all()
        o = self.open.get(fid)
        if self.cfg.strategy == "none":  # the process comes back with its hardware (or an operator's restart)
            for g in sorted(o.pending) if o else ():
                if self.active[g] and not self.down[g]:
                    self.actor[g] = SERVING
                    self._done(t, fid, g)
            self._dirty = True
        elif self.cfg.strategy == "restart":
            # Displaced actors (stood in for, deferred, or with no room anywhere) return home at their normal share.
            for g in back:
                if self.active[g] and self.actor[g] != SERVING and g not in self.reserved:
                    self.reserved.add(g)
                    work = self.times.actor_start_s + self.times.load_seconds(self.cfg.shard_bytes, self._shards_of(g))
                    self._push(t + work, "restored", fid=fid, old=g, new=g)
        # replan: repaired GPUs are idle until the next elastic step takes them back in.

    def _on_remapped(self, t: float, generation: int, slots: np.ndarray, usable: np.ndarray, fids: list[int]) -> None:
        if generation != self.remap_generation:
            return  # a later re-plan supersedes this one
        # GPUs that died since the plan keep their state (their own fault's detection handles them); the rest,
        # joining ones included, serve.
        died = usable & (self.down | (self.active & ((self.actor == DEAD) | (self.actor == EJECTED))))
        self.actor[usable & ~died] = SERVING
        self.actor[usable & self.down] = DEAD
        self.active = usable.copy()
        self._set_placement(slots)
        self._dirty = True
        for fid in fids:
            o = self.open.get(fid)
            for g in sorted(o.pending if o else ()):
                self._done(t, fid, g)
        self.remap_fids -= set(fids)

    # ---- helpers ----------------------------------------------------------------------------------------------

    def _done(self, t: float, fid: int, g: int) -> None:
        o = self.open.get(fid)
        if o is None:
            return
        o.pending.discard(g)
        if not o.pending:
            o.record.restore_s = t - o.record.t_s
            if o.uncovered is not None:
                self._recount(t)
            del self.open[fid]

    def _set_placement(self, slots: np.ndarray) -> None:
        topo = Topology(self.nodes, self.gpn, self.cfg.slots, frozenset(np.flatnonzero((slots < 0).all(axis=(0, 2)))
                                                                       .tolist()))
        self.placement = Placement(topo, self.cfg.experts, slots)

    def _shards_of(self, g: int) -> int:
        """Shards GPU g hosts over all the model's layers (from the simulated ones); a full GPU if none."""
        simulated = int((self.placement.slots[:, g] >= 0).sum()) or self.cfg.modelled_layers * self.cfg.slots
        return self._all_layers(simulated)

    def _all_layers(self, shards: int) -> int:
        return math.ceil(shards * self.cfg.layers / self.cfg.modelled_layers)

    def _node_id(self, n: int) -> str:
        return f"node-{n}"

    def _idle_gpu(self, node: int, taken: set[int]) -> int | None:
        for g in range(node * self.gpn, (node + 1) * self.gpn):
            if not self.active[g] and not self.down[g] and g not in taken and g not in self.reserved:
                return g
        return None

    def _plan_restore(self, lost: list[int], spares: bool):
        """cluster/lost_restore.plan_restore over Ray-shaped node tables (cluster/node_choice.node_rooms)."""
        cpus = self.cfg.cpus_per_actor
        idle = ~self.active & ~self.down
        alive, available = [], {}
        for n in range(self.nodes):
            if self.node_down[n]:
                continue
            nid = self._node_id(n)
            alive.append({"NodeID": nid, "Alive": True, "Resources": {"CPU": cpus * self.gpn, "GPU": self.gpn}})
            free = sum(1 for g in range(n * self.gpn, (n + 1) * self.gpn)
                       if idle[g] and g not in self.reserved) if spares else 0
            available[nid] = {"CPU": cpus * free, "GPU": float(free)}
        rooms = node_rooms(alive, available, suspect=())
        serving = self.active & ((self.actor == SERVING) | (self.actor == STOOD_IN))
        hosts = self.placement.slots  # [L, G, S]
        live_nodes: dict = {}
        lost_actors = []
        for g in lost:
            layer_idx, slot_idx = np.nonzero(hosts[:, g] >= 0)
            shards = [(int(layer), int(hosts[layer, g, s])) for layer, s in zip(layer_idx, slot_idx, strict=True)]
            for layer, e in shards:
                gs = np.flatnonzero(((hosts[layer] == e).any(axis=1)) & serving)
                live_nodes[(layer, e)] = {self._node_id(int(x) // self.gpn) for x in gs}
            # A GPU fault leaves the node up but not that GPU: its actor cannot come back "at home".
            home = self._node_id(g // self.gpn) if not self.down[g] else "-"
            slot = ActorSlot(f"gpu-{g}", home, cpus, 1.0, g % self.gpn)
            lost_actors.append(LostActor(slot, tuple(shards)))
        return plan_restore(lost_actors, rooms, live_nodes, [], lambda i: f"stand-in-{i}", min_cpus=0.1)

    def _elastic(self, t: float, periodic: bool) -> None:
        """The replan strategy's elastic step: which GPUs serve (lost ones out, free spares and repaired GPUs in up
        to the fleet size), the autoscaler's replica counts, the planner's placement; published after the remap."""
        cfg = self.cfg
        restoring = np.zeros(self.G, dtype=bool)
        restoring[[g for g in self.reserved if self.active[g]]] = True  # restarting in place: keep their shards
        healthy = self.active & ~self.down & ((self.actor == SERVING) | restoring)
        usable = healthy.copy()
        want = cfg.gpus - int(usable.sum())
        idle = np.flatnonzero(~self.active & ~self.down)
        usable[idle[:max(want, 0)]] = True
        joining = int(max(want, 0) and len(idle))
        current = self.placement
        topo = Topology(self.nodes, self.gpn, cfg.slots, frozenset(np.flatnonzero(~usable).tolist()))
        gpu_load = current.gpu_load(self.offered)[:, usable]  # [L, live]
        before = float((gpu_load.max(axis=1) / np.maximum(gpu_load.mean(axis=1), 1e-12)).max())
        replicas, scaled = None, False
        if cfg.autoscale:
            live = int(usable.sum())
            counts = np.clip(shard_counts(current.slots, usable.astype(float), cfg.experts), 1, live).astype(np.int64)
            ctx = autoscale_policy.AutoscaleContext(now=t, load=self.offered, replicas=counts, gpus=live)
            conf = autoscale_policy.AutoscaleConfig(
                target_load_per_replica=self.capacity * cfg.mean_utilisation, max_gpus=cfg.gpus,
                base_gpus=cfg.gpus, slots_per_gpu=cfg.slots, max_replicas_per_shard=cfg.gpus,
                downscale_delay_s=cfg.rebalance_hours * 3600)
            decision, self.autoscale_state = autoscale_policy.decide(ctx, self.autoscale_state, conf)
            self.metrics.autoscale_decisions += 1
            replicas, scaled = decision.replicas, decision.changed
        # As cluster/elastic.py's control_step: act when the counts change or a layer's imbalance is above the
        # threshold; here also when GPUs were lost or can rejoin.
        if periodic and not joining and not self.remap_fids and not scaled and before <= cfg.rebalance_threshold:
            return
        new = plan(self.offered, topo, current=current, replicas=replicas, max_rounds=64,
                   polish_rounds=8, search_counts=False)
        self.metrics.plans += 1
        if periodic and not joining and not self.remap_fids and not scaled:
            after = float(new.imbalance(self.offered).max())
            if after >= before - 1e-9:
                return  # no better placement
        moved = (new.hosts() & ~current.hosts()).sum(axis=(0, 2))  # [G] shards each GPU loads
        work = self.times.remap_s + self.times.load_seconds(cfg.shard_bytes, self._all_layers(int(moved.max())))
        self.remap_generation += 1
        self._push(t + work, "remapped", generation=self.remap_generation, slots=new.slots.copy(), usable=usable,
                   fids=sorted(self.remap_fids))


def _gpu_of(name: str) -> int:
    """"gpu-12" or "node-3" -> 12 or 3."""
    return int(name.rsplit("-", 1)[1])


def run_fleet(cfg: FleetConfig, **kwargs) -> dict:
    """One simulation; see FleetSim for the keyword arguments."""
    return FleetSim(cfg, **kwargs).run()
