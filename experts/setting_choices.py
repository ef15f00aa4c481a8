"""The values that string settings of the configuration tree may take, in a module that imports nothing.

The configuration (router_service/config.py), the CLI's `choices=` (ops/commands/mesh_flags.py) and the modules that
act on a setting (experts/dtypes.py, experts/quant.py, router_service/prefetch.py) all read the names from here, so
checking a configuration never imports torch just to learn which names are allowed.
"""

from __future__ import annotations

# model.dtype: weights and activations (experts/dtypes.py resolves "auto" per process).
DTYPE_NAMES = ("bfloat16", "float16", "float32")
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)

# experts.quant: routed experts' weights in model.dtype, int8 per output channel, or int4 in groups (experts/quant.py).
QUANT_MODES = ("none", "int8", "int4")

# experts.prefetch: predicting the next MoE layer's experts (router_service/prefetch.py); "auto": gate with a memory
# budget, else off (ExpertsConfig.prefetch_mode).
PREFETCH_MODES = ("off", "gate", "history")
PREFETCH_SETTINGS = ("auto", *PREFETCH_MODES)

# experts.eviction: the order in which an actor's device tier gives shards back (experts/eviction.py).
EVICTION_POLICIES = ("lru", "lfru", "arc", "layer-cycle")
