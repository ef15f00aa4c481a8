"""The one explicit map from checkpoint tensor names to the model's tensors, per family, and the loaders.

The router loads the dense part (`load_dense_weights`); each expert actor loads only its shards
(`load_expert_shards`). Names are the on-disk names that `save_pretrained` writes and that published checkpoints
use. Routed experts come in one of these on-disk layouts, detected from the checkpoint's tensor names
(`expert_layout`):

- per_expert: one tensor per expert and role (`block_sparse_moe.experts.E.w1` for Mixtral,
  `mlp.experts.E.gate_proj` for the others) — what `save_pretrained` of a model built from a config writes;
- fused: transformers 5's stacked tensors `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
  `mlp.experts.down_proj` [E, H, I], router `mlp.gate.weight` (Mixtral too) — written when a model loaded from fused
  files is saved again, with `save_pretrained(save_original_format=False)`, and by recent Qwen releases;
- fused_interleaved (gpt-oss): `gate_up_proj` [E, H, 2I] whose columns alternate gate, up; `down_proj` [E, I, H];
  `gate_up_proj_bias` [E, 2I], `down_proj_bias` [E, H];
- fused_in_out (Llama 4, its only layout): `feed_forward.experts.gate_up_proj` [E, H, 2I] in x @ W form (gate
  columns, then up columns) and `down_proj` [E, I, H], under `cfg.weight_prefix` (experts/weights_llama4.py);
- mxfp4 (gpt-oss as published): `*_blocks` u8 / `*_scales` u8 instead of `gate_up_proj` and `down_proj`, dequantised
  on load (experts/mxfp4.py); biases as fused_interleaved.

The fused names are the per-expert prefix `model.layers.{L}.mlp.experts.` without the expert index. A fused tensor
is read one expert row at a time (`CheckpointReader.read_rows`), never whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .checkpoint import CheckpointReader
from .config import MoEModelConfig
from .config_deepseek import FAMILIES as DEEPSEEK_FAMILIES
from .dense_weights import AttentionWeights, DenseWeights, LayerWeights, mlp_names
from .errors import CheckpointError
from .ffn import GatedMLPWeights
from .fp8 import read_weights, scale_names
from .mxfp4 import dequantize as dequantize_mxfp4
from .quant import quantize_mlp
from .weights_deepseek import deepseek_dense_tensor_names, load_deepseek_dense_weights
from .weights_kimi_linear import FAMILIES as KIMI_FAMILIES
from .weights_kimi_linear import kimi_dense_tensor_names, kimi_expert_prefix, load_kimi_dense_weights
from .weights_llama4 import FAMILIES as LLAMA4_FAMILIES
from .weights_llama4 import llama4_dense_tensor_names, llama4_expert_prefix, load_llama4_dense_weights
from .weights_longcat_flash import FAMILIES as LONGCAT_FAMILIES
from .weights_longcat_flash import load_longcat_dense_weights, longcat_dense_tensor_names, longcat_prefix
from .weights_mimo_v2_flash import FAMILIES as MIMO_FAMILIES
from .weights_mimo_v2_flash import load_mimo_dense_weights, mimo_dense_tensor_names
from .weights_minimax_ernie_hunyuan import FAMILIES as SELECTION_BIAS_FAMILIES
from .weights_minimax_ernie_hunyuan import family_dense_tensor_names, load_family_dense_weights
from .weights_qwen3_next import FAMILIES as QWEN3_NEXT_FAMILIES
from .weights_qwen3_next import load_qwen3_next_dense_weights, qwen3_next_dense_tensor_names, qwen3_next_expert_prefix

Shard = tuple[int, int]  # (layer, expert)

PER_EXPERT, FUSED, FUSED_INTERLEAVED, MXFP4 = "per_expert", "fused", "fused_interleaved", "mxfp4"
FUSED_IN_OUT = "fused_in_out"
# LongCat-Flash stacked by transformers <= 5.24, which allocated (and saved) gate/up rows for the identity experts
# too: gate_up_proj [E + Z, 2I, H], rows E.. never read. transformers 5.25 saves [E, 2I, H] (plain FUSED).
FUSED_IDENTITY_ROWS = "fused_identity_rows"
EXPERT_LAYOUTS = (PER_EXPERT, FUSED, FUSED_INTERLEAVED, MXFP4, FUSED_IN_OUT, FUSED_IDENTITY_ROWS)
INTERLEAVED_FAMILIES = ("gpt_oss",)  # stacked [E, H, 2I] with alternating gate/up columns, biases; never per-expert


def expert_tensor_names(cfg: MoEModelConfig, layer: int, expert: int) -> dict[str, tuple[str, tuple[int, int]]]:
    """role -> (on-disk name, expected shape) for one expert of one layer, per-expert layout."""
    hidden, inter = cfg.hidden_size, cfg.expert_intermediate_size
    if cfg.family in ("mixtral", "minimax_m2", *KIMI_FAMILIES):  # MiniMax-M2, Kimi-Linear: Mixtral's names
        prefix = f"{kimi_expert_prefix(layer)}{expert}."
        names = {"gate": "w1.weight", "up": "w3.weight", "down": "w2.weight"}
    else:
        prefix = f"{fused_expert_prefix(layer, cfg)}{expert}."
        names = {"gate": "gate_proj.weight", "up": "up_proj.weight", "down": "down_proj.weight"}
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    return {role: (prefix + name, shapes[role]) for role, name in names.items()}


def fused_expert_prefix(layer: int, cfg: MoEModelConfig | None = None) -> str:
    """Where transformers 5 keeps a layer's stacked experts (every family, Mixtral included; Llama 4 its own)."""
    if cfg is not None and cfg.family in LLAMA4_FAMILIES:
        return llama4_expert_prefix(cfg, layer)
    if cfg is not None and cfg.family in QWEN3_NEXT_FAMILIES:  # under the VL wrapper's model.language_model.
        return qwen3_next_expert_prefix(cfg, layer)
    if cfg is not None and cfg.family in LONGCAT_FAMILIES:  # sublayer 2L's MoE is logical layer L's
        return longcat_prefix(layer) + "mlp.experts."
    return f"model.layers.{layer}.mlp.experts."


