"""The Python API: start (or join) Ray, place one actor per expert group, and answer `score` and `generate`.

    from expertmesh.router_service.engine import ExpertMesh, MeshConfig
    with ExpertMesh(MeshConfig()) as mesh:             # embedded default model, embedded Ray
        print(mesh.generate(prompt="def ", max_tokens=20).text)

The router half (dense model, gates, dispatch) runs in this process; experts run in named Ray actors.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tqdm import tqdm

from ..cluster.naming import NAMESPACE, expert_actor_name
from ..cluster.placement import ActorSlot, NodeResources, plan_actor_slots
from ..cluster.routing_table import RoutingTable
from ..experts.actor import ExpertActor
from ..experts.checkpoint import CheckpointReader
from ..experts.modeling import KVCache, MoEDecoder
from ..experts.tokenizer import DEFAULT_MODEL_DIR, load_tokenizer
from ..experts.weights import Shard, check_checkpoint, load_dense_weights
from .dispatch import RemoteExperts
from .transport import RayRefTransport

log = logging.getLogger(__name__)
DTYPES = ("float32", "bfloat16", "float16")


class RequestError(ValueError):
    """Bad input from a caller; `field` names what to fix."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class MeshConfig:
    model_dir: str | None = None  # None: the embedded default model shipped in the package
    address: str = "local"  # "local" starts an embedded Ray; otherwise the address of a cluster to join
    replicas_per_expert: int = 1
    dtype: str = "float32"
    capacity_factor: float | None = None  # None: no cap, no token is ever moved or dropped
    num_cpus_per_actor: float | None = None  # None: share each node's CPUs among its actors (≤ 1 each)
    actor_start_timeout_s: float = 180.0
    ray_num_cpus: int | None = None  # only for an embedded Ray

    def validate(self) -> MeshConfig:
        if self.model_dir is not None and not Path(self.model_dir).is_dir():
            raise RequestError("model_dir", f"{self.model_dir} is not a folder")
        if not isinstance(self.replicas_per_expert, int) or self.replicas_per_expert < 1:
            raise RequestError("replicas_per_expert", f"must be an integer ≥ 1, got {self.replicas_per_expert!r}")
        if self.dtype not in DTYPES:
            raise RequestError("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if self.capacity_factor is not None and not (
            self.capacity_factor > 0 and math.isfinite(self.capacity_factor)
        ):
            raise RequestError("capacity_factor", f"must be a positive finite number, got {self.capacity_factor}")
        if self.num_cpus_per_actor is not None and not self.num_cpus_per_actor > 0:
            raise RequestError("num_cpus_per_actor", f"must be > 0, got {self.num_cpus_per_actor}")
        return self

    @property
    def resolved_model_dir(self) -> Path:
        return Path(self.model_dir) if self.model_dir else DEFAULT_MODEL_DIR


@dataclass
class Generation:
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "length" | "eos"
    tokens_per_expert: dict[int, list[int]] = field(default_factory=dict)  # layer -> [E] routed slots


