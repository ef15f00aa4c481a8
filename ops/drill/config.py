"""DrillConfig: every setting of one drill, checked in one place.

The server a drill starts itself is configured by the same configuration tree as every other entry point
(`mesh`, a MeshConfig): `serve_args` writes it to a JSON file and starts `expertmesh serve --config FILE`, so any
setting of the tree (transport, placement, elasticity, tracing, ...) can be drilled.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from ...cluster.naming import MeshNames
from ...experts.errors import ConfigError
from ...router_service.config import MeshConfig

KILL_MODES = ("actor", "fraction", "node", "router", "controller", "chaos", "none")
# Modes that need a ray.cluster_utils.Cluster the drill starts itself (they remove worker nodes).
CLUSTER_KILLS = ("node", "chaos")
# What the report shows of the server's settings (flat keys, as records have always carried them).
_SERVER_KEYS = ("model_dir", "replicas_per_expert", "no_replica_policy")


def default_drill_mesh() -> MeshConfig:
    """The drilled server's defaults: two replicas per expert, so a single kill never leaves a shard without one."""
    return MeshConfig().replace(**{"experts.replicas_per_expert": 2})


@dataclass
class DrillConfig:
    kill: str = "actor"  # one of KILL_MODES
    every: float = 10.0  # seconds between kills
    duration: float = 60.0  # seconds of the fault phase
    baseline: float = 15.0  # seconds of fault-free load before it
    concurrency: int = 8  # concurrent greedy Generate streams
    max_tokens: int = 16  # tokens per request
    seed: int = 0  # choice of kill targets
    fraction: float = 0.25  # kill=fraction: share of the live expert actors per tick
    nodes: int = 2  # kill=node: worker nodes of the self-started cluster
    node_cpus: int = 2  # kill=node: CPUs of each worker node
    settle: float = 30.0  # after `duration`: keep the load on until every kill recovered, at most this long
    ready_timeout: float = 600.0  # seconds the self-started server may take to be ready (64 actors, 2 cores: more)
    sample_every: float = 5.0  # seconds between samples of resident memory / descriptors / KV blocks / actors
    # kill=node: GPUs each worker declares (no real GPU needed). With any, expert actors go only to the workers, so
    # experts.num_cpus_per_actor = node_cpus / actors per worker leaves the cluster no spare capacity.
    node_gpus: int = 0
    target: str | None = None  # host:port of a running server to attach to; None: start one
    address: str | None = None  # with target: its Ray cluster (needed to kill the router or the controller)
    out: str = "drill_out"  # report folder
    num_cpus: int | None = None  # CPUs of the self-started local Ray (None: max(2, this machine's))
    # Sent with Admin KillReplica when the drill kills through the Admin API (--target without --address); a
    # self-started server gets it as its server.admin_token. Never written to the record (to_dict leaves it out).
    admin_token: str | None = None
    # The self-started server (ignored with `target`; its ray.address is the drill's own Ray).
    mesh: MeshConfig = field(default_factory=default_drill_mesh)

    @property
    def model_dir(self) -> str | None:
        return self.mesh.model.path

    @property
    def replicas_per_expert(self) -> int:
        return self.mesh.experts.replicas_per_expert

    @property
    def names(self) -> MeshNames:
        """The drilled mesh's names in Ray (`mesh.mesh.id`; with `target`, the running server's mesh id): its
        namespace, controller and router replicas are what the drill kills, and nothing of another mesh."""
        return MeshNames.of(self.mesh.mesh.id)

    @property
    def no_replica_policy(self) -> str:
        return self.mesh.failover.no_replica_policy

    def validate(self) -> None:
        """Raise ValueError("field: message") for the first setting that cannot work."""
        if self.kill not in KILL_MODES:
            raise ValueError(f"kill: must be one of {KILL_MODES}, got {self.kill!r}")
        try:
            self.mesh.validate()
        except ConfigError as exc:
            raise ConfigError(f"mesh.{exc.field}", exc.message) from None
        for name in ("every", "duration", "baseline", "ready_timeout", "settle"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}: must be a positive number of seconds, got {value}")
        if not (self.sample_every > 0 and math.isfinite(self.sample_every)):
            raise ValueError(f"sample_every: must be a positive number of seconds, got {self.sample_every}")
        if self.node_gpus < 0:
            raise ValueError(f"node_gpus: must be >= 0, got {self.node_gpus}")
        for name in ("concurrency", "max_tokens", "nodes", "node_cpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"num_cpus: must be >= 1, got {self.num_cpus}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction: must be in (0, 1], got {self.fraction}")
        if self.target is not None and self.kill in ("node", "router", "controller") and self.address is None:
            raise ValueError(f"address: --kill {self.kill} against --target needs --address (the drill kills "
                             "through Ray)")
        if self.target is not None and self.kill in CLUSTER_KILLS:
            raise ValueError(f"kill: {self.kill} needs a cluster the drill started itself (no --target)")
        if self.admin_token is not None and not self.admin_token.strip():
            raise ValueError("admin_token: must not be blank")
        if self.target is None and self.address is not None:
            raise ValueError("address: give --target too, or neither (the drill then starts its own Ray)")

    @property
    def self_started(self) -> bool:
        return self.target is None

    def to_dict(self) -> dict:
        """Plain data: the drill's fields, the server's tree (`mesh`) and, flat, what the report shows of it. The
        admin token is a secret: left out here and in the tree (records and reports are shared)."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("mesh", "admin_token")}
        mesh = self.mesh.replace(**{"server.admin_token": None}).to_dict()
        return data | {key: getattr(self, key) for key in _SERVER_KEYS} | {"mesh": mesh}

    @classmethod
    def from_dict(cls, data: dict) -> DrillConfig:
        data = dict(data)
        flat = {key: data.pop(key) for key in _SERVER_KEYS if key in data}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            names = ", ".join(sorted(known | set(_SERVER_KEYS)))
            raise ValueError(f"{unknown[0]}: not a drill setting (known: {names})")
        if "mesh" in data:
            data["mesh"] = MeshConfig.from_dict(data["mesh"])
        else:  # a record written before the drill carried the tree: its three flat server settings
            data["mesh"] = default_drill_mesh().replace(**{
                path: flat[key] for key, path in (("model_dir", "model.path"),
                                                  ("replicas_per_expert", "experts.replicas_per_expert"),
                                                  ("no_replica_policy", "failover.no_replica_policy"))
                if key in flat})
        return cls(**data)


def serve_args(config: DrillConfig, ray_address: str, config_file: Path) -> list[str]:
    """The `expertmesh serve` arguments (after `serve --port 0`) of the server a drill starts on `ray_address`;
    writes the server's configuration tree (config.mesh, with the drill's admin token if it has one) to
    `config_file`, which they name. The file may hold a secret: only its owner may read it."""
    mesh = config.mesh
    if config.admin_token is not None:
        mesh = mesh.replace(**{"server.admin_token": config.admin_token})
    path = Path(config_file)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(json.dumps(mesh.to_dict(), indent=2) + "\n")
    return ["--config", str(config_file), "--address", ray_address]
