"""DrillConfig: every setting of one drill, checked in one place.

The settings of the server a drill starts itself (checkpoint, replicas per expert, no-replica policy) become
`expertmesh serve` arguments in `serve_args` alone, so a change to how that server is configured touches one
function.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

KILL_MODES = ("actor", "fraction", "node", "router", "controller")
NO_REPLICA_POLICIES = ("wait", "degrade")


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
    target: str | None = None  # host:port of a running server to attach to; None: start one
    address: str | None = None  # with target: its Ray cluster (needed to kill the router or the controller)
    out: str = "drill_out"  # report folder
    num_cpus: int | None = None  # CPUs of the self-started local Ray (None: max(2, this machine's))
    # The self-started server (ignored with `target`):
    model_dir: str | None = None  # checkpoint folder; None: the embedded demo model
    replicas_per_expert: int = 2
    no_replica_policy: str = "wait"  # one of NO_REPLICA_POLICIES

    def validate(self) -> None:
        """Raise ValueError("field: message") for the first setting that cannot work."""
        if self.kill not in KILL_MODES:
            raise ValueError(f"kill: must be one of {KILL_MODES}, got {self.kill!r}")
        if self.no_replica_policy not in NO_REPLICA_POLICIES:
            raise ValueError(f"no_replica_policy: must be wait or degrade, got {self.no_replica_policy!r}")
        for name in ("every", "duration", "baseline"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}: must be a positive number of seconds, got {value}")
        for name in ("concurrency", "max_tokens", "replicas_per_expert", "nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"num_cpus: must be >= 1, got {self.num_cpus}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction: must be in (0, 1], got {self.fraction}")
        if self.target is not None and self.kill in ("node", "router", "controller") and self.address is None:
            raise ValueError(f"address: --kill {self.kill} against --target needs --address (the drill kills "
                             "through Ray)")
        if self.target is not None and self.kill == "node":
            raise ValueError("kill: node needs a cluster the drill started itself (no --target)")
        if self.target is None and self.address is not None:
            raise ValueError("address: give --target too, or neither (the drill then starts its own Ray)")

    @property
    def self_started(self) -> bool:
        return self.target is None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DrillConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{unknown[0]}: not a drill setting (known: {', '.join(sorted(known))})")
        return cls(**data)


def serve_args(config: DrillConfig, ray_address: str) -> list[str]:
    """The `expertmesh serve` arguments (after `serve --port 0`) of the server a drill starts on `ray_address`."""
    args = ["--address", ray_address, "--replicas-per-expert", str(config.replicas_per_expert),
            "--no-replica-policy", config.no_replica_policy]
    if config.model_dir is not None:
        args += ["--model", config.model_dir]
    return args
