"""Which expert actors the controller runs, where, and in what state: the controller's bookkeeping. Pure; no Ray.

One `ReplicaRegistry` per controller incarnation. It holds the placement (`spec`, replaced on every remap), each
actor's slot, and what the watch learned: generations, the node each actor was last seen on, which are lost or being
restored, which an operator drained, which lost actors are displaced (cluster/displacement.py). The controller's
actor methods read and update it; the decisions built on it (who is expected, who serves, what to publish, what to
persist, where the survivors are) are methods here, so they are tested on crafted states without Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, replace

from .actor_slots import ActorSlot
from .controller_record import ControllerRecord
from .lost_restore import LostActor, NodeRoom, RestorePlan, plan_restore
from .placement_claims import ClaimLedger
from .pool_spec import PoolSpec
from .routing_table import Shard

# What a probe gives for an actor Ray still lists that did not answer within the timeout (ops.probe): busy or hung.
SILENT = "silent"


class ReplicaRegistry:
    def __init__(self, spec: PoolSpec, slots: dict[str, ActorSlot], record: ControllerRecord | None = None,
                 claims: ClaimLedger | None = None):
        record = record or ControllerRecord()
        self.spec = spec  # replaced (not mutated) when the placement changes
        self.slots = dict(slots)
        self.epoch = record.epoch
        self.drained: set[str] = set(record.drained)
        self.generations: dict[str, int] = {}
        self.nodes: dict[str, str] = {}  # actor -> node id it was last seen on
        self.restoring: set[str] = set()
        self.lost: set[str] = set()  # expected actors whose last probe failed (restoring or not)
        self.silent: dict[str, int] = {}  # name -> probes in a row it left unanswered while Ray still listed it
        # Lost actors whose restart on their own node waited unplaced (cluster/restore_flow.py): their returned share
        # went to another actor, so their next plan fits them by free room. Forgotten once they answer.
        self.home_taken: set[str] = set()
        # Lost actors not back at their normal share: name -> {"slot", "shards", "by": the stand-in hosting its
        # shards, or None while its shards run on their other replicas}. Moved back when a node with room joins.
        self.displaced: dict[str, dict] = dict(record.displaced)
        self.stand_in_serial = record.stand_in_serial
        self.restore_request: list[dict] = list(record.restore_request)  # bundles asked for the displaced actors
        self.requested_gpus = 0  # one-GPU bundles the elastic loop asked Ray's autoscaler for (not persisted)
        # Planned placements Ray does not count yet (cluster/placement_claims.py); not persisted: a new incarnation
        # plans from Ray's table, and a claim outlives its plan by at most claim_ttl_s anyway.
        self.claims = claims if claims is not None else ClaimLedger()

    @classmethod
    def resume(cls, spec: PoolSpec, slots: Sequence[ActorSlot], published: dict | None,
               record: ControllerRecord, claims: ClaimLedger | None = None) -> ReplicaRegistry:
        """The state a (re)started controller begins with: its first arguments, overridden by the last published
        table (Ray restarts a crashed controller with its first arguments; the placement may have changed since)."""
        by_name = {s.name: s for s in slots}
        if published is not None:
            spec = spec.with_actor_shards(published["actor_shards"])
            by_name.update({name: ActorSlot(**slot) for name, slot in published["slots"].items()})
        return cls(spec, by_name, record, claims)

    def record(self) -> ControllerRecord:
        return ControllerRecord(self.epoch, set(self.drained), self.displaced, self.stand_in_serial,
                                self.restore_request)

    # ---- who is what ---------------------------------------------------------------------------------------------

    def expected(self) -> list[str]:
        """Actors that should be running: the placement minus drained ones."""
        return [name for name in self.spec.actor_shards if name not in self.drained]

    def serving(self) -> list[str]:
        """Expected actors whose last probe answered and that are not being restored."""
        return [n for n in self.expected() if n not in self.lost and n not in self.restoring]

    def down(self) -> set[str]:
        """Actors that serve nothing now: drained, lost (last probe failed) or being restored."""
        return set(self.drained) | self.lost | self.restoring

    def node_of(self, name: str) -> str:
        """The node it was last seen on, else its slot's."""
        return self.nodes.get(name) or self.slot_of(name).node_id

    def slot_of(self, name: str) -> ActorSlot:
        """Its slot; for an expected actor whose slot this incarnation never learnt, a stand-in guess: the most
        common share among the known slots, on the node it was last seen on. Seen in the CI chaos drill: a
        controller recreated at the same tick as a node loss raised KeyError here on every pass, so nothing was
        restored and a new router replica, which looks its actors up by name, never started."""
        if name in self.slots:
            return self.slots[name]
        shares = [(s.num_cpus, s.num_gpus) for s in self.slots.values()] or [(1.0, 0.0)]
        cpus, gpus = max(set(shares), key=lambda share: (shares.count(share), share))
        return ActorSlot(name=name, node_id=self.nodes.get(name, ""), num_cpus=cpus, num_gpus=gpus,
                         gpu_slot=0 if gpus > 0 else None)

    def live_nodes(self) -> dict[Shard, set[str]]:
        """shard -> the nodes of its serving replicas (a second node loss should not take every one)."""
        live: dict[Shard, set[str]] = {}
        for name in self.serving():
            for shard in self.spec.actor_shards[name]:
                live.setdefault(tuple(shard), set()).add(self.node_of(name))
        return live

    def is_stand_in(self, name: str) -> bool:
        return any(d["by"] == name for d in self.displaced.values())

    def suspect_nodes(self) -> set[str]:
        """Nodes where every actor of ours is lost: Ray can call a node alive for seconds after it died."""
        on_node: dict[str, list[str]] = {}
        for name in self.expected():
            if self.nodes.get(name):
                on_node.setdefault(self.nodes[name], []).append(name)
        return {node for node, names in on_node.items() if all(n in self.lost for n in names)}

    # ---- what the watch learned ----------------------------------------------------------------------------------

    def seen(self, name: str, info: dict) -> None:
        """`name` answered (probe, start, restore): its generation and node, and it is not lost."""
        self.generations[name] = info["generation"]
        self.nodes[name] = info["node_id"]
        self.lost.discard(name)
        self.silent.pop(name, None)
        self.home_taken.discard(name)

    def probed(self, names: Sequence[str], infos: Sequence[dict | str | None], restore: bool,
               misses: int = 1) -> tuple[list[str], list[str]]:
        """One pass's answers (None: gone; SILENT: listed by Ray but no answer in time) -> (lost now, lost now and to
        be restored, now marked restoring). A SILENT actor is lost on its `misses`-th silent probe in a row."""
        lost, to_restore = [], []
        for name, info in zip(names, infos):
            if info == SILENT:
                self.silent[name] = self.silent.get(name, 0) + 1
                if self.silent[name] < misses:
                    continue
            elif info is not None:
                self.seen(name, info)
                continue
            self.silent.pop(name, None)
            self.lost.add(name)
            lost.append(name)
            if restore:
                self.restoring.add(name)
                to_restore.append(name)
        return lost, to_restore

    # ---- restores --------------------------------------------------------------------------------------------------

    def restore_plan(self, names: Sequence[str], rooms: Sequence[NodeRoom], min_cpus: float,
                     stand_in_name: Callable[[int], str]) -> RestorePlan:
        """Where the lost `names` come back (cluster/lost_restore.py). stand_in_name(serial): a stand-in's name."""
        # Its slot on the node it last ran on (a restore may have moved it from the slot's first node).
        lost = [LostActor(replace(self.slot_of(n), node_id=self.node_of(n)),
                          tuple(map(tuple, self.spec.actor_shards[n]))) for n in names]
        # Displaced ones still in the placement (their remap not run yet) count once, by their record.
        normal = [self.slot_of(n) for n in self.expected()
                  if n not in names and not self.is_stand_in(n) and n not in self.displaced]
        normal += [ActorSlot(**d["slot"]) for d in self.displaced.values()]
        return plan_restore(lost, rooms, self.live_nodes(), normal,
                            lambda i: stand_in_name(self.stand_in_serial + i), min_cpus=min_cpus,
                            home_taken=self.home_taken)

    # ---- what others see -----------------------------------------------------------------------------------------

    def table(self) -> tuple[dict[str, list[Shard]], dict[str, dict], list[str]]:
        """The routing table to publish at self.epoch: (placement minus drained, their slots, lost actors it
        retires). Routers count the retired ones dead at once, so a step waiting on them need not wait for calls to
        them to time out before it switches to their stand-ins."""
        serving = {n: s for n, s in self.spec.actor_shards.items() if n not in self.drained}
        gone = sorted(n for n in self.lost if n not in serving)
        return serving, {n: asdict(self.slots[n]) for n in serving if n in self.slots}, gone

    def actors_view(self) -> dict[str, dict]:
        """get_state()'s "actors": every expected actor, its node, generation, slot and whether it is restoring."""
        return {name: {"node_id": self.nodes.get(name), "generation": self.generations.get(name, 0),
                       "restoring": name in self.restoring, "slot": asdict(self.slot_of(name))}
                for name in self.expected()}

    def displaced_view(self) -> dict[str, dict]:
        return {n: {"by": d["by"], "slot": d["slot"]} for n, d in self.displaced.items()}
