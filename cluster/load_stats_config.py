"""The load window's settings (observability.load in the configuration tree). Apart from load_stats.py, which
imports torch and numpy and re-exports the name, so that reading and checking a configuration imports neither."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadStatsConfig:
    window_s: float = 60.0  # the sliding window the counts cover
    bucket_s: float = 5.0  # granularity: counts older than window_s drop out bucket by bucket

    def validate(self) -> LoadStatsConfig:
        if not self.bucket_s > 0:
            raise ValueError(f"bucket_s: must be > 0, got {self.bucket_s}")
        if not self.window_s >= self.bucket_s:
            raise ValueError(f"window_s: must be ≥ bucket_s ({self.bucket_s}), got {self.window_s}")
        return self
