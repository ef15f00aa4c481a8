"""`expertmesh bench quant`: what weight-only quantised experts (experts.quant) cost in quality and save in memory,
and how fast their matmuls run, per mode (none / int8 / int4), in one process (no Ray: the experts' math is the
actors', experts/quant.py, and distributed == this in-process reference bit for bit, tests/integration/test_quant.py).

Per mode:
- held-out perplexity of the model (ops/perplexity.py: the embedded model's held-out split, the drill's windows),
  and its ratio to "none" (the serving dtype);
- max and mean |Δlogit| against "none" over the first scored windows, and how often the top token stays the same
  (the max is a tail: a small change that flips a token's top-k experts moves that token's logits a lot);
- routed-expert bytes in the serving dtype and in bf16, with ratios, and how many of them are scales (and zeros);
- expert-compute time of one MoE layer's routed rows (GroupedExperts.run, as an actor computes them) for a decode
  step (32 tokens) and a prefill (256 tokens), in float32 and bf16, on the model's own expert shapes and on a
  Mixtral-like shape (hidden 1024, intermediate 2816, 8 experts, random weights) where the matmuls rather than
  Python dominate; with the matmul each matrix took (QuantizedLinear.kernel: torch's packed kernel or
  dequantise-per-call; float32 always dequantises, experts/quant.py says why).

The embedded model is tiny (hidden 64, intermediate 128): INT4's group of 128 inputs is the whole row of both its
matrices (gate_up has 64 inputs: one group of 64), so there INT4 is per-row INT4 with one scale and zero per row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...experts.checkpoint import CheckpointReader
from ...experts.ffn import GatedMLPWeights, activation
from ...experts.grouped_ffn import GroupedExperts
from ...experts.quant import QUANT_MODES, quantize_mlp
from ...experts.reference import all_shards, load_reference_model
from ...experts.weights import load_expert_shards
from ..drill.workload import PPL_WINDOW, held_out_chunk
from ..perplexity import held_out_perplexity
from .checkpoints import MIXTRAL
from .common import best_ms, machine_info

TARGETS = {"int8": {"perplexity_ratio_max": 1.01, "bytes_vs_bf16_max": 0.5},
           "int4": {"perplexity_ratio_max": 1.05, "bytes_vs_bf16_max": 0.25}}
DECODE_TOKENS, PREFILL_TOKENS = 32, 256
TIMED_DTYPES = ("float32", "bfloat16")
DLOGIT_WINDOWS = 4


@dataclass(frozen=True)
class QuantParams:
    """model_dir: None = the embedded model (its tokenizer gives the held-out text); tokens: held-out tokens scored
    per mode; dtype: the serving dtype; threads: torch threads, as one expert actor given that many CPUs; big_shape:
    the second timed expert shape (default: checkpoints.MIXTRAL's experts)."""

    model_dir: str | None = None
    tokens: int = 8192
    dtype: str = "float32"
    repeats: int = 5
    threads: int = 1
    modes: tuple[str, ...] = QUANT_MODES
    big_shape: dict = field(default_factory=lambda: {k: MIXTRAL[k] for k in ("hidden", "inter", "experts", "top_k")})

    @classmethod
    def from_args(cls, args) -> QuantParams:
        return cls(args.model, tokens=args.tokens, dtype=args.dtype, repeats=args.repeats, threads=args.threads)


def _load_experts(model_dir: Path, dtype: torch.dtype, mode: str) -> dict:
    reader = CheckpointReader(model_dir)
    return load_expert_shards(reader, all_shards(reader), dtype, quant=mode)


def _scale_bytes(shards: dict) -> int:
    return sum(m.scales.numel() * m.scales.element_size() for w in shards.values() if w.quant != "none"
               for m in (w.gate_up, w.down))


def _routed_rows(tokens: int, experts: int, top_k: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    """A layer's routed rows as an actor receives them: random top-k of `experts`, grouped by expert ascending."""
    gen = torch.Generator().manual_seed(seed)
    picks = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices.flatten()  # [T*k]
    counts = torch.bincount(picks, minlength=experts)
    hit = [e for e in range(experts) if counts[e] > 0]
    x = torch.randn(int(counts.sum()), hidden, generator=gen).to(dtype)  # [T*k, H]
    return hit, [int(counts[e]) for e in hit], x


def _compute_times(experts: GroupedExperts, layer: int, n_experts: int, top_k: int, hidden: int,
                   dtype: torch.dtype, repeats: int) -> dict:
    out = {}
    for phase, tokens in (("decode", DECODE_TOKENS), ("prefill", PREFILL_TOKENS)):
        hit, counts, x = _routed_rows(tokens, n_experts, top_k, hidden, dtype)
        with torch.inference_mode():
            out[f"{phase}_ms"] = best_ms(lambda: experts.run(layer, hit, counts, x), repeats)  # noqa: B023
    return out


def _big_shape_experts(s: dict) -> dict[tuple[int, int], GatedMLPWeights]:
    gen = torch.Generator().manual_seed(1)
    return {(0, e): GatedMLPWeights(torch.randn(2 * s["inter"], s["hidden"], generator=gen) * 0.02,
                                    torch.randn(s["hidden"], s["inter"], generator=gen) * 0.02)
            for e in range(s["experts"])}


def _kernels(shards: dict) -> dict:
    w = next(iter(shards.values()))
    if w.quant == "none":
        return {"gate_up": "F.linear (grouped_mm)", "down": "F.linear (grouped_mm)"}
    return {"gate_up": w.gate_up.kernel, "down": w.down.kernel, "int4_group": w.gate_up.group or None}


def run_quant_bench(params: QuantParams = QuantParams(), verbose: bool = True) -> dict:
    from ...experts.embedded_model import EMBEDDED_MODEL_DIR

    model_dir, tokens, dtype, repeats, threads = (params.model_dir, params.tokens, params.dtype, params.repeats,
                                                  params.threads)
    big_shape = params.big_shape
    torch.set_num_threads(threads)
    folder = Path(model_dir) if model_dir else EMBEDDED_MODEL_DIR
    serving = getattr(torch, dtype)
    cfg = CheckpointReader(folder).config
    result: dict = {
        "benchmark": "quant", "model": str(folder), "serving_dtype": dtype, "held_out_tokens": tokens,
        "expert_shapes": {"gate_up": [2 * cfg.expert_intermediate_size, cfg.hidden_size],
                          "down": [cfg.hidden_size, cfg.expert_intermediate_size]},
        "big_shape": big_shape, "timed_dtypes": list(TIMED_DTYPES), "decode_tokens": DECODE_TOKENS,
        "prefill_tokens": PREFILL_TOKENS,
        "machine": machine_info(cpu_capability=torch.backends.cpu.get_cpu_capability(), torch_threads=threads),
        "modes": {},
    }
    act = activation(cfg.hidden_act)
    big_float = _big_shape_experts(big_shape)  # float32; each mode and timed dtype casts/quantises its own copy
    base_logits = None
    for mode in params.modes:
        started = time.perf_counter()
        model = load_reference_model(folder, serving, quant=mode)
        ppl = held_out_perplexity(model, str(folder) if model_dir else None, tokens=tokens)
        row: dict = {"perplexity": round(ppl["perplexity"], 4), "tokens_scored": ppl["tokens_scored"]}
        ids, _ = held_out_chunk(str(folder) if model_dir else None, DLOGIT_WINDOWS * PPL_WINDOW)
        windows = [torch.tensor(ids[i:i + PPL_WINDOW]) for i in range(0, len(ids), PPL_WINDOW)]
        logits = torch.cat([t.float() for t in model.forward(windows)])  # [W*T, V]
        base_logits = logits if base_logits is None else base_logits
        delta = (logits - base_logits).abs()
        row["max_abs_dlogit"] = round(delta.max().item(), 5)
        row["mean_abs_dlogit"] = round(delta.mean().item(), 6)
        row["top1_agreement"] = round((logits.argmax(-1) == base_logits.argmax(-1)).float().mean().item(), 5)
        row["expert_bytes"] = sum(w.nbytes() for w in model.experts.shards.values())
        row["scale_bytes"] = _scale_bytes(model.experts.shards)
        bf16 = _load_experts(folder, torch.bfloat16, mode)
        row["expert_bytes_bf16"] = sum(w.nbytes() for w in bf16.values())
        row["scale_bytes_bf16"] = _scale_bytes(bf16)
        row["compute"] = {}
        for name in TIMED_DTYPES:
            timed = getattr(torch, name)
            experts = GroupedExperts(_load_experts(folder, timed, mode), act)
            big = GroupedExperts({s: quantize_mlp(w.to("cpu", timed), mode) for s, w in big_float.items()}, act)
            row["compute"][name] = {
                "model_shape": _compute_times(experts, cfg.moe_layers[0], cfg.num_experts, cfg.top_k,
                                              cfg.hidden_size, timed, repeats) | {"kernels": _kernels(experts.shards)},
                "big_shape": _compute_times(big, 0, big_shape["experts"], big_shape["top_k"], big_shape["hidden"],
                                            timed, repeats) | {"kernels": _kernels(big.shards)},
            }
        row["seconds"] = round(time.perf_counter() - started, 1)
        result["modes"][mode] = row
        if verbose:
            print(f"# {mode}: ppl {row['perplexity']}  bytes {row['expert_bytes']}  "
                  f"max|Δlogit| {row['max_abs_dlogit']:.4g}  {row['seconds']} s", flush=True)
    _ratios(result)
    return result


def _ratios(result: dict) -> None:
    """Each mode against "none": perplexity, bytes (serving dtype and bf16), compute time; targets met."""
    modes = result["modes"]
    base = modes.get("none")
    if base is None:
        return
    for mode, row in modes.items():
        row["perplexity_ratio"] = round(row["perplexity"] / base["perplexity"], 5)
        row["bytes_ratio"] = round(row["expert_bytes"] / base["expert_bytes"], 4)
        row["bytes_ratio_vs_bf16"] = round(row["expert_bytes_bf16"] / base["expert_bytes_bf16"], 4)
        # the integers alone against bf16: exactly 1/2 and 1/4; the scales (and zeros) are what the targets' "±" allows
        row["bytes_ratio_vs_bf16_without_scales"] = round(
            (row["expert_bytes_bf16"] - row["scale_bytes_bf16"]) / base["expert_bytes_bf16"], 4)
        for dtype, shapes in row["compute"].items():
            for shape, times in shapes.items():
                for phase in ("decode", "prefill"):
                    times[f"{phase}_vs_none"] = round(
                        times[f"{phase}_ms"] / base["compute"][dtype][shape][f"{phase}_ms"], 3)
        target = TARGETS.get(mode)
        if target is not None:
            row["targets"] = target | {
                "perplexity_met": row["perplexity_ratio"] <= target["perplexity_ratio_max"],
                "bytes_met": row["bytes_ratio_vs_bf16_without_scales"] <= target["bytes_vs_bf16_max"],
            }
