"""The constants of the latency model (cluster/cost_model.py): hardware, transports and model shapes. Pure data and
arithmetic: no torch, no Ray.

Every published figure carries its source; every figure marked "estimate" is this project's guess, to be replaced
by a measurement when a GPU is lent. CPU constants come from `expertmesh bench dispatch` JSON (calibrate_cpu).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# ---- hardware --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HardwareProfile:
    """One device type and the host it sits in. Rates are peaks; *_eff the fraction a kernel reaches."""

    name: str
    mem_bw: float  # bytes/s, device memory (HBM) peak
    flops: float  # FLOP/s, dense bf16 peak (the CPU: fp32, fitted)
    memory_gib: float  # per device
    device_link_bw: float  # bytes/s one direction, device to device (NVLink); CPU: not used
    host_link_bw: float  # bytes/s one direction, device <-> host (PCIe); CPU: not used
    host_copy_bw: float  # bytes/s, one host memory copy (serialisation, socket buffers)
    mem_eff: float = 0.8  # estimate: decode GEMVs reach ~80 % of HBM peak
    flop_eff: float = 0.6  # estimate: small-batch GEMMs reach ~60 % of peak
    op_overhead_s: float = 0.0  # per eager kernel launch (PyTorch eager, no CUDA graphs)
    # One CUDA graph replay (experts/decode_graphs.py: one per MoE layer's dense segment and one for the last),
    # replacing that segment's eager launches at decode; None: no graphs (a CPU, or router.cuda_graphs off).
    graph_launch_s: float | None = None
    sync_s: float = 0.0  # one device -> host wait
    host_speed: float = 1.0  # the host's Python speed relative to the calibrated 2-core box
    concurrent: bool = True  # router and experts on separate devices (False: they share the same cores)
    cpu_parallelism: float = 1.0  # CPU only: cores' worth the expert actors get together (fitted)
    expert_flops_per_cpu_s: float = 0.0  # CPU only: the experts' FLOP per CPU-second (fitted)
    # CPU only: bytes/s an expert call streams its shard's weights at, a cost per call on top of the FLOP (fitted
    # from two batch sizes; inf when fitted from one: every CPU-second then scales with the FLOP)
    expert_read_bw: float = math.inf
    source: str = ""

    def roofline_s(self, flops: float, bytes_: float) -> float:
        """Time of work that reads `bytes_` and does `flops`: the slower of the two at achievable rates."""
        by_mem = bytes_ / (self.mem_bw * self.mem_eff) if math.isfinite(self.mem_bw) else 0.0
        return max(flops / (self.flops * self.flop_eff), by_mem)


# H100 SXM5 and H200 SXM: 989.5 dense bf16 TFLOP/s both; HBM3 3.35 TB/s (80 GB) vs HBM3e 4.8 TB/s (141 GB).
# NVIDIA datasheets, as tabulated in https://datacrunch.io/blog/deepseek-v3-llm-nvidia-h200-gpu-inference-benchmarking
# ("H100 SXM / H200 SXM: BFLOAT16 989.5 TFLOPS; GPU Memory Bandwidth 3.35 TB/s / 4.8 TB/s").
# NVLink 4: 900 GB/s per GPU, both directions together -> 450 GB/s one way (NVIDIA H100 datasheet,
# https://www.nvidia.com/en-us/data-center/h100/ "NVLink: 900GB/s"). PCIe Gen5 x16: 64 GB/s one way (PCI-SIG).
_HOPPER = dict(flops=989.5e12, device_link_bw=450e9, host_link_bw=64e9 * 0.8,  # 0.8: PCIe efficiency, estimate
               host_copy_bw=10e9,  # estimate: one pageable host memcpy of a few MB on a server core
               op_overhead_s=6e-6,  # estimate: PyTorch eager dispatch + launch per kernel
               graph_launch_s=10e-6,  # estimate: torch.cuda.CUDAGraph.replay (cudaGraphLaunch + Python) of ~50 nodes
               sync_s=15e-6,  # estimate: cudaStreamSynchronize + a small D2H read
               host_speed=2.0,  # estimate: a dedicated server core vs this shared 2-core box
               source="NVIDIA datasheet figures; efficiencies and overheads are estimates")
H100 = HardwareProfile(name="H100", mem_bw=3.35e12, memory_gib=80 * 1e9 / 2**30, **_HOPPER)
H200 = HardwareProfile(name="H200", mem_bw=4.8e12, memory_gib=141 * 1e9 / 2**30, **_HOPPER)
GPUS = {"H100": H100, "H200": H200}

# Ops per layer of the router's eager dense part (2 norms, q/k/v/o, rope, cache write, attend, gate, top-k,
# residuals): an estimate from reading experts/modeling.py, to be replaced by a profiler count on a GPU.
DENSE_OPS_PER_LAYER = 30
# With decode graphs, what still launches eagerly per MoE layer: the routing's copies out of graph memory (~5
# per-token fields) and the expert output's copy into the static buffer (experts/decode_graphs.py).
GRAPHED_EAGER_OPS_PER_MOE_LAYER = 6
GRAPH_MAX_BATCH = 256  # router.cuda_graph_max_batch's default: larger decode batches run eagerly
OPS_PER_EXPERT_CALL = 6  # gather rows, grouped gate/up, act, down, scale (estimate; + 3 per shard below)
OPS_PER_SHARD = 3

# The CPU: router and expert actors share its cores (concurrent False); the rates are fitted per machine by
# cluster/cost_calibration.py from `expertmesh bench dispatch`.
CPU_BASE = HardwareProfile(name="cpu", mem_bw=math.inf, flops=1e10, memory_gib=0.0, device_link_bw=math.inf,
                           host_link_bw=math.inf, host_copy_bw=math.inf, mem_eff=1.0, flop_eff=1.0, concurrent=False,
                           expert_flops_per_cpu_s=1e10, source="placeholder rates; fitted by cost_calibration")


def gpu_profile(device_name: str) -> HardwareProfile | None:
    """The profile of a GPU from torch.cuda.get_device_name (e.g. "NVIDIA H100 80GB HBM3"); None when unknown."""
    name = device_name.upper()
    for key in sorted(GPUS, key=len, reverse=True):
        if key in name:
            return GPUS[key]
    return None


# ---- transports ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransportProfile:
    """One expert round = call_s (the first call's round trip) + issue_s per further call (the router's serial work
    per call) + syncs device waits + the bytes: through the host (PCIe down, host_copies memcpys, PCIe up) or
    device to device."""

    name: str
    call_s: float
    issue_s: float
    host_copies: int  # host memcpys per direction (serialise / object store / socket buffer)
    device_direct: bool  # rows go device to device (NVLink), no host copy
    syncs: int = 1  # device -> host waits per round (README: one wait per MoE layer)
    source: str = ""


# Empty expert rounds measured on this project's 2-core box, 8 actors, all calls in flight
# (`expertmesh bench dispatch`, transport_round_ms): refs 9.3 ms, grpc 8.664 ms, compiled 3.965 ms
# (docs/benchmarks/results/bench/dispatch_final*.json), socket 0.243 ms (docs/benchmarks/results/bench/
# cost_model/calibration.json). Per call that is an upper bound of the router's serial cost (the 8 actors' side of
# each call shares the same 2 cores), so the GPU node's issue costs below are estimates under it.
MEASURED_EMPTY_ROUND_S = {"refs": 9.3e-3, "grpc": 8.664e-3, "compiled": 3.965e-3, "socket": 0.243e-3}
MEASURED_ACTORS = 8
# rdt as built (Ray Direct Transport over NIXL, router_service/transports/rdt.py): a classic Ray actor call carries
# each call, and Ray's RDT adds its own work around it: a put on each side (serialising the object, registering it
# with its owner), a metadata fetch and a polled one-sided read on each side (Ray polls a read every 1 ms). Measured
# on this 2-core box, one call of 8 rows to one actor, alone in flight (`expertmesh bench dispatch --transport rdt`,
# one_call_ms; docs/benchmarks/results/bench/dispatch_rdt_one_call.json): 14.4 ms against 8.5 ms for a plain Ray call
# carrying the same rows inline, 5.96 ms more. That extra is host work, taken at a server core's host speed (2).
RDT_MEASURED_EXTRA_S = 5.96e-3
GPU_NODE_HOST_SPEED = _HOPPER["host_speed"]
# The router's put of a call's rows, ~1.3 ms of its CPU here (profiled), is serial per further call.
RDT_PUT_S = 1.3e-3
# estimate: the router's serial work per further call on a server core (submit / serialise / write)
ISSUE_S = {"refs": 100e-6, "grpc": 50e-6, "compiled": 20e-6, "socket": 10e-6,
           "rdt": 100e-6 + RDT_PUT_S / GPU_NODE_HOST_SPEED}


def gpu_transports() -> dict[str, TransportProfile]:
    """The transports on a GPU node: first-call latency from published figures or estimates, issue cost per
    further call estimated (ISSUE_S)."""
    issue = ISSUE_S
    return {
        # Ray docs, Compiled Graph quickstart (https://docs.ray.io/en/latest/ray-core/compiled-graph/quickstart.html):
        # a classic actor call "Execution takes 969.0364822745323 us"; the compiled graph of the same call ~87 us
        # (project issue #26 quotes both).
        "refs": TransportProfile("refs", 969e-6, issue["refs"], host_copies=2, device_direct=False,
                                 source="Ray docs: classic actor call 969 us"),
        "compiled": TransportProfile("compiled", 87e-6, issue["compiled"], host_copies=1, device_direct=False,
                                     source="Ray docs: Compiled Graph call ~87 us"),
        # estimates: a Python gRPC unary call on one host ~200 us; the authenticated socket ~ its measured per-call
        # cost here (30 us) plus the expert's side, 60 us.
        "grpc": TransportProfile("grpc", 200e-6, issue["grpc"], host_copies=2, device_direct=False,
                                 source="estimate"),
        "socket": TransportProfile("socket", 60e-6, issue["socket"], host_copies=1, device_direct=False,
                                   source="estimate"),
        # rdt: rows stay on the devices (NVLink), but each call is a classic Ray call plus Ray's RDT work (above).
        "rdt": TransportProfile("rdt", 969e-6 + RDT_MEASURED_EXTRA_S / GPU_NODE_HOST_SPEED, issue["rdt"],
                                host_copies=0, device_direct=True,
                                source="Ray docs: classic actor call 969 us + RDT's per-call work measured here / 2"),
    }


TRANSPORTS = tuple(gpu_transports())

# Published per-layer dispatch + combine of specialised one-sided EP kernels (not expertmesh transports; the yardstick
# the 150 us target is set against). Figures as quoted in project issue #26:
PUBLISHED_ROUND_US = {
    # TensorRT-LLM one-sided all-to-all on GB200 NVL72, dispatch + combine ~50 us
    "TensorRT-LLM one-sided (GB200)": 50,
    # pplx-kernels (https://github.com/ppl-ai/pplx-kernels) on H100 NVLink, dispatch + combine ~83 us
    "pplx-kernels (H100 NVLink)": 83,
    # DeepEP low-latency kernels (https://github.com/deepseek-ai/DeepEP README): dispatch 77 us at 8 EP ranks up to
    # 194 us at 256 (H800, RDMA)
    "DeepEP low-latency (H800)": "77-194",
}

# ---- model shapes ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the latency model needs of a model. Field names follow experts/config.py's MoEModelConfig, so a parsed
    config converts with shape_from_config."""

    name: str
    hidden_size: int
    num_layers: int
    moe_layer_count: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dense_intermediate_size: int = 0  # the MLP of layers without experts
    shared_expert_intermediate_size: int = 0
    attention_kind: str = "gqa"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def attention_params(self) -> int:
        h = self.hidden_size
        if self.attention_kind == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * self.num_heads * qk) if self.q_lora_rank else \
                h * self.num_heads * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + \
                self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + self.num_heads * self.v_head_dim * h
        q = self.num_heads * self.head_dim
        return h * q * 2 + h * self.num_kv_heads * self.head_dim * 2

    @property
    def kv_elems_per_token(self) -> int:
        """Per layer: MLA's latent + rope key, or GQA's keys and values."""
        if self.attention_kind == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def attention_width(self) -> int:
        """Per head dims a decode token multiplies against each cached position (q.k and p.v together)."""
        if self.attention_kind == "mla":  # absorbed MLA attends in the latent space
            return self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return self.num_heads * self.head_dim * 2

    @property
    def shard_params(self) -> int:
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def dense_layer_count(self) -> int:
        return self.num_layers - self.moe_layer_count