def fused_tensor_names(cfg: MoEModelConfig, layer: int, layout: str) -> dict[str, tuple[int, ...]]:
    """role -> (on-disk name, full stacked shape) of one layer's experts in a stacked layout."""
    e, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size
    base = fused_expert_prefix(layer, cfg)
    if layout in (FUSED, FUSED_IDENTITY_ROWS):
        rows = e + cfg.zero_experts if layout == FUSED_IDENTITY_ROWS else e
        return {"gate_up": (base + "gate_up_proj", (rows, 2 * inter, hidden)),
                "down": (base + "down_proj", (e, hidden, inter))}
    if layout == FUSED_IN_OUT:
        return {"gate_up": (base + "gate_up_proj", (e, hidden, 2 * inter)),
                "down": (base + "down_proj", (e, inter, hidden))}
    biases = {"gate_up_bias": (base + "gate_up_proj_bias", (e, 2 * inter)),
              "down_bias": (base + "down_proj_bias", (e, hidden))}
    if layout == FUSED_INTERLEAVED:
        return {"gate_up": (base + "gate_up_proj", (e, hidden, 2 * inter)),
                "down": (base + "down_proj", (e, inter, hidden))} | biases
    if layout == MXFP4:
        for what, cols in (("hidden_size", hidden), ("intermediate_size", inter)):
            if cols % 32:
                raise CheckpointError(f"config.json: key '{what}'={cols} must be a multiple of 32 for MXFP4 blocks")
        return {"gate_up_blocks": (base + "gate_up_proj_blocks", (e, 2 * inter, hidden // 32, 16)),
                "gate_up_scales": (base + "gate_up_proj_scales", (e, 2 * inter, hidden // 32)),
                "down_blocks": (base + "down_proj_blocks", (e, hidden, inter // 32, 16)),
                "down_scales": (base + "down_proj_scales", (e, hidden, inter // 32))} | biases
    raise ValueError(f"not a stacked expert layout: {layout!r}")


def expert_layout(cfg: MoEModelConfig, has) -> str:
    """The layout of the routed experts, from the tensor names (`has(name) -> bool`) of the first MoE layer."""
    if not cfg.moe_layers:
        return PER_EXPERT
    if cfg.family in LLAMA4_FAMILIES:
        return FUSED_IN_OUT  # the only layout transformers writes for it (a missing tensor is reported by name)
    base = fused_expert_prefix(cfg.moe_layers[0], cfg)
    if has(base + "gate_up_proj_blocks"):
        return MXFP4
    if cfg.family in INTERLEAVED_FAMILIES:
        return FUSED_INTERLEAVED  # its only unquantised layout (a missing tensor is then reported by name)
    if not has(base + "gate_up_proj"):
        return PER_EXPERT
    if cfg.fp8_block is not None:  # FP8 block scales are per-expert tensors (`X.weight_scale_inv`) only
        raise CheckpointError(f"tensor '{base}gate_up_proj': stacked experts in an FP8 checkpoint are not supported "
                              "(per-expert FP8 tensors are)")
    return FUSED


def _layout_of(reader: CheckpointReader) -> str:
    """expert_layout, and for a stacked LongCat-Flash file which transformers wrote it (the gate_up_proj header's
    rows: E + Z from <= 5.24, E from 5.25). A header this process cannot read (a partial folder, an uncached Hub
    file offline) passes check_shapes: that file's reader then names the shape it finds."""
    cfg = reader.config
    layout = expert_layout(cfg, reader.has)
    if layout == FUSED and cfg.zero_experts:
        name, shape = fused_tensor_names(cfg, cfg.moe_layers[0], FUSED_IDENTITY_ROWS)["gate_up"]
        try:
            reader.check_shapes({name: shape})
        except CheckpointError:
            return FUSED
        return FUSED_IDENTITY_ROWS
    return layout


def router_tensor_names(cfg: MoEModelConfig, layer: int, layout: str = PER_EXPERT) -> dict[str, tuple[int, ...]]:
    """The router of an MoE layer: name -> shape (weight, and gpt-oss's bias)."""
    p = f"model.layers.{layer}."
    if cfg.family == "gpt_oss":  # the weight first, then the bias (load_dense_weights relies on the order)
        return {p + "mlp.router.weight": (cfg.num_experts, cfg.hidden_size), p + "mlp.router.bias": (cfg.num_experts,)}
    # transformers 5 moves Mixtral's block_sparse_moe to mlp; the fused files carry the new name
    module = "block_sparse_moe" if cfg.family == "mixtral" and layout == PER_EXPERT else "mlp"
    return {p + module + ".gate.weight": (cfg.num_experts, cfg.hidden_size)}


def expert_shard_bytes(reader: CheckpointReader, shards: list[Shard]) -> int:
    """Bytes an actor hosting `shards` reads (as stored; FP8 scales included; of a stacked tensor, its share of
    rows). Headers only."""
    cfg = reader.config
    layout = _layout_of(reader)
    if layout == PER_EXPERT:
        names = dict(expert_shard_names(cfg, shards))
        if cfg.fp8_block is not None:
            names |= scale_names(reader, names, cfg.fp8_block)
        return reader.nbytes(names)
    hosted: dict[int, int] = {}
    for layer, _ in shards:
        hosted[layer] = hosted.get(layer, 0) + 1
    # a stacked tensor's share: its bytes per row x rows hosted (LongCat's from transformers <= 5.24: identity rows too)
    return sum(reader.nbytes({name: shape}) // shape[0] * count for layer, count in hosted.items()
               for name, shape in expert_shard_names(cfg, [(layer, 0)], layout).items())


def _check_shards(cfg: MoEModelConfig, shards: list[Shard]) -> None:
    for layer, expert in shards:
        if not cfg.is_moe_layer(layer) or not 0 <= expert < cfg.num_experts:
            raise ValueError(f"shard (layer={layer}, expert={expert}) does not exist in this model")


def expert_shard_names(
    cfg: MoEModelConfig, shards: list[Shard], layout: str = PER_EXPERT
) -> dict[str, tuple[int, ...]]:
    """Every tensor name (-> expected shape) holding `shards`; for a stacked layout, the whole [E, ...] tensors."""
    _check_shards(cfg, shards)
    wanted: dict[str, tuple[int, ...]] = {}
    for layer, expert in shards:
        if layout == PER_EXPERT:
            wanted |= {name: shape for name, shape in expert_tensor_names(cfg, layer, expert).values()}
        else:
            wanted |= {name: shape for name, shape in fused_tensor_names(cfg, layer, layout).values()}
    return wanted


def check_checkpoint(reader: CheckpointReader) -> None:
    """Every tensor the model needs exists with the right shape (headers only; no data is read)."""
    cfg = reader.config
    layout = _layout_of(reader)
    shards = [(layer, e) for layer in cfg.moe_layers for e in range(cfg.num_experts)]
    wanted = dense_tensor_names(cfg, layout, reader.has) | expert_shard_names(cfg, shards, layout)
    if cfg.fp8_block is not None:  # an FP8 checkpoint's block scales must fit their weights too
        wanted |= scale_names(reader, wanted, cfg.fp8_block)
    reader.check_shapes(wanted)


def load_expert_shards(
    reader: CheckpointReader,
    shards: list[Shard],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: str | None = None,
    on_bytes: Callable[[int], None] | None = None,
    quant: str = "none",
) -> dict[Shard, GatedMLPWeights]:
    """Read exactly the tensors (or stacked rows) of `shards`, nothing else, in their stored dtype, straight onto
    `device`, cast each once to `dtype`, and fuse each shard's into GatedMLPWeights there. on_bytes: progress.

    quant (experts.quant): "int8" / "int4" quantise each shard's fused matrices once, as the shard is built, from
    the tensors as loaded (FP8 and MXFP4 checkpoints: their dequantised `dtype` values; experts/quant.py), and the
    float copy is dropped; "none" keeps them in `dtype`."""
    cfg = reader.config
    layout = _layout_of(reader)
    if layout != PER_EXPERT:
        out = _load_stacked_shards(reader, shards, layout, dtype, device, progress)
        if on_bytes is not None:
            on_bytes(sum(w.nbytes() for w in out.values()))  # stacked rows: reported once, at the end
        for shard in out:
            out[shard] = quantize_mlp(out[shard], quant).aligned()
        return out
    tensors = _cast_each(read_weights(reader, expert_shard_names(cfg, shards), cfg.fp8_block, progress=progress,
                                      on_bytes=on_bytes, device=device), dtype, device)
    out: dict[Shard, GatedMLPWeights] = {}
    for layer, expert in shards:
        names = expert_tensor_names(cfg, layer, expert)
        # pop: a shard's parts are dropped as soon as they are fused, so the device holds each weight once (+ a shard)
        parts = {role: tensors.pop(name) for role, (name, _) in names.items()}
        # aligned: a weight read in place starts at its offset in the file; where it starts changes a gemv's bits
        out[(layer, expert)] = quantize_mlp(GatedMLPWeights.from_parts(**parts), quant).aligned()
    return out


def _load_stacked_shards(
    reader: CheckpointReader, shards: list[Shard], layout: str, dtype: torch.dtype,
    device: str | torch.device, progress: str | None,
) -> dict[Shard, GatedMLPWeights]:
    """The stacked layouts: each shard's rows of its layer's [E, ...] tensors, never a whole tensor."""
    cfg = reader.config
    _check_shards(cfg, shards)
    wanted: dict[str, tuple[tuple[int, ...], list[int]]] = {}
    for layer, expert in shards:
        for name, shape in fused_tensor_names(cfg, layer, layout).values():
            wanted.setdefault(name, (shape, []))[1].append(expert)
    rows = reader.read_rows(wanted, progress=progress)
    out: dict[Shard, GatedMLPWeights] = {}
    for layer, expert in shards:
        # pop: an expert's rows are dropped once fused; it is built in the stored dtype (MXFP4: dequantised straight
        # to `dtype`) and moved/cast once
        parts = {role: rows.pop((name, expert)) for role, (name, _) in fused_tensor_names(cfg, layer, layout).items()}
        out[(layer, expert)] = _expert_from_rows(cfg, layout, parts, dtype).to(device, dtype)
    return out


def _expert_from_rows(
    cfg: MoEModelConfig, layout: str, t: dict[str, torch.Tensor], dtype: torch.dtype
) -> GatedMLPWeights:
    """One expert's rows of the stacked tensors -> GatedMLPWeights ([2I, H] gate rows then up rows, [H, I])."""
    if layout in (FUSED, FUSED_IDENTITY_ROWS):
        return GatedMLPWeights(gate_up=t["gate_up"].contiguous(), down=t["down"].contiguous())
    if layout == FUSED_IN_OUT:  # x @ W form [H, 2I] (gate columns, then up) and [I, H]: F.linear's [out, in]
        return GatedMLPWeights(gate_up=t["gate_up"].t().contiguous(), down=t["down"].t().contiguous())
    if layout == MXFP4:
        gate_up = dequantize_mxfp4(t["gate_up_blocks"], t["gate_up_scales"], dtype)  # [2I, H], rows alternate gate, up
        down = dequantize_mxfp4(t["down_blocks"], t["down_scales"], dtype)  # [H, I]
    else:  # FUSED_INTERLEAVED: x @ W form, transpose to F.linear's [out, in]
        gate_up = t["gate_up"].t()  # [2I, H], rows alternate gate, up
        down = t["down"].t()  # [H, I]
    bias = t["gate_up_bias"]  # [2I], alternating too
    return GatedMLPWeights.from_parts(
        gate_up[0::2], gate_up[1::2], down,
        gate_up_bias=torch.cat([bias[0::2], bias[1::2]]), down_bias=t["down_bias"].contiguous(),
        kind=cfg.expert_activation, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit,
    )


def _cast_each(tensors: dict[str, torch.Tensor], dtype: torch.dtype,
               device: str | torch.device) -> dict[str, torch.Tensor]:
    """Every tensor (as read, in its stored dtype) moved and cast once, replacing it in the dict as it goes, so no
    second full copy of the weights exists at any point (a bf16 checkpoint read as bf16 is never widened)."""
    for name in list(tensors):
        tensors[name] = tensors[name].to(device=device, dtype=dtype)
    return tensors


class DenseFamily(NamedTuple):
    """A family whose dense part (attention, norms, router) its own module names and loads."""

    tensor_names: Callable[..., dict[str, tuple[int, ...]]]  # (cfg, experts stacked[, has]) -> name: shape
    load: Callable[..., DenseWeights]  # (reader, dtype, progress, device) -> DenseWeights
    # Kimi-Linear: some names depend on which the files hold (tensor_names takes `has(name) -> bool` then)
    reads_names: bool = False


# The family table: families not listed use the common names below. The modules listed import only dense_weights
# from here, never this module, so there is no import cycle to break with late imports.
DENSE_FAMILIES: dict[str, DenseFamily] = {
    family: DenseFamily(lambda cfg, stacked: deepseek_dense_tensor_names(cfg), load_deepseek_dense_weights)
    for family in DEEPSEEK_FAMILIES
} | {family: DenseFamily(family_dense_tensor_names, load_family_dense_weights) for family in SELECTION_BIAS_FAMILIES} \
    | {family: DenseFamily(llama4_dense_tensor_names, load_llama4_dense_weights) for family in LLAMA4_FAMILIES} \
    | {family: DenseFamily(mimo_dense_tensor_names, load_mimo_dense_weights) for family in MIMO_FAMILIES} \
    | {family: DenseFamily(longcat_dense_tensor_names, load_longcat_dense_weights) for family in LONGCAT_FAMILIES} \
    | {family: DenseFamily(qwen3_next_dense_tensor_names, load_qwen3_next_dense_weights)
       for family in QWEN3_NEXT_FAMILIES} \
    | {family: DenseFamily(kimi_dense_tensor_names, load_kimi_dense_weights, reads_names=True)
       for family in KIMI_FAMILIES}


def dense_tensor_names(cfg: MoEModelConfig, layout: str = PER_EXPERT,
                       has: Callable[[str], bool] | None = None) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor the model needs: name -> expected shape (`layout` names Mixtral's router; `has`, the
    checkpoint's names, for a family whose names depend on them)."""
    if (own := DENSE_FAMILIES.get(cfg.family)) is not None:
        if own.reads_names:
            return own.tensor_names(cfg, layout != PER_EXPERT, has)
        return own.tensor_names(cfg, layout != PER_EXPERT)
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (vocab, hidden)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_dim),
        }
        if cfg.attention_bias:
            names |= {
                p + "self_attn.q_proj.bias": (q_dim,),
                p + "self_attn.k_proj.bias": (kv_dim,),
                p + "self_attn.v_proj.bias": (kv_dim,),
            }
        if cfg.qk_norm:
            names |= {p + "self_attn.q_norm.weight": (q_dim,), p + "self_attn.k_norm.weight": (kv_dim,)}
        if cfg.qk_norm_per_head:
            names |= {p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,)}
        if cfg.attention_out_bias:
            names[p + "self_attn.o_proj.bias"] = (hidden,)
        if cfg.attention_sinks:
            names[p + "self_attn.sinks"] = (cfg.num_heads,)
        if cfg.is_moe_layer(i):
            names |= router_tensor_names(cfg, i, layout)
            if cfg.has_shared_expert:
                names |= mlp_names(p + "mlp.shared_expert.", hidden, cfg.shared_expert_intermediate_size)
                names[p + "mlp.shared_expert_gate.weight"] = (1, hidden)
        else:
            names |= mlp_names(p + "mlp.", hidden, cfg.dense_intermediate_size)
    return names


def load_dense_weights(
    reader: CheckpointReader, dtype: torch.dtype = torch.float32, progress: str | None = None,
    device: str | torch.device = "cpu",
) -> DenseWeights:
    """Everything but the routed experts, read in the stored dtype and moved/cast once per tensor to (device, dtype)."""
    cfg = reader.config
    if (own := DENSE_FAMILIES.get(cfg.family)) is not None:
        return own.load(reader, dtype, progress, device)
    layout = _layout_of(reader)
    t = _cast_each(reader.read_many(dense_tensor_names(cfg, layout), progress=progress), dtype, device)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        attention = AttentionWeights(
            q=t[a + "q_proj.weight"], k=t[a + "k_proj.weight"], v=t[a + "v_proj.weight"], o=t[a + "o_proj.weight"],
            q_bias=t.get(a + "q_proj.bias"), k_bias=t.get(a + "k_proj.bias"), v_bias=t.get(a + "v_proj.bias"),
            q_norm=t.get(a + "q_norm.weight"), k_norm=t.get(a + "k_norm.weight"),
            o_bias=t.get(a + "o_proj.bias"), sinks=t.get(a + "sinks"),
        )
        layer = LayerWeights(
            input_norm=t[p + "input_layernorm.weight"],
            post_attention_norm=t[p + "post_attention_layernorm.weight"],
            attention=attention,
        )
        if cfg.is_moe_layer(i):
            router = list(router_tensor_names(cfg, i, layout))  # the weight, then gpt-oss's bias
            layer.router = t[router[0]]
            layer.router_bias = t[router[1]] if len(router) > 1 else None
            if cfg.has_shared_expert:
                layer.shared_expert = _mlp(t, p + "mlp.shared_expert.")
                layer.shared_expert_gate = t[p + "mlp.shared_expert_gate.weight"]
        else:
            layer.dense_mlp = _mlp(t, p + "mlp.")
        layers.append(layer)
    embed = t["model.embed_tokens.weight"]
    return DenseWeights(
        embed=embed,
        layers=layers,
        final_norm=t["model.norm.weight"],
        lm_head=embed if cfg.tie_word_embeddings else t["lm_head.weight"],
    )


def _mlp(t: dict[str, torch.Tensor], prefix: str) -> GatedMLPWeights:
    return GatedMLPWeights.from_parts(
        t[prefix + "gate_proj.weight"], t[prefix + "up_proj.weight"], t[prefix + "down_proj.weight"]
    )