class ExpertMesh:
    def __init__(self, config: MeshConfig | None = None):
        self.config = (config or MeshConfig()).validate()
        model_dir = self.config.resolved_model_dir
        self.reader = CheckpointReader(model_dir)
        self.model_config = self.reader.config
        self.tokenizer = load_tokenizer(model_dir)
        check_checkpoint(self.reader)  # fail here, naming file and key, before any actor starts
        self._owns_ray = False
        self._connect()
        self.actor_shards = self._actor_groups()
        self.slots = self._plan()
        self.actors = self._spawn(self.slots)
        self.table = RoutingTable.from_actor_shards(self.actor_shards)
        self.backend = RemoteExperts(self.table, RayRefTransport(self.actors))
        dense = load_dense_weights(self.reader, getattr(torch, self.config.dtype), progress="router weights")
        self.model = MoEDecoder(self.model_config, dense, self.backend, self.config.capacity_factor)

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def _connect(self) -> None:
        if ray.is_initialized():
            return
        if self.config.address == "local":
            # "local" never joins a cluster some earlier run left recorded on this machine.
            ray.init(address="local", namespace=NAMESPACE, num_cpus=self.config.ray_num_cpus,
                     include_dashboard=False, logging_level=logging.WARNING)
        else:
            ray.init(address=self.config.address, namespace=NAMESPACE, logging_level=logging.WARNING)
        self._owns_ray = True

    def _actor_groups(self) -> dict[str, list[Shard]]:
        """Default grouping: group g = logical expert g, hosting that expert in every MoE layer."""
        cfg = self.model_config
        groups = {}
        for expert in range(cfg.num_experts):
            for replica in range(self.config.replicas_per_expert):
                groups[expert_actor_name(expert, replica)] = [(layer, expert) for layer in cfg.moe_layers]
        return groups

    def _plan(self) -> list[ActorSlot]:
        nodes = [
            NodeResources(n["NodeID"], n["Resources"].get("CPU", 0.0), int(n["Resources"].get("GPU", 0)))
            for n in ray.nodes() if n["Alive"]
        ]
        return plan_actor_slots(list(self.actor_shards), nodes, self.config.num_cpus_per_actor)

    def _spawn(self, slots: list[ActorSlot]) -> dict[str, ray.actor.ActorHandle]:
        for slot in slots:
            try:
                ray.get_actor(slot.name, namespace=NAMESPACE)
            except ValueError:
                continue
            raise RuntimeError(
                f"actor '{slot.name}' already exists in namespace '{NAMESPACE}': another expertmesh is serving "
                "on this Ray cluster; stop it first"
            )
        remote = ray.remote(ExpertActor)
        handles = {}
        model_dir = str(self.config.resolved_model_dir.resolve())
        for slot in slots:
            handles[slot.name] = remote.options(
                name=slot.name, namespace=NAMESPACE, num_cpus=slot.num_cpus, num_gpus=slot.num_gpus,
                scheduling_strategy=NodeAffinitySchedulingStrategy(slot.node_id, soft=False),
            ).remote(slot.name, model_dir, self.actor_shards[slot.name], self.config.dtype)
        pending = {handles[s.name].ready.remote(): s.name for s in slots}
        deadline = time.monotonic() + self.config.actor_start_timeout_s
        bar = tqdm(total=len(pending), desc="expert actors ready", unit="actor", leave=False,
                   disable=not sys.stderr.isatty())
        while pending:
            done, _ = ray.wait(list(pending), num_returns=len(pending),
                               timeout=max(0.0, deadline - time.monotonic()))
            for ref in done:
                ray.get(ref)  # raises the actor's own error
                pending.pop(ref)
                bar.update(1)
            if pending and time.monotonic() >= deadline:
                for handle in handles.values():
                    ray.kill(handle)
                raise TimeoutError(
                    f"expert actors not ready after {self.config.actor_start_timeout_s:.0f}s: "
                    f"{sorted(pending.values())} (not enough CPU/GPU in the cluster?)"
                )
        bar.close()
        return handles

    def shutdown(self) -> None:
        for handle in getattr(self, "actors", {}).values():
            ray.kill(handle, no_restart=True)
        self.actors = {}
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> ExpertMesh:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- requests --------------------------------------------------------------------------------------------

    def actor_info(self) -> list[dict]:
        return ray.get([h.info.remote() for h in self.actors.values()])

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("prompt", f"the checkpoint at {self.config.resolved_model_dir} has no tokenizer.json; "
                                         "pass token ids instead")
        return self.tokenizer.encode(prompt).ids

    def decode(self, token_ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids)

    def check_token_ids(self, token_ids: list[int], field: str = "token_ids") -> torch.Tensor:
        if len(token_ids) == 0:
            raise RequestError(field, "must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(field, f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if len(token_ids) > self.model_config.max_position_embeddings:
            raise RequestError(field, f"{len(token_ids)} tokens exceed the model's context of "
                                      f"{self.model_config.max_position_embeddings}")
        return torch.tensor(token_ids, dtype=torch.int64)

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [S, V] (float32) for every position of `token_ids`."""
        return self.score_batch([token_ids])[0]

    def score_batch(self, batch: list[list[int]]) -> list[torch.Tensor]:
        """Several sequences in one forward: every expert call of a layer serves all of them."""
        return self.model.forward([self.check_token_ids(ids) for ids in batch])

    def generate(
        self, token_ids: list[int] | None = None, prompt: str | None = None, max_tokens: int = 32,
        stop_at_eos: bool = True,
    ) -> Generation:
        """Greedy decoding with a KV cache: one forward for the prompt, then one per new token."""
        if (token_ids is None) == (prompt is None):
            raise RequestError("prompt", "give exactly one of prompt or token_ids")
        ids = self.encode(prompt) if prompt is not None else list(token_ids)
        field_name = "prompt" if prompt is not None else "token_ids"
        tokens = self.check_token_ids(ids, field_name)
        if not isinstance(max_tokens, int) or max_tokens <= 0:
            raise RequestError("max_tokens", f"must be a positive integer, got {max_tokens!r}")
        if len(ids) + max_tokens > self.model_config.max_position_embeddings:
            raise RequestError("max_tokens", f"prompt ({len(ids)}) + max_tokens ({max_tokens}) exceed the model's "
                                             f"context of {self.model_config.max_position_embeddings}")
        cache: KVCache = self.model.new_cache()
        eos = self.model_config.eos_token_id if stop_at_eos else None
        routed: dict[int, torch.Tensor] = {}
        out: list[int] = []
        step_input = tokens
        finish = "length"
        for _ in range(max_tokens):
            logits = self.model.forward([step_input], [cache])[0]  # [S, V]
            for layer, routing in self.model.last_trace.routings.items():
                counts = routing.tokens_per_expert(self.model_config.num_experts)
                routed[layer] = routed.get(layer, 0) + counts
            next_id = int(torch.argmax(logits[-1]))
            out.append(next_id)
            if eos is not None and next_id == eos:
                finish = "eos"
                break
            step_input = torch.tensor([next_id])
        return Generation(
            token_ids=out, text=self.decode(out), finish_reason=finish,
            tokens_per_expert={layer: counts.tolist() for layer, counts in routed.items()},
        )
