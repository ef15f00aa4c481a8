"""Tracing settings (a section of the configuration tree). Apart from experts/telemetry.py so that reading and
checking a configuration never imports OpenTelemetry."""

from __future__ import annotations

from dataclasses import asdict, dataclass

EXPORTERS = ("none", "console", "otlp", "file")


@dataclass(frozen=True)
class TracingConfig:
    exporter: str = "none"  # none | console | otlp | file (JSON lines; tests and offline debugging)
    endpoint: str | None = None  # otlp: the collector's gRPC endpoint, e.g. http://localhost:4317
    path: str | None = None  # file: where to append spans, one JSON object per line
    service_name: str = "expertmesh"

    def validate(self) -> TracingConfig:
        if self.exporter not in EXPORTERS:
            raise ValueError(f"exporter: must be one of {EXPORTERS}, got {self.exporter!r}")
        if self.exporter == "file" and not self.path:
            raise ValueError("path: the file exporter needs a path")
        if self.endpoint is not None and self.exporter != "otlp":
            raise ValueError("endpoint: only the otlp exporter takes an endpoint")
        return self

    @property
    def enabled(self) -> bool:
        return self.exporter != "none"

    def as_dict(self) -> dict:
        return asdict(self)
