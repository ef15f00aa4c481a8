"""One validated description of an MoE checkpoint, read from its Hugging Face `config.json`.

The families share one decoder shape (RMSNorm, RoPE attention with GQA, gated experts) and differ in a handful of
switches, so one dataclass with those switches is clearer than one model class per family.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .config_deepseek import ARCHITECTURES as _DEEPSEEK_ARCHITECTURES
from .config_deepseek import FAMILIES as _DEEPSEEK_FAMILIES
from .config_deepseek import MLA_FAMILIES as _MLA_FAMILIES
from .config_deepseek import MODEL_TYPES as _DEEPSEEK_MODEL_TYPES
from .config_deepseek import YarnScaling, deepseek_family_fields, rope_settings
from .config_ernie4_5_moe import ARCHITECTURES as _ERNIE_ARCHITECTURES
from .config_ernie4_5_moe import MODEL_TYPES as _ERNIE_MODEL_TYPES
from .config_ernie4_5_moe import ernie4_5_moe_fields
from .config_ernie4_5_moe import normalise as _ernie_normalise
from .config_hunyuan_v1_moe import ARCHITECTURES as _HUNYUAN_ARCHITECTURES
from .config_hunyuan_v1_moe import MODEL_TYPES as _HUNYUAN_MODEL_TYPES
from .config_hunyuan_v1_moe import hunyuan_v1_moe_fields
from .config_hunyuan_v1_moe import normalise as _hunyuan_normalise
from .config_kimi_linear import ARCHITECTURES as _KIMI_ARCHITECTURES
from .config_kimi_linear import MODEL_TYPES as _KIMI_MODEL_TYPES
from .config_kimi_linear import kimi_linear_fields
from .config_kimi_linear import normalise as _kimi_normalise
from .config_llama4 import ARCHITECTURES as _LLAMA4_ARCHITECTURES
from .config_llama4 import MODEL_TYPES as _LLAMA4_MODEL_TYPES
from .config_llama4 import Llama3Scaling, llama4_fields
from .config_llama4 import normalise as _llama4_normalise
from .config_longcat_flash import ARCHITECTURES as _LONGCAT_ARCHITECTURES
from .config_longcat_flash import MODEL_TYPES as _LONGCAT_MODEL_TYPES
from .config_longcat_flash import longcat_flash_fields
from .config_longcat_flash import normalise as _longcat_normalise
from .config_mimo_v2_flash import ARCHITECTURES as _MIMO_ARCHITECTURES
from .config_mimo_v2_flash import MODEL_TYPES as _MIMO_MODEL_TYPES
from .config_mimo_v2_flash import mimo_v2_flash_fields
from .config_mimo_v2_flash import normalise as _mimo_normalise
from .config_minimax_m2 import ARCHITECTURES as _MINIMAX_ARCHITECTURES
from .config_minimax_m2 import MODEL_TYPES as _MINIMAX_MODEL_TYPES
from .config_minimax_m2 import minimax_m2_fields
from .config_minimax_m2 import normalise as _minimax_normalise
from .config_qwen3_next import ARCHITECTURES as _QWEN3_NEXT_ARCHITECTURES
from .config_qwen3_next import MODEL_TYPES as _QWEN3_NEXT_MODEL_TYPES
from .config_qwen3_next import GatedDeltaDims, qwen3_5_moe_family_fields, qwen3_next_family_fields
from .config_qwen3_next import normalise as _qwen3_next_normalise
from .errors import CheckpointError

# HF architecture name -> our family name.
ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "OlmoeForCausalLM": "olmoe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
} | _DEEPSEEK_ARCHITECTURES | _MINIMAX_ARCHITECTURES | _ERNIE_ARCHITECTURES | _HUNYUAN_ARCHITECTURES \
    | _LLAMA4_ARCHITECTURES | _MIMO_ARCHITECTURES | _QWEN3_NEXT_ARCHITECTURES | _LONGCAT_ARCHITECTURES \
    | _KIMI_ARCHITECTURES
MODEL_TYPES = {"mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "olmoe": "olmoe", "qwen3_moe": "qwen3_moe",
               "gpt_oss": "gpt_oss"} | _DEEPSEEK_MODEL_TYPES | _MINIMAX_MODEL_TYPES | _ERNIE_MODEL_TYPES \
    | _HUNYUAN_MODEL_TYPES | _LLAMA4_MODEL_TYPES | _MIMO_MODEL_TYPES | _QWEN3_NEXT_MODEL_TYPES | _LONGCAT_MODEL_TYPES \
    | _KIMI_MODEL_TYPES
# Families parsed in their own module (experts/config_<family>.py): family -> (normalise, fields). normalise maps the
# family's key names onto the common ones; fields returns the MoEModelConfig arguments beyond the common ones,
# RoPE included (the common rope parsing is skipped for them).
OWN_FAMILIES = {
    "minimax_m2": (_minimax_normalise, minimax_m2_fields),
    "ernie4_5_moe": (_ernie_normalise, ernie4_5_moe_fields),
    "hunyuan_v1_moe": (_hunyuan_normalise, hunyuan_v1_moe_fields),
    "llama4": (_llama4_normalise, llama4_fields),
    "mimo_v2_flash": (_mimo_normalise, mimo_v2_flash_fields),
    "qwen3_next": (_qwen3_next_normalise, qwen3_next_family_fields),
    "qwen3_5_moe": (_qwen3_next_normalise, qwen3_5_moe_family_fields),
    "longcat_flash": (_longcat_normalise, longcat_flash_fields),
    "kimi_linear": (_kimi_normalise, kimi_linear_fields),
}
_OWN_ROPE = (*_DEEPSEEK_FAMILIES, *OWN_FAMILIES)
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu")
# family -> quant_method values we dequantise on load
SUPPORTED_QUANTIZATION = {"gpt_oss": ("mxfp4",)} | {family: ("fp8",)
                                                     for family in (*_DEEPSEEK_FAMILIES, "minimax_m2", "mimo_v2_flash")}


@dataclass(frozen=True)
class MoEModelConfig:
    family: str  # a value of MODEL_TYPES: "mixtral", "qwen2_moe", .., "ernie4_5_moe", "hunyuan_v1_moe", "llama4"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k gate weights to sum to 1
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2-MoE: q/k/v projections carry a bias
    qk_norm: bool = False  # OLMoE: RMSNorm over the projected q and k
    clip_qkv: float | None = None  # OLMoE
    sliding_window: int | None = None  # Mixtral / Qwen2-MoE layers marked "sliding_attention"
    sliding_layers: tuple[int, ...] = ()
    # Qwen2-MoE only
    dense_intermediate_size: int = 0  # MLP size of the non-sparse layers
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = field(default=())  # layers with a sparse MoE block; others are dense MLP
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # ---- DeepSeek-V2/V3 and GLM-4.5 (parsed in experts/config_deepseek.py) -------------------------------------
    attention_kind: str = "gqa"  # "gqa" | "mla" (DeepSeek Multi-head Latent Attention)
    q_lora_rank: int | None = None  # MLA: None = one q_proj; else q_a_proj -> RMSNorm -> q_b_proj
    kv_lora_rank: int = 0  # MLA: width of the compressed key/value latent
    qk_nope_head_dim: int = 0  # MLA: per-head query/key dims without RoPE
    qk_rope_head_dim: int = 0  # MLA: per-head query/key dims with RoPE (the key part is shared by all heads)
    v_head_dim: int = 0  # MLA; MiMo-V2-Flash (GQA whose values are narrower than q/k)
    rotary_dim: int = 0  # dims of a head that RoPE rotates; 0 = head_dim (GLM: head_dim * partial_rotary_factor)
    rope_pairs_interleaved: bool = False  # DeepSeek: RoPE rotates (x0,x1),(x2,x3),.. pairs, not the two halves
    yarn: YarnScaling | None = None  # rope_type "yarn" (cos/sin scaled; MLA's softmax scale takes mscale too)
    # "softmax" (route) | "deepseek_v2" | "sigmoid_grouped" (DeepSeek-V3, GLM-4.5, MiniMax-M2) | "topk_softmax"
    # (gpt-oss) | "softmax_biased" (ERNIE 4.5) | "sigmoid_input" (Llama 4)
    router_kind: str = "softmax"
    topk_method: str = "greedy"  # deepseek_v2: "greedy" | "group_limited_greedy"
    n_group: int = 1  # group-limited routing: experts split into n_group equal groups ...
    topk_group: int = 1  # ... and each token picks its experts from its best topk_group groups
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' combine weights
    router_correction_bias: bool = False  # sigmoid_grouped: mlp.gate.e_score_correction_bias (selection only)
    shared_expert_gated: bool = True  # Qwen2-MoE's shared expert has a sigmoid gate; DeepSeek/GLM's have none
    qk_norm_per_head: bool = False  # GLM-4.5 use_qk_norm: RMSNorm over each head's q and k (head_dim weights)
    fp8_block: tuple[int, int] | None = None  # quant_method "fp8": weights stored e4m3 with per-block scale_inv
    # ---- DeepSeek-V3.2 and GLM-5: DeepSeek Sparse Attention's lightning indexer (experts/dsa_indexer.py) ----
    index_n_heads: int = 0  # 0 = no indexer (plain MLA)
    index_head_dim: int = 0  # width of its queries and of the key it caches per token
    index_topk: int = 0  # past tokens each query attends (of those its causal mask allows)
    index_shared_layers: tuple[int, ...] = ()  # GLM-5: layers without an indexer, reusing the previous top-k
    index_rope_interleaved: bool = False  # GLM-5: the indexer rotates (x0,x1).. pairs; V3.2: the two halves
    # ---- MiniMax-M2, ERNIE 4.5 MoE, Hunyuan-A13B (experts/config_<family>.py) ----
    router_in_model_dtype: bool = False  # MiniMax-M2: the sigmoid router's gate runs in the model dtype, not float32
    router_norm_min: float = 0.0  # ERNIE ("softmax_biased"): the top-k weights are divided by max(sum, this)
    qk_norm_after_rope: bool = False  # Hunyuan: the per-head q/k RMSNorm runs after RoPE, not before
    # ---- Llama 4 (experts/config_llama4.py; router_kind "sigmoid_input": the score scales the expert input) ----
    # Llama 4: before every tensor name ("language_model." in the multimodal wrapper checkpoint); Qwen3-Next /
    # Qwen3.5: the text model's prefix ("model.", or "model.language_model." in the VL wrapper; lm_head has none)
    weight_prefix: str = ""
    nope_layers: tuple[int, ...] = ()  # layers without RoPE (Llama 4's global layers)
    chunked_layers: tuple[int, ...] = ()  # layers whose queries see only the keys of their own chunk ...
    attention_chunk_size: int | None = None  # ... of this many tokens (positions c*size .. (c+1)*size - 1)
    qk_l2_norm: bool = False  # a weightless RMS norm of q and k after RoPE, on RoPE layers
    attn_temperature: tuple[float, float] | None = None  # NoPE layers' query scale: (floor_scale, attn_scale)
    llama3_rope: Llama3Scaling | None = None  # rope_type "llama3"
    # ---- MiMo-V2-Flash (experts/config_mimo_v2_flash.py; also v_head_dim, rotary_dim, sliding_*, sinks) ----
    sliding_rope_theta: float | None = None  # the sliding layers' RoPE base (None: rope_theta)
    sliding_kv_heads: int = 0  # the sliding layers' KV heads (0: num_kv_heads); the full layers have num_kv_heads
    attention_value_scale: float = 1.0  # values are multiplied by this before they are cached
    # ---- Qwen3-Next / Qwen3.5-MoE (experts/config_qwen3_next.py; also rotary_dim, qk_norm_per_head) ----
    linear_layers: tuple[int, ...] = ()  # Gated DeltaNet layers: a per-sequence state instead of a KV history
    gated_delta: GatedDeltaDims | None = None  # their shape
    norm_unit_offset: bool = False  # RMSNorm weights stored as offsets from 1: x_normed * (1 + w)
    attn_output_gate: bool = False  # q_proj packs a per-head sigmoid gate on the attention output
    # ---- LongCat-Flash (experts/config_longcat_flash.py; router_kind "softmax_scaled", MLA) ----
    zero_experts: int = 0  # identity experts, ids num_experts.. num_experts+zero_experts-1: output = weight x input
    shortcut_moe: bool = False  # the MoE of sublayer i runs beside it and is added after sublayer i+1's dense MLP
    mla_lora_scale: bool = False  # q x sqrt(H / q_lora_rank), the KV latent x sqrt(H / kv_lora_rank)
    # ---- Kimi-Linear (experts/config_kimi_linear.py: KDA in linear_layers / gated_delta, MLA, DeepSeek-V3 router) --
    mla_rope: bool = True  # False: MLA's qk_rope_head_dim part is not rotated (Kimi-Linear's MLA is NoPE)
    # ---- end DeepSeek-V2/V3 and GLM-4.5 ------------------------------------------------------------------------
    # ---- Qwen3-MoE and gpt-oss (issue 13 items 2-3; they also use qk_norm_per_head, yarn, router_kind) ----
    attention_sinks: bool = False  # gpt-oss: a learned per-head extra logit in the attention softmax
    attention_out_bias: bool = False  # gpt-oss: o_proj carries a bias
    router_bias: bool = False  # gpt-oss: the router linear carries a bias
    expert_activation: str = "gated"  # "gated" (act(gate)·up) | "clamped_swiglu" (gpt-oss)
    swiglu_alpha: float = 1.702  # gpt-oss clamped SwiGLU: gate·σ(alpha·gate)·(up+1)
    swiglu_limit: float = 7.0  # gpt-oss: gate clamped to ≤ limit, up to ±limit
    quantization: str | None = None  # quantization_config.quant_method of the expert tensors ("mxfp4")
    # ---- end of the Qwen3-MoE / gpt-oss block ----

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def is_linear_layer(self, layer: int) -> bool:
        """Whether layer `layer` is a Gated DeltaNet or Kimi's KDA (no KV cache; a per-sequence state,
        experts/state_cache.py)."""
        return layer in self.linear_layers

    def has_indexer(self, layer: int) -> bool:
        """Whether layer `layer` runs a DSA lightning indexer (and caches its key per token)."""
        return self.index_n_heads > 0 and layer not in self.index_shared_layers

    @property
    def router_width(self) -> int:
        """Columns of the router's logits: the real experts, then LongCat's identity experts."""
        return self.num_experts + self.zero_experts

    def kv_heads(self, layer: int) -> int:
        """The KV heads of GQA layer `layer` (MiMo-V2-Flash's sliding layers have more than its full ones)."""
        return self.sliding_kv_heads if self.sliding_kv_heads and layer in self.sliding_layers else self.num_kv_heads

    @property
    def has_shared_expert(self) -> bool:
        return (self.family in ("qwen2_moe", *_DEEPSEEK_FAMILIES, "ernie4_5_moe", "hunyuan_v1_moe", "llama4",
                                "qwen3_next", "qwen3_5_moe", "kimi_linear")
                and self.shared_expert_intermediate_size > 0)

    def expert_param_count(self) -> int:
        """Parameters of one expert FFN (gate, up, down, and gpt-oss's biases)."""
        biases = 2 * self.expert_intermediate_size + self.hidden_size if self.family == "gpt_oss" else 0
        return 3 * self.hidden_size * self.expert_intermediate_size + biases


def load_model_config(model_dir: str | Path) -> MoEModelConfig:
    """Read and validate `config.json`; the error names the file and the offending key."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no config.json in the model folder")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    return config_from_dict(raw, source=str(path))


def config_from_dict(raw: dict, source: str = "config.json") -> MoEModelConfig:
    family = _family(raw, source)
    if family in OWN_FAMILIES:
        raw = OWN_FAMILIES[family][0](raw, source)

    def need(key: str, kind: type = int):
        if key not in raw or raw[key] is None:
            raise CheckpointError(f"{source}: missing key '{key}' required for {family}")
        value = raw[key]
        if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise CheckpointError(f"{source}: key '{key}' must be a positive integer, got {value!r}")
        return value

    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    layers = need("num_hidden_layers")
    mla = family in _MLA_FAMILIES  # MLA: num_key_value_heads and head_dim do not apply
    kv_heads = heads if mla else raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or hidden // heads
    if heads % kv_heads:
        raise CheckpointError(
            f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    act = raw.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise CheckpointError(
            f"{source}: key 'hidden_act'={act!r} is not supported (use one of {SUPPORTED_ACTIVATIONS})"
        )

    common = dict(
        family=family,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        top_k=need("num_experts_per_tok"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=0.0 if family in _OWN_ROPE else _rope_theta(raw, source),  # theirs: their config module
        yarn=None if family in _OWN_ROPE else rope_settings(raw, source)[2],
        quantization=_quantization(raw, family, source),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        hidden_act=act,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=_single_id(raw.get("bos_token_id")),
        eos_token_id=_single_id(raw.get("eos_token_id")),
    )
    all_layers = tuple(range(layers))
    if family == "mixtral":
        cfg = MoEModelConfig(
            **common,
            num_experts=need("num_local_experts"),
            expert_intermediate_size=need("intermediate_size"),
            norm_topk_prob=True,
            sliding_window=raw.get("sliding_window"),
            sliding_layers=all_layers if raw.get("sliding_window") else (),
            moe_layers=all_layers,
        )
    elif family == "qwen2_moe":
        experts = need("num_experts")
        moe_layers = _sparse_layers(raw, layers, experts)
        layer_types = raw.get("layer_types") or []
        sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        cfg = MoEModelConfig(
            **common,
            num_experts=experts,
            expert_intermediate_size=need("moe_intermediate_size"),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            attention_bias=bool(raw.get("qkv_bias", True)),
            sliding_window=raw.get("sliding_window") if sliding else None,
            sliding_layers=sliding,
            dense_intermediate_size=int(raw.get("intermediate_size") or 0),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
            moe_layers=moe_layers,
        )
    elif family == "qwen3_moe":
        experts = raw.get("num_experts") or raw.get("num_local_experts") or need("num_experts")
        cfg = MoEModelConfig(
            **common,
            num_experts=experts,
            expert_intermediate_size=need("moe_intermediate_size"),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            qk_norm_per_head=True,
            dense_intermediate_size=int(raw.get("intermediate_size") or 0),
            moe_layers=_sparse_layers(raw, layers, experts),
            # transformers applies the window to every layer when use_sliding_window is on
            sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window") else None,
            sliding_layers=all_layers if raw.get("use_sliding_window") and raw.get("sliding_window") else (),
        )
    elif family == "gpt_oss":
        layer_types = raw.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
        ]  # transformers' default: alternate, starting with a sliding layer
        sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        cfg = MoEModelConfig(
            **common,
            num_experts=raw.get("num_local_experts") or need("num_experts"),
            expert_intermediate_size=need("intermediate_size"),
            norm_topk_prob=True,  # the softmax runs over the k selected logits: the weights sum to 1
            attention_bias=bool(raw.get("attention_bias", True)),
            attention_out_bias=bool(raw.get("attention_bias", True)),
            attention_sinks=True,
            router_bias=True,
            router_kind="topk_softmax",
            expert_activation="clamped_swiglu",
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
            sliding_window=raw.get("sliding_window", 128) if sliding else None,
            sliding_layers=sliding,
            moe_layers=all_layers,
        )
    elif family in _DEEPSEEK_FAMILIES:
        cfg = MoEModelConfig(**(common | deepseek_family_fields(family, raw, common, need, source)),
                             fp8_block=_fp8_block(raw, source))
    elif family in OWN_FAMILIES:
        fields = OWN_FAMILIES[family][1](raw, common, need, source)
        fp8 = family in ("minimax_m2", "mimo_v2_flash")
        cfg = MoEModelConfig(**(common | fields), fp8_block=_fp8_block(raw, source) if fp8 else None)
    else:  # olmoe
        cfg = MoEModelConfig(
            **common,
            num_experts=need("num_experts"),
            expert_intermediate_size=need("intermediate_size"),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            qk_norm=True,
            clip_qkv=raw.get("clip_qkv"),
            moe_layers=all_layers,
        )
    if cfg.top_k > cfg.num_experts + cfg.zero_experts:
        raise CheckpointError(
            f"{source}: num_experts_per_tok={cfg.top_k} exceeds the number of experts ({cfg.num_experts})"
        )
    dense_layers = len(cfg.moe_layers) < cfg.num_layers
    if cfg.family in ("qwen2_moe", "qwen3_moe") and dense_layers and cfg.dense_intermediate_size <= 0:
        raise CheckpointError(f"{source}: key 'intermediate_size' is needed for the dense (mlp_only) layers")
    return cfg


def _fp8_block(raw: dict, source: str) -> tuple[int, int] | None:
    """quantization_config of a block-scaled FP8 checkpoint (DeepSeek-V3's published format) -> its block."""
    quant = raw.get("quantization_config")
    if not quant:
        return None
    if quant.get("quant_method") != "fp8":
        raise CheckpointError(f"{source}: key 'quantization_config.quant_method'={quant.get('quant_method')!r} "
                              "is not supported (supported: 'fp8' with weight_block_size)")
    block = quant.get("weight_block_size") or [128, 128]
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise CheckpointError(f"{source}: key 'quantization_config.weight_block_size'={block!r} must be two "
                              "positive integers")
    return (block[0], block[1])


def _family(raw: dict, source: str) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    model_type = raw.get("model_type")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise CheckpointError(
        f"{source}: unsupported architecture {archs or model_type!r} (key 'architectures'); "
        f"supported: {sorted(ARCHITECTURES)}"
    )


def _sparse_layers(raw: dict, layers: int, experts: int) -> tuple[int, ...]:
    """Qwen2/3-MoE: a layer is sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
    step = raw.get("decoder_sparse_step", 1) or 1
    mlp_only = set(raw.get("mlp_only_layers") or [])
    return tuple(i for i in range(layers) if i not in mlp_only and experts > 0 and (i + 1) % step == 0)


def _rope_theta(raw: dict, source: str) -> float:
    """rope_theta; a RoPE type other than default and yarn is refused (rope_settings names the key)."""
    return rope_settings(raw, source)[0]


def _quantization(raw: dict, family: str, source: str) -> str | None:
    quant = raw.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method not in SUPPORTED_QUANTIZATION.get(family, ()):
        raise CheckpointError(
            f"{source}: key 'quantization_config.quant_method'={method!r} is not supported for {family} "
            f"(supported: {SUPPORTED_QUANTIZATION.get(family, ())})"
        )
    return method


def _single_id(value) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value
