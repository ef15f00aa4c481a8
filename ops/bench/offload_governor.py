"""Prefetch with and without its governor against on-demand loading, over a long decode (`bench offload`, README:
Offload; router_service/prefetch_governor.py).

The main offload table times the best of a few decode steps per mode. Whether prefetch is "never slower than on
demand" is a question about a long run, where the governor has measured and decided, so this section decodes
`steps` steps per mode through the same offloaded mesh and reports the mean rate: on demand (`off`), gate prefetch
always on (`gate`), and gate prefetch under the governor (`gate+governor`). The modes alternate over `rounds` rounds
(the box is shared: its load drifts), each from a fresh prompt prefill of the same context; every mode's greedy
tokens must equal on demand's (prefetch moves weights, never values).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

MODES = ("off", "gate", "gate+governor")


@dataclass(frozen=True)
class GovernorWorkload:
    steps: int = 128  # decode steps per run
    rounds: int = 2
    window_steps: int = 8  # the governor's settings (router_service/prefetch_governor.py GovernorSettings)
    pairs: int = 3
    hold_steps: int = 256


def decode_with_and_without_governor(mesh, context_ids: torch.Tensor,
                                     workload: GovernorWorkload = GovernorWorkload()) -> dict:
    """mesh: an offloaded ExpertMesh; context_ids [B, C]: the prompts. -> {"workload", "runs", "summary"}."""
    from ...router_service.prefetch import NextLayerPredictor
    from ...router_service.prefetch_governor import GovernorSettings, PrefetchGovernor

    model, saved = mesh.model, mesh.backend.prefetcher
    settings = GovernorSettings(workload.window_steps, workload.pairs, workload.hold_steps)
    runs, reference = [], None
    try:
        for round_ in range(workload.rounds):
            for mode in (MODES if round_ % 2 == 0 else MODES[::-1]):
                governor = PrefetchGovernor(settings) if mode.endswith("+governor") else None
                mesh.backend.prefetcher = None if mode == "off" else NextLayerPredictor(
                    "gate", model.cfg.moe_layers, model.predict_experts, gate_probs=model.predict_expert_probs,
                    top_k=model.cfg.top_k, governor=governor)
                caches = [model.new_cache() for _ in range(len(context_ids))]
                out = model.forward(list(context_ids), caches)
                tokens, seconds = [], []
                for _ in range(workload.steps):
                    next_ids = torch.stack([x[-1] for x in out]).argmax(-1)  # [B] greedy
                    tokens.append(next_ids.tolist())
                    started = time.perf_counter()
                    out = model.forward([t.view(1) for t in next_ids], caches)
                    seconds.append(time.perf_counter() - started)
                for cache in caches:
                    cache.free()
                if mode == "off" and reference is None:
                    reference = tokens
                run = {"mode": mode, "round": round_, "steps": workload.steps,
                       "decode_tokens_per_s": round(len(context_ids) * workload.steps / sum(seconds), 1),
                       "median_step_ms": round(statistics.median(seconds) * 1e3, 2),
                       "_tokens": tokens}
                if governor is not None:
                    run["governor"] = governor.stats() | {"verdicts": governor.verdicts}
                runs.append(run)
    finally:
        mesh.backend.prefetcher = saved
    for run in runs:
        run["same_tokens_as_on_demand"] = run.pop("_tokens") == reference
    return {"workload": workload.__dict__, "runs": runs, "summary": summarize(runs)}


def summarize(runs: list[dict]) -> dict:
    """Per mode the median of its rounds' mean decode rates, and each mode's rate over on demand's."""
    rate = {m: statistics.median([r["decode_tokens_per_s"] for r in runs if r["mode"] == m]) for m in MODES
            if any(r["mode"] == m for r in runs)}
    off = rate.get("off")
    return {"decode_tokens_per_s": rate,
            "vs_on_demand": {m: round(v / off, 3) for m, v in rate.items()} if off else None,
            "all_tokens_equal": all(r["same_tokens_as_on_demand"] for r in runs)}
