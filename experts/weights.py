"""The one explicit map from checkpoint tensor names to the model's tensors, per family, and the loaders.

The router loads the dense part (`load_dense_weights`); each expert actor loads only its shards
(`load_expert_shards`). Names are the on-disk names that `save_pretrained` writes and that published checkpoints
use (`block_sparse_moe.experts.E.w1` for Mixtral, `mlp.experts.E.gate_proj` for Qwen2-MoE and OLMoE).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .checkpoint import CheckpointReader
from .config import MoEModelConfig
from .config_deepseek import FAMILIES as DEEPSEEK_FAMILIES
from .ffn import GatedMLPWeights
from .fp8 import read_weights, scale_names

Shard = tuple[int, int]  # (layer, expert)


def expert_tensor_names(cfg: MoEModelConfig, layer: int, expert: int) -> dict[str, tuple[str, tuple[int, int]]]:
    """role -> (on-disk name, expected shape) for one expert of one layer."""
    hidden, inter = cfg.hidden_size, cfg.expert_intermediate_size
    if cfg.family == "mixtral":
        prefix = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
        names = {"gate": "w1.weight", "up": "w3.weight", "down": "w2.weight"}
    else:
        prefix = f"model.layers.{layer}.mlp.experts.{expert}."
        names = {"gate": "gate_proj.weight", "up": "up_proj.weight", "down": "down_proj.weight"}
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    return {role: (prefix + name, shapes[role]) for role, name in names.items()}


def expert_shard_bytes(reader: CheckpointReader, shards: list[Shard]) -> int:
    """Bytes an actor hosting `shards` reads (as stored, FP8 scales included; headers only)."""
    cfg = reader.config
    names = dict(expert_shard_names(cfg, shards))
    if cfg.fp8_block is not None:
        names |= scale_names(reader, names, cfg.fp8_block)
    return reader.nbytes(names)


def expert_shard_names(cfg: MoEModelConfig, shards: list[Shard]) -> dict[str, tuple[int, ...]]:
    """Every tensor name (-> expected shape) of `shards`."""
    wanted: dict[str, tuple[int, ...]] = {}
    for layer, expert in shards:
        if not cfg.is_moe_layer(layer) or not 0 <= expert < cfg.num_experts:
            raise ValueError(f"shard (layer={layer}, expert={expert}) does not exist in this model")
        for name, shape in expert_tensor_names(cfg, layer, expert).values():
            wanted[name] = shape
    return wanted


def check_checkpoint(reader: CheckpointReader) -> None:
    """Every tensor the model needs exists with the right shape (headers only; no data is read)."""
    cfg = reader.config
    shards = [(layer, e) for layer in cfg.moe_layers for e in range(cfg.num_experts)]
    wanted = dense_tensor_names(cfg) | expert_shard_names(cfg, shards)
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
) -> dict[Shard, GatedMLPWeights]:
    """Read exactly the tensors of `shards` (nothing else is touched) in their stored dtype, straight onto `device`,
    cast each once to `dtype`, and fuse each shard's into GatedMLPWeights there. on_bytes: load progress."""
    cfg = reader.config
    tensors = _cast_each(read_weights(reader, expert_shard_names(cfg, shards), cfg.fp8_block, progress=progress,
                                      on_bytes=on_bytes, device=device), dtype, device)
    out: dict[Shard, GatedMLPWeights] = {}
    for layer, expert in shards:
        names = expert_tensor_names(cfg, layer, expert)
        # pop: a shard's parts are dropped as soon as they are fused, so the device holds each weight once (+ a shard)
        parts = {role: tensors.pop(name) for role, (name, _) in names.items()}
        out[(layer, expert)] = GatedMLPWeights.from_parts(**parts)
    return out


def _cast_each(tensors: dict[str, torch.Tensor], dtype: torch.dtype,
               device: str | torch.device) -> dict[str, torch.Tensor]:
    """Every tensor (as read, in its stored dtype) moved and cast once, replacing it in the dict as it goes, so no
    second full copy of the weights exists at any point (a bf16 checkpoint read as bf16 is never widened)."""
    for name in list(tensors):
        tensors[name] = tensors[name].to(device=device, dtype=dtype)
    return tensors