# Shapes from each model's config.json on the Hugging Face Hub:
#   https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json
#   https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
#   https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (first_k_dense_replace 3, 1 shared expert)
MODELS: dict[str, ModelShape] = {
    "mixtral-8x7b": ModelShape("Mixtral-8x7B", 4096, 32, 32, 8, 2, 14336, 32, 8, 128, 32000),
    "qwen3-30b-a3b": ModelShape("Qwen3-30B-A3B", 2048, 48, 48, 128, 8, 768, 32, 4, 128, 151936),
    "deepseek-v3": ModelShape("DeepSeek-V3", 7168, 61, 58, 256, 8, 2048, 128, 128, 128, 129280,
                              dense_intermediate_size=18432, shared_expert_intermediate_size=2048,
                              attention_kind="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                              qk_rope_head_dim=64, v_head_dim=128),
}
# Hub repo ids that name a table entry (so `plan-cluster --latency --model mistralai/Mixtral-8x7B-v0.1` needs no
# network for the latency part).
MODEL_ALIASES = {"mistralai/mixtral-8x7b-v0.1": "mixtral-8x7b", "mistralai/mixtral-8x7b-instruct-v0.1":
                 "mixtral-8x7b", "qwen/qwen3-30b-a3b": "qwen3-30b-a3b", "deepseek-ai/deepseek-v3": "deepseek-v3",
                 "deepseek-ai/deepseek-v3-0324": "deepseek-v3", "deepseek-ai/deepseek-r1": "deepseek-v3"}


def known_model(name: str) -> ModelShape | None:
    key = name.lower()
    return MODELS.get(MODEL_ALIASES.get(key, key))


def shape_from_config(cfg, name: str = "") -> ModelShape:
    """A MoEModelConfig (experts/config.py) as a ModelShape; read by attribute, so this module imports nothing."""
    return ModelShape(
        name=name or cfg.family, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        moe_layer_count=len(cfg.moe_layers), num_experts=cfg.num_experts, top_k=cfg.top_k,
        expert_intermediate_size=cfg.expert_intermediate_size, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        dense_intermediate_size=cfg.dense_intermediate_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, attention_kind=cfg.attention_kind,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim)


def bench_shape(model: dict) -> ModelShape:
    """The synthetic Mixtral of `expertmesh bench dispatch` (its JSON's "model" dict: ops/bench/checkpoints.py)."""
    return ModelShape("bench-mixtral", model["hidden"], model["layers"], model["layers"], model["experts"],
                      model["top_k"], model["inter"], model["heads"], model["kv_heads"],
                      model["hidden"] // model["heads"], model["vocab"])


# ---- the CPU, fitted from `expertmesh bench dispatch` ----------------------------------------------------------

# Router planning + marshalling + combine per MoE layer on this 2-core box (`expertmesh bench dispatch-overhead`,
# docs/benchmarks/dispatch.md: 0.55 ms for 8 experts / top-2 at 64 tokens (128 slots, 8 calls); 1.20 ms for 256 /
# top-8 at 64 tokens (512 slots, one call)): fitted a + b * slots + c * calls.
PLAN_FIXED_S = 0.2e-3
PLAN_PER_SLOT_S = 2e-6
PLAN_PER_CALL_S = 12e-6
