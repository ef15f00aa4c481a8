"""Shard placements: which GPU slot hosts a replica of which (layer, expert) shard. Pure (numpy); no Ray.

The model is layer by layer, like DeepSeek's EPLB: every MoE layer runs in sequence, so what slows a step is the most
loaded GPU *of each layer*. Each live GPU has `slots_per_gpu` slots per layer; a shard (layer, expert) may have
replicas on several GPUs but at most one per GPU; every shard has at least one replica; failed GPUs host nothing.
Per layer a placement is therefore an array `slots: [num_gpus, slots_per_gpu]` of expert ids (-1 = empty), and the
whole placement `slots: [layers, num_gpus, slots_per_gpu]`.

Load: `load[layer, expert]` = tokens (or (token, top-k) assignments) routed to the shard over a window, as
`cluster/load_stats.LoadWindow.shard_load()` returns it. The router splits a shard's tokens evenly over its replicas
(`routing_table.split_tokens`), so a GPU's load in a layer is the sum over its shards of load / replicas, and a
layer's imbalance is max over live GPUs / mean over live GPUs of that load.

GPU g sits on node g // gpus_per_node. Layer index i means the i-th MoE layer (the model's `moe_layers[i]`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

FORMAT = "expertmesh.placement"
VERSION = 1


@dataclass(frozen=True)
class Topology:
    nodes: int
    gpus_per_node: int
    slots_per_gpu: int  # shards per GPU per MoE layer
    failed_gpus: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "slots_per_gpu"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be an integer ≥ 1, got {value!r}")
        object.__setattr__(self, "failed_gpus", frozenset(int(g) for g in self.failed_gpus))
        bad = sorted(g for g in self.failed_gpus if not 0 <= g < self.num_gpus)
        if bad:
            raise ValueError(f"failed_gpus: {bad} outside 0..{self.num_gpus - 1}")
        if len(self.failed_gpus) == self.num_gpus:
            raise ValueError("failed_gpus: every GPU failed; nothing can be placed")

    @classmethod
    def from_memory(cls, nodes: int, gpus_per_node: int, gpu_bytes: int, shard_bytes: int, layers: int,
                    failed_gpus: frozenset[int] = frozenset(), utilization: float = 1.0, reserve_bytes: int = 0,
                    remap_headroom: bool = False) -> Topology:
        """Slots from a per-GPU memory budget for expert weights: each GPU holds the same number of shards in every
        layer. The accounting is cluster/memory_plan.py's `slots_per_gpu` (the start-up check's and plan-cluster's):
        by default the whole of gpu_bytes is the budget (gpu_bytes // (shard_bytes * layers)); pass utilization,
        reserve_bytes and remap_headroom to plan exactly as a live cluster is checked."""
        from .memory_plan import slots_per_gpu

        assert shard_bytes > 0 and layers > 0
        slots, _ = slots_per_gpu(gpu_bytes, shard_bytes, layers, utilization, reserve_bytes, remap_headroom)
        if slots < 1:
            raise ValueError(f"gpu_bytes: {gpu_bytes} cannot hold one shard per layer "
                             f"({layers} layers x {shard_bytes} bytes)")
        return cls(nodes, gpus_per_node, int(slots), failed_gpus)

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def live(self) -> np.ndarray:
        """[num_gpus] bool."""
        alive = np.ones(self.num_gpus, dtype=bool)
        alive[list(self.failed_gpus)] = False
        return alive

    @property
    def num_live(self) -> int:
        return self.num_gpus - len(self.failed_gpus)

    def node_of(self) -> np.ndarray:
        """[num_gpus] node index of every GPU."""
        return np.arange(self.num_gpus) // self.gpus_per_node

    def with_failed(self, gpus: set[int] | frozenset[int]) -> Topology:
        return Topology(self.nodes, self.gpus_per_node, self.slots_per_gpu, self.failed_gpus | frozenset(gpus))


@dataclass(frozen=True, eq=False)
class Placement:
    """slots: [layers, num_gpus, slots_per_gpu] int64, expert id or -1; each GPU row sorted, empties last."""

    topology: Topology
    experts: int
    slots: np.ndarray

    def __post_init__(self) -> None:
        slots = np.asarray(self.slots, dtype=np.int64)
        t = self.topology
        assert slots.ndim == 3 and slots.shape[1:] == (t.num_gpus, t.slots_per_gpu), \
            f"slots: shape {slots.shape}, expected [layers, {t.num_gpus}, {t.slots_per_gpu}]"
        # Canonical order: ascending expert ids, empties (-1) last, so equal placements compare equal.
        key = np.where(slots < 0, np.iinfo(np.int64).max, slots)
        slots = np.take_along_axis(slots, np.argsort(key, axis=-1, kind="stable"), axis=-1)
        slots.setflags(write=False)
        object.__setattr__(self, "slots", slots)
        self.validate()

    @property
    def layers(self) -> int:
        return self.slots.shape[0]

    def validate(self) -> None:
        s, t = self.slots, self.topology
        if ((s < -1) | (s >= self.experts)).any():
            raise ValueError(f"slots: expert ids must be in 0..{self.experts - 1}")
        dead = ~t.live
        if (s[:, dead] >= 0).any():
            raise ValueError(f"gpus: a failed GPU ({sorted(t.failed_gpus)}) hosts shards")
        srt = np.sort(s, axis=-1)
        if ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any():
            raise ValueError("gpus: a GPU hosts the same shard twice")
        missing = np.argwhere(self.replica_counts() == 0)
        if len(missing):
            layer, expert = missing[0]
            raise ValueError(f"gpus: shard (layer={layer}, expert={expert}) has no replica "
                             f"({len(missing)} shards missing)")

    def hosts(self) -> np.ndarray:
        """[layers, num_gpus, experts] bool: GPU hosts the shard."""
        has = np.zeros((self.layers, self.topology.num_gpus, self.experts + 1), dtype=bool)
        li, gi, _ = np.indices(self.slots.shape)
        has[li, gi, self.slots] = True  # -1 lands in the spare last column
        return has[..., :-1]

    def replica_counts(self) -> np.ndarray:
        """[layers, experts] replicas per shard."""
        return self.hosts().sum(axis=1)

    def gpu_load(self, load: np.ndarray) -> np.ndarray:
        """load: [layers, experts] -> [layers, num_gpus], each shard's load split evenly over its replicas."""
        load = _check_load(load, self.layers, self.experts)
        per_replica = load / np.maximum(self.replica_counts(), 1)
        padded = np.concatenate([per_replica, np.zeros((self.layers, 1))], axis=1)  # -1 -> 0
        return np.take_along_axis(padded[:, None, :], self.slots.reshape(self.layers, 1, -1) % (self.experts + 1),
                                  axis=2).reshape(self.slots.shape).sum(axis=-1)

    def imbalance(self, load: np.ndarray) -> np.ndarray:
        """[layers] max over live GPUs / mean over live GPUs of the layer's GPU load (1.0 = perfect; 1.0 too for a
        layer without load)."""
        return layer_imbalance(self.gpu_load(load), self.topology.live)

    def node_load(self, load: np.ndarray) -> np.ndarray:
        """[layers, nodes] summed GPU load per node."""
        t = self.topology
        return self.gpu_load(load).reshape(self.layers, t.nodes, t.gpus_per_node).sum(axis=-1)

    def gpu_shards(self, gpu: int) -> list[tuple[int, int]]:
        """[(layer, expert)] the GPU hosts, sorted."""
        return [(int(layer), int(e)) for layer in range(self.layers) for e in self.slots[layer, gpu] if e >= 0]

    def total_replicas(self) -> int:
        return int((self.slots >= 0).sum())

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Placement) and self.topology == other.topology and self.experts == other.experts
                and np.array_equal(self.slots, other.slots))

    __hash__ = None  # type: ignore[assignment]

    # ---- JSON --------------------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        t = self.topology
        return {"format": FORMAT, "version": VERSION, "layers": self.layers, "experts": self.experts,
                "nodes": t.nodes, "gpus_per_node": t.gpus_per_node, "slots_per_gpu": t.slots_per_gpu,
                "failed_gpus": sorted(t.failed_gpus),
                "gpus": [[list(s) for s in self.gpu_shards(g)] for g in range(t.num_gpus)]}

    def dumps(self) -> str:
        """JSON text with one GPU per line (readable diffs)."""
        doc = self.to_json()
        gpus = doc.pop("gpus")
        head = json.dumps(doc)[:-1]
        rows = ",\n  ".join(json.dumps(g, separators=(",", ":")) for g in gpus)
        return f'{head}, "gpus": [\n  {rows}\n]}}\n'

    @classmethod
    def from_json(cls, doc: dict) -> Placement:
        if not isinstance(doc, dict):
            raise ValueError("placement: expected a JSON object")
        if doc.get("format", FORMAT) != FORMAT:
            raise ValueError(f"format: expected {FORMAT!r}, got {doc.get('format')!r}")
        if doc.get("version") != VERSION:
            raise ValueError(f"version: expected {VERSION}, got {doc.get('version')!r}")
        for key in ("layers", "experts", "nodes", "gpus_per_node", "slots_per_gpu", "gpus"):
            if key not in doc:
                raise ValueError(f"{key}: missing")
        topology = Topology(doc["nodes"], doc["gpus_per_node"], doc["slots_per_gpu"],
                            frozenset(doc.get("failed_gpus", [])))
        layers, experts = doc["layers"], doc["experts"]
        for key, value in (("layers", layers), ("experts", experts)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}: must be an integer ≥ 1, got {value!r}")
        gpus = doc["gpus"]
        if not isinstance(gpus, list) or len(gpus) != topology.num_gpus:
            raise ValueError(f"gpus: expected a list of {topology.num_gpus} GPUs (nodes x gpus_per_node)")
        slots = np.full((layers, topology.num_gpus, topology.slots_per_gpu), -1, dtype=np.int64)
        fill = np.zeros((layers, topology.num_gpus), dtype=np.int64)
        for g, shards in enumerate(gpus):
            for item in shards:
                if (not isinstance(item, list) or len(item) != 2
                        or not all(isinstance(v, int) and not isinstance(v, bool) for v in item)):
                    raise ValueError(f"gpus[{g}]: entries must be [layer, expert] integer pairs, got {item!r}")
                layer, expert = item
                if not (0 <= layer < layers and 0 <= expert < experts):
                    raise ValueError(f"gpus[{g}]: shard {item} outside layers 0..{layers - 1} / "
                                     f"experts 0..{experts - 1}")
                if fill[layer, g] >= topology.slots_per_gpu:
                    raise ValueError(f"gpus[{g}]: more than slots_per_gpu={topology.slots_per_gpu} shards "
                                     f"in layer {layer}")
                slots[layer, g, fill[layer, g]] = expert
                fill[layer, g] += 1
        return cls(topology, experts, slots)

    @classmethod
    def loads(cls, text: str) -> Placement:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"placement: not JSON ({exc})") from exc
        return cls.from_json(doc)

    @classmethod
    def round_robin(cls, topology: Topology, layers: int, experts: int) -> Placement:
        """One replica per shard, expert e on the (e mod live)-th live GPU in every layer: the layout of expertmesh's
        default pool (one actor per logical expert), the 'before' of a first plan."""
        live = np.flatnonzero(topology.live)
        assert experts <= len(live) * topology.slots_per_gpu, "more experts than slots"
        slots = np.full((layers, topology.num_gpus, topology.slots_per_gpu), -1, dtype=np.int64)
        for e in range(experts):
            slots[:, live[e % len(live)], e // len(live)] = e
        return cls(topology, experts, slots)


def layer_imbalance(gpu_load: np.ndarray, live: np.ndarray) -> np.ndarray:
    """gpu_load: [layers, num_gpus], live: [num_gpus] bool -> [layers] max/mean over live GPUs (1.0 without load)."""
    loads = gpu_load[:, live]
    mean = loads.mean(axis=1)
    return np.where(mean > 0, loads.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)


def moves(old: Placement, new: Placement) -> int:
    """Shard replicas `new` hosts on a GPU that did not host them in `old`: the weights that must be loaded.
    (Replicas dropped cost nothing to speak of; GPUs are matched by index.)"""
    assert (old.layers, old.experts) == (new.layers, new.experts), "placements of different models"
    a, b = old.hosts(), new.hosts()
    g = min(a.shape[1], b.shape[1])
    return int(b.sum() - (a[:, :g] & b[:, :g]).sum())


def _check_load(load: np.ndarray, layers: int, experts: int) -> np.ndarray:
    load = np.asarray(load, dtype=np.float64)
    if load.shape != (layers, experts):
        raise ValueError(f"load: shape {load.shape}, expected [layers={layers}, experts={experts}]")
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("load: must be finite and ≥ 0")
    return load
