"""The expert actor: a thin Ray shell around `gated_mlp` for the shards it hosts.

It reads only its shards' tensors from the checkpoint, computes on the GPU Ray gave it (or the CPU), and sets its
torch thread count from the CPUs Ray gave it, so many actors on one machine do not fight over cores.
"""

from __future__ import annotations

import os
import time

import numpy as np
import ray
import torch

from .arrays import readonly_tensor
from .checkpoint import CheckpointReader
from .ffn import activation, gated_mlp
from .weights import Shard, load_expert_shards


class ExpertActor:
    def __init__(self, name: str, model_dir: str, shards: list[Shard], dtype: str = "float32", generation: int = 0):
        self.name = name
        self.generation = generation  # 0 for the first actor of this name; +1 each time it is restored
        self.started = time.time()
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        self.threads = max(1, int(cpus))
        torch.set_num_threads(self.threads)
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        # Ray sets CUDA_VISIBLE_DEVICES to the GPU it assigned, so cuda:0 is that GPU.
        self.device = torch.device("cuda:0" if self.gpu_ids and torch.cuda.is_available() else "cpu")
        reader = CheckpointReader(model_dir)
        self.act = activation(reader.config.hidden_act)
        self.dtype = getattr(torch, dtype)
        self.shards = load_expert_shards(reader, shards, self.dtype, self.device)
        self.calls = 0
        self.tokens = 0
        self._warm_up()

    def _warm_up(self) -> None:
        """One forward per shard before the actor reports ready, so its first real call pays no lazy setup."""
        with torch.inference_mode():
            for weights in self.shards.values():
                gated_mlp(torch.zeros(1, weights.gate_up.shape[1], device=self.device, dtype=self.dtype), weights,
                          self.act)

    def forward(self, layer: int, experts: list[int], counts: list[int], x: np.ndarray) -> np.ndarray:
        """x: [sum(counts), H], rows grouped by expert in `experts` order -> unweighted expert outputs, same layout."""
        # Arrays from Ray's object store are read-only views; we never write to them.
        inputs = readonly_tensor(x).to(self.device, self.dtype)
        with torch.inference_mode():
            outs = [
                gated_mlp(chunk, self.shards[(layer, e)], self.act)
                for e, chunk in zip(experts, inputs.split(counts))
            ]
            result = torch.cat(outs) if len(outs) > 1 else outs[0]
        self.calls += 1
        self.tokens += int(x.shape[0])
        return result.to("cpu").numpy()

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {
            "name": self.name,
            "node_id": ctx.get_node_id(),
            "gpu_ids": self.gpu_ids,
            "device": str(self.device),
            "threads": self.threads,
            "pid": os.getpid(),
            "shards": sorted(self.shards),
            "weight_bytes": sum(w.nbytes() for w in self.shards.values()),
            "calls": self.calls,
            "tokens": self.tokens,
            "generation": self.generation,
        }

    def ready(self) -> bool:
        return True
