"""The latency model's tables: predicted decode tokens/s per model x GPU x transport x batch, next to published
figures of vLLM and SGLang, and the project's targets (issue #26). Pure: no torch, no Ray.

Everything here is a prediction on paper until a GPU run replaces it (docs/concepts/cost-model.md).
"""

from __future__ import annotations

from .cost_model import Layout, Profile, StepShape, moe_layer_time, node_layout, predict_step
from .cost_profiles import GPUS, MODELS, TRANSPORTS, HardwareProfile, ModelShape, gpu_transports

BATCHES = (1, 32, 256)
CONTEXT = 1024  # cached positions per sequence in the tables (a short chat turn)
ALLREDUCE_S = 15e-6  # estimate: one NVLink all-reduce of a decode batch's hidden states (NCCL, small message)

# Published figures. Each names its source; the setups differ from expertmesh's (bigger clusters, FP8, speculative
# decoding): read them as the bar, not as like-for-like.
PUBLISHED = [
    # SGLang, DeepSeek-V3 on 12 nodes x 8 H100 with prefill/decode disaggregation and large-scale EP: "22.3k output
    # tokens per second per node" for 2000-token inputs (https://lmsys.org/blog/2025-05-05-large-scale-ep/).
    dict(model="deepseek-v3", engine="SGLang", hardware="8xH100 (per node of 96)", batch="large",
         tokens_per_s=22300, source="https://lmsys.org/blog/2025-05-05-large-scale-ep/"),
    # vLLM, DeepSeek-R1/V3 wide-EP on a multi-node H200 cluster: "2.2k tokens/s per H200 GPU" (blog.vllm.ai,
    # "vLLM Large Scale Serving: DeepSeek @ 2.2k tok/s/H200 with Wide-EP", 2025-12-17) -> x 8 per node.
    dict(model="deepseek-v3", engine="vLLM", hardware="8xH200 (per 8 GPUs, multi-node)", batch="large",
         tokens_per_s=2200 * 8, source="blog.vllm.ai: vLLM Large Scale Serving: DeepSeek @ 2.2k tok/s/H200"),
    # Project issue #26's anchor: Qwen3.5-35B-A3B FP8, one stream on one H100: 172.5 tokens/s (a sibling of
    # Qwen3-30B-A3B: 3B active parameters; not re-verified here).
    dict(model="qwen3-30b-a3b", engine="vLLM (Qwen3.5-35B-A3B FP8)", hardware="1xH100", batch=1,
         tokens_per_s=172.5, source="project issue #26 anchor"),
]


def tensor_parallel_b1_estimate(m: ModelShape, hw: HardwareProfile, gpus: int) -> float:
    """ESTIMATE, not a published figure: single-stream decode tokens/s of an engine like vLLM with tensor parallel
    over `gpus` GPUs and CUDA graphs: every active weight read once per token, split over the GPUs, plus two
    all-reduces per layer. Stands in where no published batch-1 figure was found (Mixtral-8x7B, Qwen3-30B-A3B)."""
    active = (m.attention_params + m.hidden_size * m.num_experts + 3 * m.hidden_size *
              (m.shared_expert_intermediate_size + m.top_k * m.expert_intermediate_size)) * m.moe_layer_count
    active += (m.attention_params + 3 * m.hidden_size * m.dense_intermediate_size) * m.dense_layer_count
    active += m.vocab_size * m.hidden_size
    step = active * 2 / gpus / (hw.mem_bw * hw.mem_eff) + (2 * m.num_layers * ALLREDUCE_S if gpus > 1 else 0.0)
    return 1.0 / step


def prediction_rows(models: dict[str, ModelShape] | None = None, gpus: tuple[str, ...] = ("H100", "H200"),
                    transports: tuple[str, ...] = TRANSPORTS, batches: tuple[int, ...] = BATCHES,
                    gpus_per_node: int = 8, context: int = CONTEXT, overlap: bool | str = "auto") -> list[dict]:
    """One row per (model, GPU, batch): the layout that fits, tokens/s per transport, the fastest one's layer
    breakdown."""
    rows = []
    tr = gpu_transports()
    for key, m in (models or MODELS).items():
        for gpu in gpus:
            hw = GPUS[gpu]
            for b in batches:
                row: dict = {"model": m.name, "key": key, "hardware": f"{gpus_per_node}x{gpu}", "batch": b,
                             "context": context}
                layout, why = node_layout(m, hw, gpus_per_node, b, context)
                row["layout"] = why
                if layout is None:
                    rows.append(row)
                    continue
                step = StepShape(b, b, context)
                row["tokens_per_s"], row["overlap"] = {}, {}
                for name in transports:
                    pred = predict_step(Profile(m, hw, tr[name], layout), step, overlap)
                    row["tokens_per_s"][name] = round(pred.tokens_per_s, 1)
                    row["overlap"][name] = pred.overlap
                best = max(row["tokens_per_s"], key=row["tokens_per_s"].get)  # the fastest transport here
                parts = moe_layer_time(Profile(m, hw, tr[best], layout), step)
                row["layer_us"] = {"via": best, **{k: round(v * 1e6, 1) for k, v in vars(parts).items()},
                                   "total": round(parts.total * 1e6, 1)}
                if b == 1:
                    row["tp_b1_estimate"] = round(tensor_parallel_b1_estimate(m, hw, gpus_per_node), 1)
                rows.append(row)
    return rows