@dataclass
class AttentionWeights:
    q: torch.Tensor  # [nh*D, H]
    k: torch.Tensor  # [kvh*D, H]
    v: torch.Tensor  # [kvh*D, H]
    o: torch.Tensor  # [H, nh*D]
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # OLMoE: [nh*D]
    k_norm: torch.Tensor | None = None  # OLMoE: [kvh*D]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    post_attention_norm: torch.Tensor  # [H]
    attention: AttentionWeights
    router: torch.Tensor | None = None  # [E, H] gate of an MoE layer
    dense_mlp: GatedMLPWeights | None = None  # Qwen2-MoE mlp_only layers
    shared_expert: GatedMLPWeights | None = None  # Qwen2-MoE
    shared_expert_gate: torch.Tensor | None = None  # [1, H]
    router_correction_bias: torch.Tensor | None = None  # [E] DeepSeek-V3 / GLM-4.5 e_score_correction_bias


@dataclass
class DenseWeights:
    """Everything but the routed experts: what the router holds."""

    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights] = field(default_factory=list)
    final_norm: torch.Tensor | None = None  # [H]
    lm_head: torch.Tensor | None = None  # [V, H]


def dense_tensor_names(cfg: MoEModelConfig) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor the model needs: name -> expected shape."""
    if cfg.family in DEEPSEEK_FAMILIES:
        from .weights_deepseek import deepseek_dense_tensor_names  # imports this module's dataclasses

        return deepseek_dense_tensor_names(cfg)
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
        if cfg.is_moe_layer(i):
            router = "block_sparse_moe.gate.weight" if cfg.family == "mixtral" else "mlp.gate.weight"
            names[p + router] = (cfg.num_experts, hidden)
            if cfg.has_shared_expert:
                names |= _mlp_names(p + "mlp.shared_expert.", hidden, cfg.shared_expert_intermediate_size)
                names[p + "mlp.shared_expert_gate.weight"] = (1, hidden)
        else:
            names |= _mlp_names(p + "mlp.", hidden, cfg.dense_intermediate_size)
    return names


def _mlp_names(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {
        prefix + "gate_proj.weight": (inter, hidden),
        prefix + "up_proj.weight": (inter, hidden),
        prefix + "down_proj.weight": (hidden, inter),
    }


def load_dense_weights(
    reader: CheckpointReader, dtype: torch.dtype = torch.float32, progress: str | None = None,
    device: str | torch.device = "cpu",
) -> DenseWeights:
    """Everything but the routed experts, read in the stored dtype and moved/cast once per tensor to (device, dtype)."""
    cfg = reader.config
    if cfg.family in DEEPSEEK_FAMILIES:
        from .weights_deepseek import load_deepseek_dense_weights  # imports this module's dataclasses

        return load_deepseek_dense_weights(reader, dtype, progress, device)
    t = _cast_each(reader.read_many(dense_tensor_names(cfg), progress=progress), dtype, device)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        attention = AttentionWeights(
            q=t[a + "q_proj.weight"], k=t[a + "k_proj.weight"], v=t[a + "v_proj.weight"], o=t[a + "o_proj.weight"],
            q_bias=t.get(a + "q_proj.bias"), k_bias=t.get(a + "k_proj.bias"), v_bias=t.get(a + "v_proj.bias"),
            q_norm=t.get(a + "q_norm.weight"), k_norm=t.get(a + "k_norm.weight"),
        )
        layer = LayerWeights(
            input_norm=t[p + "input_layernorm.weight"],
            post_attention_norm=t[p + "post_attention_layernorm.weight"],
            attention=attention,
        )
        if cfg.is_moe_layer(i):
            layer.router = t[p + ("block_sparse_moe.gate.weight" if cfg.family == "mixtral" else "mlp.gate.weight")]
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
