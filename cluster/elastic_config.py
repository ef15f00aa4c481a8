"""Elasticity's settings (controller.elastic in the configuration tree) and the autoscale policy's, which
`ElasticConfig.autoscale` holds as a dict. Apart from elastic.py / autoscale.py (numpy, the planner; both re-export
these names) so that reading and checking a configuration imports neither numpy nor torch."""

from __future__ import annotations

from dataclasses import dataclass

from ..experts.errors import ConfigError


@dataclass(frozen=True)
class AutoscaleConfig:
    target_load_per_replica: float  # load (same unit as ctx.load) one replica should carry over the window
    max_gpus: int  # GPU budget for expert replicas
    base_gpus: int  # GPUs the cluster has without asking Ray's autoscaler
    slots_per_gpu: int = 1  # shards per GPU per layer
    upscale_threshold: float = 1.2  # add replicas when load per replica > target x this
    downscale_threshold: float = 0.6  # remove when the fewer replicas would each carry ≤ target x this
    downscale_delay_s: float = 120.0  # a shard must stay cold this long before it loses a replica
    min_replicas: int = 1
    max_replicas_per_shard: int = 8

    def validate(self) -> AutoscaleConfig:
        if not self.target_load_per_replica > 0:
            raise ValueError(f"target_load_per_replica: must be > 0, got {self.target_load_per_replica}")
        for name in ("max_gpus", "base_gpus", "slots_per_gpu", "min_replicas", "max_replicas_per_shard"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer ≥ 1, got {value!r}")
        if self.base_gpus > self.max_gpus:
            raise ValueError(f"base_gpus: {self.base_gpus} exceeds max_gpus {self.max_gpus}")
        if self.max_replicas_per_shard < self.min_replicas:
            raise ValueError(f"max_replicas_per_shard: {self.max_replicas_per_shard} < min_replicas "
                             f"{self.min_replicas}")
        if not self.upscale_threshold >= 1:
            raise ValueError(f"upscale_threshold: must be ≥ 1, got {self.upscale_threshold}")
        if not 0 < self.downscale_threshold < 1:
            raise ValueError(f"downscale_threshold: must be in (0, 1) (below the target: hysteresis), got "
                             f"{self.downscale_threshold}")
        if not self.downscale_delay_s >= 0:
            raise ValueError(f"downscale_delay_s: must be ≥ 0, got {self.downscale_delay_s}")
        return self


@dataclass(frozen=True)
class ElasticConfig:
    control_interval_s: float = 10.0
    slots_per_gpu: int = 2  # shards per GPU per MoE layer (memory for expert weights, in shards)
    rebalance_threshold: float = 1.15  # replan when a layer's max/mean GPU load exceeds this
    extra_replica_fraction: float = 0.25  # without autoscale: replicas per layer beyond one per expert, x experts
    min_window_tokens: float = 64.0  # act only on a window with at least this many routed slots per layer
    gpu_fraction: float = 0.5  # of a GPU per actor: room for the next version beside it while it drains
    num_cpus_per_actor: float | None = None  # None: share of the node's CPUs (see actor_slots)
    # AutoscaleConfig fields (target_load_per_replica, max_gpus, base_gpus, ...); None: a fixed replica budget.
    # Without base_gpus: the GPUs the cluster had at the first control step; without max_gpus: base_gpus.
    autoscale: dict | None = None

    def validate(self) -> ElasticConfig:
        if not self.control_interval_s > 0:
            raise ValueError(f"control_interval_s: must be > 0, got {self.control_interval_s}")
        if not isinstance(self.slots_per_gpu, int) or self.slots_per_gpu < 1:
            raise ValueError(f"slots_per_gpu: must be an integer ≥ 1, got {self.slots_per_gpu!r}")
        if not self.rebalance_threshold >= 1:
            raise ValueError(f"rebalance_threshold: must be ≥ 1, got {self.rebalance_threshold}")
        if not 0 <= self.extra_replica_fraction <= 8:
            raise ValueError(f"extra_replica_fraction: must be in [0, 8], got {self.extra_replica_fraction}")
        if not self.min_window_tokens >= 0:
            raise ValueError(f"min_window_tokens: must be ≥ 0, got {self.min_window_tokens}")
        if not 0 < self.gpu_fraction <= 1:
            raise ValueError(f"gpu_fraction: must be in (0, 1], got {self.gpu_fraction}")
        if self.num_cpus_per_actor is not None and not self.num_cpus_per_actor > 0:
            raise ValueError(f"num_cpus_per_actor: must be > 0, got {self.num_cpus_per_actor}")
        if self.autoscale is not None:
            try:
                self.autoscale_config()
            except ValueError as exc:  # name the autoscale field: "autoscale.max_gpus: ..."
                head, sep, rest = str(exc).partition(": ")
                if sep and head != "autoscale":
                    raise ConfigError(f"autoscale.{head}", rest) from None
                raise ConfigError("autoscale", rest if sep else str(exc)) from None
        return self

    def autoscale_config(self, cluster_gpus: int = 1) -> AutoscaleConfig:
        """cluster_gpus: the GPUs the cluster had when elasticity started (the default base_gpus)."""
        cfg = dict(self.autoscale or {})
        cfg.setdefault("slots_per_gpu", self.slots_per_gpu)
        cfg.setdefault("base_gpus", cluster_gpus)
        cfg.setdefault("max_gpus", max(cfg["base_gpus"], 1))
        try:
            return AutoscaleConfig(**cfg).validate()
        except TypeError as exc:
            raise ValueError(f"autoscale: {exc}") from None