def targets(context: int = CONTEXT) -> list[dict]:
    """Issue #26's targets against the model: transport round within a node, Mixtral batch 1 vs a TP=8 engine,
    Qwen3-30B-A3B one stream on one H200."""
    tr = gpu_transports()
    out = []
    mix, qwen = MODELS["mixtral-8x7b"], MODELS["qwen3-30b-a3b"]
    lay8 = Layout(devices=7, actors=7)
    for name in ("rdt", "socket", "compiled"):
        part = moe_layer_time(Profile(mix, GPUS["H100"], tr[name], lay8), StepShape(1, 1, context))
        out.append({"target": f"transport round <= 150 us within a node (Mixtral, batch 1, H100, {name})",
                    "predicted": round(part.transport * 1e6, 1), "unit": "us", "met": part.transport <= 150e-6})
    for gpu in ("H100", "H200"):
        ours = max(predict_step(Profile(mix, GPUS[gpu], tr[name], lay8), StepShape(1, 1, context)).tokens_per_s
                   for name in TRANSPORTS)
        ref = tensor_parallel_b1_estimate(mix, GPUS[gpu], 8)
        out.append({"target": f"Mixtral-8x7B batch 1 >= 60 % of a TP=8 engine (8x{gpu}; engine figure is an "
                              "estimate)", "predicted": round(ours / ref, 3), "unit": "fraction",
                    "met": ours >= 0.6 * ref, "ours": round(ours, 1), "engine_estimate": round(ref, 1)})
    layout, _ = node_layout(qwen, GPUS["H200"], 1, 1, context)
    if layout is not None:
        best = max(predict_step(Profile(qwen, GPUS["H200"], tr[name], layout), StepShape(1, 1, context)).tokens_per_s
                   for name in TRANSPORTS)
        out.append({"target": "Qwen3-30B-A3B one stream >= 100 tokens/s on one H200", "predicted": round(best, 1),
                    "unit": "tokens/s", "met": best >= 100})
    return out


def markdown_table(rows: list[dict] | None = None) -> str:
    """The docs page's prediction table (docs/concepts/cost-model.md; a unit test keeps the page equal to it)."""
    rows = prediction_rows() if rows is None else rows
    names = list(TRANSPORTS)
    lines = ["| model | GPUs | batch | layout | " + " | ".join(names) + " | TP=8 engine, batch 1 (estimate) |",
             "|---" * (5 + len(names)) + "|"]
    for r in rows:
        if "tokens_per_s" not in r:
            cells = ["does not fit"] * len(names)
        else:
            cells = [f"{r['tokens_per_s'][n]:,.0f}{'*' if r['overlap'][n] else ''}" for n in names]
        tp = f"{r['tp_b1_estimate']:,.0f}" if "tp_b1_estimate" in r else ""
        lines.append(f"| {r['model']} | {r['hardware']} | {r['batch']} | {r['layout']} | " + " | ".join(cells)
                     + f" | {tp} |")
    return "\n".join(lines)


def markdown_layers(rows: list[dict] | None = None) -> str:
    """Per MoE layer, the fastest transport's components (us) for every row that fits."""
    rows = prediction_rows() if rows is None else rows
    parts = ("router_dense", "plan", "transport", "expert", "combine", "total")
    lines = ["| model | GPUs | batch | fastest transport | " + " | ".join(p.replace("_", " ") for p in parts) + " |",
             "|---" * (4 + len(parts)) + "|"]
    for r in rows:
        if "layer_us" in r:
            lines.append(f"| {r['model']} | {r['hardware']} | {r['batch']} | {r['layer_us']['via']} | "
                         + " | ".join(f"{r['layer_us'][p]:,.0f}" for p in parts) + " |")
    return "\n".join(lines)


def markdown_targets() -> str:
    lines = ["| target | predicted | met |", "|---|---|---|"]
    for t in targets():
        lines.append(f"| {t['target']} | {t['predicted']} {t['unit']} | {'yes' if t['met'] else 'no'} |")
    return "\n".join(lines)


def what_if(context: int = CONTEXT) -> list[dict]:
    """Single-stream tokens/s with the fastest transport there, without the router's decode graphs, as modelled
    (with them), and when the biggest fixed costs left go: every launch (the expert side's too), the router's host
    planning (planning on the device: infinite host speed), both. Where the targets would come from."""
    from dataclasses import replace

    out = []
    transports = gpu_transports()
    cases = [("Mixtral-8x7B, 8xH100", MODELS["mixtral-8x7b"], GPUS["H100"], 8),
             ("Qwen3-30B-A3B, 1xH200", MODELS["qwen3-30b-a3b"], GPUS["H200"], 1)]
    for label, m, hw, gpus in cases:
        layout, _ = node_layout(m, hw, gpus, 1, context)
        name = max(transports, key=lambda t: predict_step(Profile(m, hw, transports[t], layout),
                                                           StepShape(1, 1, context)).tokens_per_s)
        tr = transports[name]
        label = f"{label}, {name}"
        variants = {"eager (no CUDA graphs)": replace(hw, graph_launch_s=None), "as modelled": hw,
                    "no launch overhead": replace(hw, op_overhead_s=0.0, graph_launch_s=0.0),
                    "no host planning": replace(hw, host_speed=float("inf")),
                    "neither": replace(hw, op_overhead_s=0.0, graph_launch_s=0.0, host_speed=float("inf"))}
        row: dict = {"case": label}
        for name, variant in variants.items():
            row[name] = round(predict_step(Profile(m, variant, tr, layout), StepShape(1, 1, context)).tokens_per_s, 1)
        out.append(row)
    return out


def markdown_what_if() -> str:
    rows = what_if()
    keys = [k for k in rows[0] if k != "case"]
    lines = ["| batch 1, fastest transport | " + " | ".join(keys) + " |", "|---" * (1 + len(keys)) + "|"]
    for r in rows:
        lines.append(f"| {r['case']} | " + " | ".join(f"{r[k]:,.1f}" for k in keys) + " |")
    return "\n".join(lines)
