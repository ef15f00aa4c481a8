"""Where an expert actor or a router computes, and what it does when Ray gave it a GPU that torch cannot see.

Ray hands out GPUs by count: a node that declares GPUs (or a container started without the NVIDIA runtime, or a
CPU-only torch wheel on a GPU node) gets actors with GPU ids while `torch.cuda.is_available()` is False. Computing
on the CPU then is silent and 10-100x slower, so by default such a process refuses to start with one line saying
what it was given and what to do. `devices.gpu_without_cuda: cpu` is the explicit escape hatch (tests on
`ray.cluster_utils.Cluster` nodes that declare GPUs on a CPU box; a deliberate CPU run on GPU-labelled nodes).

`compute_device` is the pure decision (no torch, no Ray); `local_device` feeds it this process's torch facts.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from .errors import ConfigError

log = logging.getLogger(__name__)
GPU_WITHOUT_CUDA = ("refuse", "cpu")
REFUSAL_FIELD = "devices.gpu_without_cuda"
_REFUSAL = re.compile(re.escape(REFUSAL_FIELD) + r": ([^\n]*? sees no CUDA [^\n]*)")


@dataclass(frozen=True)
class DevicesConfig:
    # A process Ray gave GPUs to while torch sees no CUDA: "refuse" (stop with one line) or "cpu" (compute on the
    # CPU anyway, with a warning).
    gpu_without_cuda: str = "refuse"

    def validate(self) -> DevicesConfig:
        if self.gpu_without_cuda not in GPU_WITHOUT_CUDA:
            raise ValueError(f"gpu_without_cuda: must be one of {GPU_WITHOUT_CUDA}, got {self.gpu_without_cuda!r}")
        return self


def compute_device(who: str, given: str | None, cuda_available: bool, policy: str = "refuse",
                   torch_version: str = "", torch_cuda: str | None = None, visible_devices: str | None = None) -> str:
    """"cuda:0" or "cpu" for a process that was `given` GPUs (e.g. "was given GPU 3 by Ray"; None: no GPU, so the
    CPU). With a GPU but no CUDA: "cpu" when policy is "cpu", else ConfigError naming devices.gpu_without_cuda
    with one line: what `who` was given, why torch sees no CUDA (torch_cuda None: a CPU-only build of torch), and
    what to do."""
    assert policy in GPU_WITHOUT_CUDA, policy
    if given is None:
        return "cpu"
    if cuda_available:
        return "cuda:0"  # Ray sets CUDA_VISIBLE_DEVICES to what it assigned, so cuda:0 is that GPU
    if policy == "cpu":
        return "cpu"
    if torch_cuda is None:
        why = f"torch {torch_version} is a CPU-only build".strip()
    else:
        why = (f"torch {torch_version} is built for CUDA {torch_cuda} but no GPU is visible: no NVIDIA driver or "
               f"device in this process, CUDA_VISIBLE_DEVICES={visible_devices if visible_devices is not None else ''}")
    raise ConfigError(REFUSAL_FIELD, f"{who} {given}, but torch sees no CUDA ({why}): install a CUDA build of torch "
                                     f"on that node, run its container with the NVIDIA runtime (docker run --gpus "
                                     f"all; on Kubernetes the NVIDIA device plugin), or set {REFUSAL_FIELD}: cpu "
                                     f"(--gpu-without-cuda cpu) to compute on the CPU anyway")


def find_refusal(text: str) -> str | None:
    """The refusal's message (after the field name) in an error's text - e.g. Ray's ActorDiedError or Serve's
    deployment failure, which embed the actor's traceback - or None."""
    found = _REFUSAL.findall(text)
    return found[-1].strip() if found else None


def gpus_given(gpu_ids: list) -> str | None:
    """'was given GPU 3 by Ray' / 'was given GPUs 0,1 by Ray'; None for no GPU."""
    if not gpu_ids:
        return None
    return f"was given GPU{'s' if len(gpu_ids) > 1 else ''} {','.join(str(g) for g in gpu_ids)} by Ray"


def local_device(who: str, given: str | None, policy: str = "refuse"):
    """compute_device with this process's torch, as a torch.device (a warning when the escape hatch is used)."""
    import torch

    name = compute_device(who, given, torch.cuda.is_available(), policy, torch.__version__, torch.version.cuda,
                          os.environ.get("CUDA_VISIBLE_DEVICES"))
    if given is not None and name == "cpu":
        log.warning("%s %s, but torch sees no CUDA: computing on the CPU (%s: cpu)", who, given, REFUSAL_FIELD)
    return torch.device(name)
