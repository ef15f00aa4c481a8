"""Failure rates for the fleet simulator, from published fleet data. Pure (numpy); no Ray.

Source: Llama Team, AI @ Meta, "The Llama 3 Herd of Models" (arXiv:2407.21783, 2024), §3.3.4 and Table 5: during a
54-day snapshot of Llama 3 405B pre-training on 16,384 H100 GPUs (Grand Teton servers, 8 GPUs per server) there were
466 job interruptions, 47 planned and 419 unexpected. Table 5 gives the root causes of the 419 unexpected ones:

    cause                              count   paper's %       our scope (what it takes out of a serving fleet)
    Faulty GPU                           148   30.1 %          gpu
    GPU HBM3 memory                       72   17.2 %          gpu
    Software bug                          54   12.9 %          software (the process dies; the hardware is fine)
    Network switch/cable                  35    8.4 %          network (a node unreachable for a while)
    Host maintenance                      32    7.6 %          node
    GPU SRAM memory                       19    4.5 %          gpu
    GPU system processor                  17    4.1 %          gpu
    NIC                                    7    1.7 %          node
    NCCL watchdog timeouts                 7    1.7 %          software
    Silent data corruption                 6    1.4 %          gpu
    GPU thermal interface + sensor         6    1.4 %          gpu
    SSD                                    3    0.7 %          node
    Power supply                           3    0.7 %          node
    Server chassis                         2    0.5 %          node
    IO expansion board                     2    0.5 %          node
    Dependency                             2    0.5 %          software
    CPU                                    2    0.5 %          node
    System memory                          2    0.5 %          node

The counts sum to 419; the paper's percentages do not all equal count / 419 (148 / 419 is 35.3 %, not 30.1 %), so
the rates here use the counts. The exposure is 16,384 GPUs x 54 days = 21,233,664 GPU-hours (2,048 servers x 1,296 h),
i.e. one unexpected interruption per 50,677 GPU-hours, 1.97e-5 per GPU-hour; a 512-GPU fleet sees about 7 a month.

A training job's interruption is a serving fleet's fault at the scope that failed: a GPU fault loses that GPU's
expert actor; a software fault loses the process (its GPU is fine: the actor can start again in place); a node or
network fault loses every GPU of the server. The mapping is ours, as are the repair times below: the paper gives no
times to repair, only that 3 of the 419 needed significant manual intervention. Repair times are therefore
parameters (`RepairHours`), set to plain round guesses, and every report prints them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SOURCE = 'Llama Team, AI @ Meta, "The Llama 3 Herd of Models", arXiv:2407.21783 (2024), Table 5'
EXPOSURE_GPUS = 16_384
EXPOSURE_DAYS = 54
GPUS_PER_SERVER = 8
EXPOSURE_GPU_HOURS = EXPOSURE_GPUS * EXPOSURE_DAYS * 24  # 21,233,664

# (cause, count, the paper's percentage, scope)
TABLE_5: tuple[tuple[str, int, float, str], ...] = (
    ("Faulty GPU", 148, 30.1, "gpu"),
    ("GPU HBM3 memory", 72, 17.2, "gpu"),
    ("Software bug", 54, 12.9, "software"),
    ("Network switch/cable", 35, 8.4, "network"),
    ("Host maintenance", 32, 7.6, "node"),
    ("GPU SRAM memory", 19, 4.5, "gpu"),
    ("GPU system processor", 17, 4.1, "gpu"),
    ("NIC", 7, 1.7, "node"),
    ("NCCL watchdog timeouts", 7, 1.7, "software"),
    ("Silent data corruption", 6, 1.4, "gpu"),
    ("GPU thermal interface + sensor", 6, 1.4, "gpu"),
    ("SSD", 3, 0.7, "node"),
    ("Power supply", 3, 0.7, "node"),
    ("Server chassis", 2, 0.5, "node"),
    ("IO expansion board", 2, 0.5, "node"),
    ("Dependency", 2, 0.5, "software"),
    ("CPU", 2, 0.5, "node"),
    ("System memory", 2, 0.5, "node"),
)
UNEXPECTED = 419
SCOPES = ("gpu", "software", "node", "network")
NODE_SCOPES = ("node", "network")  # a fault that takes a whole server


@dataclass(frozen=True)
class RepairHours:
    """How long a fault keeps its hardware out (assumed; the paper gives no repair times). software: the process
    restarts by hand when nothing restarts it (strategy none); the hardware itself is fine."""

    gpu: float = 24.0  # drain the server, swap or reseat the GPU, burn-in
    node: float = 6.0  # host maintenance, NIC/PSU/SSD swap, reboot
    network: float = 1.0  # a switch port or cable
    software: float = 1.0  # an operator notices and restarts

    def of(self, scope: str) -> float:
        return float(getattr(self, scope))


@dataclass(frozen=True)
class Fault:
    t_s: float  # when it happens, seconds from the start
    scope: str  # gpu | software | node | network
    gpu: int  # the GPU (gpu/software scope) or the first GPU of the server (node/network scope)
    repair_s: float  # how long the hardware (or, with no controller, the process) stays out

    def gpus(self, gpus_per_node: int) -> range:
        """The GPUs this fault takes out."""
        if self.scope in NODE_SCOPES:
            first = self.gpu - self.gpu % gpus_per_node
            return range(first, first + gpus_per_node)
        return range(self.gpu, self.gpu + 1)


def counts_by_scope() -> dict[str, int]:
    """{scope: unexpected interruptions in the snapshot}, summing to 419."""
    out = dict.fromkeys(SCOPES, 0)
    for _, count, _, scope in TABLE_5:
        out[scope] += count
    assert sum(out.values()) == UNEXPECTED, "Table 5's counts must sum to 419"
    return out


def hazards_per_hour(scale: float = 1.0) -> dict[str, float]:
    """{scope: faults per hour per unit}: per GPU for gpu/software, per server for node/network. scale: a multiplier
    (10 = ten times the published rates)."""
    assert scale >= 0, "scale must be ≥ 0"
    servers_hours = EXPOSURE_GPU_HOURS / GPUS_PER_SERVER
    return {scope: scale * count / (servers_hours if scope in NODE_SCOPES else EXPOSURE_GPU_HOURS)
            for scope, count in counts_by_scope().items()}


@dataclass(frozen=True)
class FailureModel:
    scale: float = 1.0  # x the published rates
    repair: RepairHours = field(default_factory=RepairHours)

    def sample(self, rng: np.random.Generator, gpus: int, gpus_per_node: int, horizon_s: float) -> list[Fault]:
        """Faults over [0, horizon_s) on a fleet of `gpus` serving GPUs (spares are idle and not counted), as
        independent Poisson processes per scope, sorted by time. Each fault's unit is uniform over the fleet."""
        assert gpus >= 1 and gpus_per_node >= 1 and gpus % gpus_per_node == 0, "gpus: whole servers"
        hours = horizon_s / 3600
        nodes = gpus // gpus_per_node
        out = []
        for scope, rate in hazards_per_hour(self.scale).items():
            units = nodes if scope in NODE_SCOPES else gpus
            n = int(rng.poisson(rate * units * hours))
            times = rng.uniform(0, horizon_s, n)
            picks = rng.integers(0, units, n)
            for t, u in zip(times, picks, strict=True):
                gpu = int(u) * gpus_per_node if scope in NODE_SCOPES else int(u)
                out.append(Fault(float(t), scope, gpu, self.repair.of(scope) * 3600))
        return sorted(out, key=lambda f: (f.t_s, f.gpu))

    def expected(self, gpus: int, gpus_per_node: int, horizon_s: float) -> dict[str, float]:
        """{scope: expected faults over the horizon} (the Poisson means sample draws from)."""
        hours = horizon_s / 3600
        return {scope: rate * (gpus // gpus_per_node if scope in NODE_SCOPES else gpus) * hours
                for scope, rate in hazards_per_hour(self.scale).items()}
