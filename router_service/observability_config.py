"""Observability settings (a section of the configuration tree): the load window and the Prometheus metrics. Apart
from observability.py / metrics.py so that reading and checking a configuration never imports Ray or OpenTelemetry."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..cluster.load_stats_config import LoadStatsConfig


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = True
    per_shard_labels: bool | None = None  # None: per shard while layers x experts ≤ max_shard_labels
    max_shard_labels: int = 1024
    flush_interval_s: float = 1.0

    def validate(self) -> MetricsConfig:
        if self.max_shard_labels < 1:
            raise ValueError(f"max_shard_labels: must be ≥ 1, got {self.max_shard_labels}")
        if not self.flush_interval_s >= 0:
            raise ValueError(f"flush_interval_s: must be ≥ 0, got {self.flush_interval_s}")
        return self

    def shard_labels(self, num_shards: int) -> bool:
        return self.per_shard_labels if self.per_shard_labels is not None else num_shards <= self.max_shard_labels


@dataclass(frozen=True)
class ObservabilityConfig:
    load: LoadStatsConfig = field(default_factory=LoadStatsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    report_interval_s: float = 2.0  # gauges of the window + push to the controller

    def validate(self) -> ObservabilityConfig:
        self.load.validate()
        self.metrics.validate()
        if not self.report_interval_s > 0:
            raise ValueError(f"report_interval_s: must be > 0, got {self.report_interval_s}")
        return self
