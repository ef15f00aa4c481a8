"""DrillRecord: what happened during a drill, as plain data -- the contract between running and scoring.

ops/drill/run.py fills one in while the drill runs; ops/drill/report.py scores it without touching the network.
It round-trips through JSON (`save` / `load`), so a drill's report can be rebuilt, or a scoring change tested, on
a record from a real run (tests/unit/fixtures/drill_*.json). All times are Unix seconds (time.time()).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class RequestRecord:
    """One greedy Generate stream."""

    worker: int
    prompt: int  # index into the drill's fixed prompts
    start: float
    end: float = 0.0
    code: str = "OK"  # gRPC status name, an exception name, or HUNG_AT_END
    tokens: list[int] = field(default_factory=list)
    chunks: list[list[float]] = field(default_factory=list)  # [arrival time, tokens in the message]
    degraded: int = 0  # tokens the server reports as computed without some expert (degrade policy)
    finish_reason: str | None = None


@dataclass
class PollRecord:
    """One Admin.GetClusterState call."""

    t: float  # when the answer came (a call can take seconds while a replica is restoring)
    ok: bool
    sent: float = 0.0
    live: int = 0
    expected: int = 0
    controller_alive: bool | None = None
    epoch: int | None = None
    nodes: dict = field(default_factory=dict)  # actor -> node id (serving replicas)
    generations: dict = field(default_factory=dict)  # actor -> generation (serving replicas)
    alive: dict = field(default_factory=dict)  # actor -> alive and not restoring (serving)
    router_replica: str | None = None
    degraded_slots: int | None = None
    error: str | None = None
    kv_blocks_free: int | None = None  # the answering router replica's paged KV cache
    kv_blocks_total: int | None = None
    live_kv_caches: int | None = None  # sequences holding KV blocks there (active + queued)


@dataclass
class KillRecord:
    """One tick of the fault schedule that killed something (or failed to: `error`)."""

    index: int  # tick number
    mode: str
    t: float  # when the kill was issued
    targets: list[str]
    note: str = ""
    pre_nodes: dict = field(default_factory=dict)  # from the last good poll before the kill
    pre_generations: dict = field(default_factory=dict)
    pre_epoch: int | None = None
    recreated_t: float | None = None  # controller kills: when a new controller actor was registered
    error: str | None = None
    scheduled_t: float | None = None  # when the tick was due


@dataclass
class DrillRecord:
    """A whole drill. Phases: warm-up < t0 (baseline) < fault_start < fault_end (schedule over) < load_end."""

    options: dict  # DrillConfig.to_dict() of the run
    target: str  # host:port the load went to
    policy: str | None  # the server's no-replica policy (GetClusterState), else the configured one
    prompts: int  # how many fixed prompts the streams cycle through
    t0: float = 0.0
    fault_start: float = 0.0
    fault_end: float = 0.0
    load_end: float = 0.0
    warm_requests: list[RequestRecord] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    polls: list[PollRecord] = field(default_factory=list)
    kills: list[KillRecord] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)  # controller events {t, kind, actor, detail}, each once
    ppl_passes: list[dict] = field(default_factory=list)  # {start, end, tokens_scored, windows, failed_windows,
    #                                                        nll, perplexity}: one pass over the held-out text
    ppl_info: dict | None = None  # the held-out text scored (None: no perplexity, the wait policy)
    training_ppl: float | None = None  # the checkpoint's training report: held-out perplexity
    ray_at_end: dict | None = None  # named actors not alive, free CPUs (None: attached without Ray)
    server: dict | None = None  # the self-started server: exit code and log
    machine: dict = field(default_factory=dict)
    wall_s: float | None = None
    # ops/drill/resources.py sample_tree: {t, roles: {role: {procs, rss_bytes, fds}}} every `sample_every` s over
    # everything the drill started (empty when attached to a running server: its processes are not ours to read)
    resources: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DrillRecord:
        data = dict(data)
        data["warm_requests"] = [RequestRecord(**r) for r in data.get("warm_requests", [])]
        data["requests"] = [RequestRecord(**r) for r in data.get("requests", [])]
        data["polls"] = [PollRecord(**p) for p in data.get("polls", [])]
        data["kills"] = [KillRecord(**k) for k in data.get("kills", [])]
        return cls(**data)  # an unknown key raises TypeError: a record from another schema is not scored silently

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: Path) -> DrillRecord:
        return cls.from_dict(json.loads(Path(path).read_text()))
