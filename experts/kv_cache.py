"""The paged KV cache: preallocated blocks of `block_size` tokens, a block table per sequence.

What a layer stores per token is its attention layer's `cache_spec` (name -> per-token shape): GQA stores
{"k": (kvh, D), "v": (kvh, D)}, DeepSeek's MLA one latent {"latent": (r + d_rope,)}. The pool holds, per layer and
per entry name, one tensor [num_blocks, block_size, *shape] allocated once on the device of the dense weights (a
block is zeroed when handed out); a sequence (`KVCache`) owns a list of block ids, the same for every layer, and its
length. Writing a step's new tokens is one `index_copy_` per layer and entry into the flat slots
(block * block_size + offset) of the step's tokens; reading is one gather of the blocks of the step's sequences
(`gather`), padded to the longest, with the lengths.

Cost of the read (README: Paged KV cache): on CPU the gather copies each attending sequence's history once per
layer per step (L × bytes-per-token-per-layer), where the old per-sequence cache copied it twice (`torch.cat` to
grow it, `pad_sequence` to batch it) and reallocated every step. A kernel that reads the blocks in place
(PagedAttention, flex attention with a block mask) would avoid the copy; torch's SDPA needs dense keys.

Sliding-window layers keep their full history (no block is freed early): a window only masks keys out.

Prefix caching (README: Prefix caching): with `prefix_root` set, a sequence's full blocks are registered under their
hash-chain keys (experts/prefix_cache.py) once written (`commit`), and a new sequence starts from the cached blocks
of its longest cached prefix (`lookup_prefix` / `adopt`), sharing them read-only: shared blocks are always full, and
a sequence only writes at positions >= its length, so no block is ever written by two sequences (no copy-on-write).
Because windowed layers keep every block, a cached block serves sliding-window, sink and MLA layers alike.

Sizing: `PagedKVPool.plan(...)` turns a byte budget into a number of blocks; the pool never holds more than
`max_tokens` tokens (so tiny models do not reserve gigabytes). On CPU, `torch.empty` of a large pool reserves address
space and the OS backs pages as blocks are first written, so resident memory grows with use up to the budget.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from .block_allocator import BlockAllocator, OutOfBlocks, blocks_for
from .device_rule import tensor_on
from .prefix_cache import block_keys, reusable_blocks, root_key
from .state_cache import OutOfStateSlots, StatePool, StateShapes, state_bytes_per_sequence

__all__ = ["KVCache", "PagedKVPool", "KVCacheSettings", "OutOfBlocks", "DEFAULT_CPU_KV_BYTES", "PrefixHit",
           "blocks_for", "settings_for"]

DEFAULT_CPU_KV_BYTES = 2 << 30  # 2 GiB: the pool on CPU when no budget is given (README: Paged KV cache)
DEFAULT_MAX_SEQUENCES = 64  # with no explicit token cap, the pool holds at most this many full-context sequences

CacheSpec = dict[str, tuple[int, ...]]  # entry name -> per-token shape


@dataclass(frozen=True)
class KVCacheSettings:
    """How big the pool is. budget_bytes None: DEFAULT_CPU_KV_BYTES; max_tokens None: DEFAULT_MAX_SEQUENCES ×
    the model's context."""

    block_size: int = 16
    budget_bytes: int | None = None
    max_tokens: int | None = None
    prefix_caching: bool = True  # share full blocks between sequences by content (README: Prefix caching)
    # Linear-attention models (experts/state_cache.py): sequences that can hold a state at once; None:
    # DEFAULT_MAX_SEQUENCES. Their bytes come out of budget_bytes.
    state_slots: int | None = None


def settings_for(device: torch.device | str, kv_cache_gb: float | None, gpu_memory_utilization: float,
                 block_size: int = 16, prefix_caching: bool = True, state_slots: int | None = None) -> KVCacheSettings:
    """The pool's size on `device` (README: Paged KV cache): kv_cache_gb when given (exactly, no token cap); else on
    CUDA what keeps the process within gpu_memory_utilization of the GPU's memory (call it after the weights are
    loaded: free now - (1 - utilization) × total); else DEFAULT_CPU_KV_BYTES capped at DEFAULT_MAX_SEQUENCES full
    contexts. state_slots: sequences that can hold a linear-attention state at once (their bytes come out of the
    budget; None: DEFAULT_MAX_SEQUENCES)."""
    device = torch.device(device)
    if kv_cache_gb is not None:
        return KVCacheSettings(block_size, int(kv_cache_gb * (1 << 30)), max_tokens=1 << 62,
                               prefix_caching=prefix_caching, state_slots=state_slots)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - (1.0 - gpu_memory_utilization) * total)
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization: {gpu_memory_utilization} of {total / 2**30:.1f} GiB leaves "
                             f"nothing for the KV cache ({free / 2**30:.1f} GiB free after the weights)")
        return KVCacheSettings(block_size, budget, max_tokens=1 << 62, prefix_caching=prefix_caching,
                               state_slots=state_slots)
    return KVCacheSettings(block_size, prefix_caching=prefix_caching, state_slots=state_slots)


class PagedKVPool:
    def __init__(self, specs: list[CacheSpec], num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", prefix_root: bytes | None = None,
                 states: StatePool | None = None):
        """specs: per layer, what one token stores. Allocates [num_blocks, block_size, *shape] per layer and entry.
        prefix_root: the root of the blocks' hash chain (experts/prefix_cache.py root_key); None: no prefix
        caching (no block is ever shared). states: the linear-attention layers' per-sequence states, or None."""
        assert block_size >= 1 and num_blocks >= 1, (block_size, num_blocks)
        assert states is None or prefix_root is None, "prefix caching cannot restore a linear layer's state"
        self.states = states
        self.specs = specs
        self.prefix_root = prefix_root
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.allocator = BlockAllocator(num_blocks)
        self._scratch: dict[tuple[str, str], torch.Tensor] = {}  # gather buffers, reused (see gather)
        self.storage: list[dict[str, torch.Tensor]] = [
            {name: torch.empty((num_blocks, block_size, *shape), dtype=dtype, device=self.device)
             for name, shape in spec.items()}
            for spec in specs
        ]

    @staticmethod
    def bytes_per_token(specs: list[CacheSpec], dtype: torch.dtype) -> int:
        """KV bytes one token takes over every layer (GQA: layers × 2 × kvh × D × dtype bytes)."""
        item = torch.empty((), dtype=dtype).element_size()  # host: a size probe
        return sum(math.prod(shape) * item for spec in specs for shape in spec.values())

    @classmethod
    def plan(cls, specs: list[CacheSpec], dtype: torch.dtype, device: torch.device | str, context: int,
             settings: KVCacheSettings = KVCacheSettings(), identity: object = None,
             state_shapes: list[StateShapes] | None = None) -> PagedKVPool:
        """A pool within settings.budget_bytes (default DEFAULT_CPU_KV_BYTES) and settings.max_tokens (default
        DEFAULT_MAX_SEQUENCES full contexts); at least one block. identity: what names the model (its config) in
        the prefix-cache keys, with the dtype, block size and specs. state_shapes: per layer, the linear-attention
        states of one sequence (experts/state_cache.py); their settings.state_slots copies (at most half the budget)
        are taken from the budget first, and prefix caching is off."""
        per_token = cls.bytes_per_token(specs, dtype)
        budget = DEFAULT_CPU_KV_BYTES if settings.budget_bytes is None else settings.budget_bytes
        states = None
        if state_shapes and any(state_shapes):
            per_sequence = state_bytes_per_sequence(state_shapes, dtype)
            if 2 * per_sequence > budget:
                raise ValueError(f"kv cache: one sequence's linear-attention state takes "
                                 f"{per_sequence / 2**20:.1f} MiB, more than half the {budget / 2**20:.1f} MiB "
                                 "budget (router.kv_cache_gb / gpu_memory_utilization)")
            # At most half the budget goes to states: fewer slots than asked (fewer sequences at once, admission
            # waits) rather than no room left for the attention layers' blocks.
            slots = min(settings.state_slots or DEFAULT_MAX_SEQUENCES, budget // 2 // per_sequence)
            budget -= slots * per_sequence
            states = StatePool(state_shapes, slots, dtype, device)
        cap = DEFAULT_MAX_SEQUENCES * context if settings.max_tokens is None else settings.max_tokens
        by_budget = budget // max(1, per_token * settings.block_size)
        num_blocks = max(1, min(by_budget, blocks_for(cap, settings.block_size)))
        prefix = settings.prefix_caching and states is None
        root = root_key(identity, str(dtype), settings.block_size, specs) if prefix else None
        return cls(specs, num_blocks, settings.block_size, dtype, device, prefix_root=root, states=states)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token(self.specs, self.dtype) * self.block_size

    def nbytes(self) -> int:
        """Bytes the pool reserves (every block, used or not)."""
        return sum(t.numel() * t.element_size() for layer in self.storage for t in layer.values())

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, zeroed: a gather reads whole blocks, and the unwritten tail of a block must be finite
        (uninitialised memory may hold NaN, and 0 × NaN is NaN even where attention masks it out)."""
        ids = self.allocator.allocate(n)
        if ids:
            index = tensor_on(ids, torch.int64, self.device)
            for layer in self.storage:
                for pool in layer.values():
                    pool.index_fill_(0, index, 0)
        return ids

    def new_sequence(self) -> KVCache:
        return KVCache(self)

    # ---- a step's writes and reads (every sequence of the step at once) -------------------------------------

    def slots(self, caches: list[KVCache], lengths: list[int]) -> torch.Tensor:
        """Flat slot ids [T] of the step's new tokens: sequence i's tokens go at positions length_i ..
        length_i + lengths[i] - 1 of its block table. Every cache must have reserved them."""
        # Integer arithmetic in Python, one tensor at the end: per-sequence tensor ops cost ~5 small torch calls per
        # sequence, which at 32 decoding sequences was the largest part of building a step's layout.
        bs = self.block_size
        out = [blocks[p // bs] * bs + p % bs
               for blocks, start, n in ((c.blocks, c.length, n) for c, n in zip(caches, lengths))
               for p in range(start, start + n)]
        return tensor_on(out, torch.int64, self.device)  # [T]

    def write(self, layer: int, slots: torch.Tensor, entries: dict[str, torch.Tensor]) -> None:
        """entries: name -> [T, *shape] for the step's new tokens, stored at `slots` [T]."""
        for name, new in entries.items():
            pool = self.storage[layer][name]
            pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, new.to(pool.dtype))

    def block_table(self, caches: list[KVCache], upto: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(table [B, nb] of block ids padded with block 0, lengths [B]) covering `upto[i]` tokens of each."""
        nb = max(blocks_for(n, self.block_size) for n in upto)
        rows = [c.blocks[:blocks_for(n, self.block_size)] for c, n in zip(caches, upto)]
        # Pad with the row's own first block: allocated, so zeroed or written (finite; the caller masks it).
        table = tensor_on([r + r[:1] * (nb - len(r)) for r in rows], torch.int64, self.device)
        return table, tensor_on(upto, torch.int64, self.device)

    def gather(self, layer: int, table: torch.Tensor, scratch: str = "") -> dict[str, torch.Tensor]:
        """name -> [B, nb * block_size, *shape]: the blocks of `table` [B, nb] side by side (one copy); positions
        past a sequence's length are padding (stale or another sequence's data) for the caller to mask.

        The copy lands in a buffer the pool keeps per (scratch, name) and reuses at the next gather with the same
        `scratch` tag (growing it when needed): a fresh tensor per layer and step would pay page faults on every
        copy (measured on CPU: 8 × 4096 tokens of one entry, 36 ms into a new tensor, 15 ms into a reused one). So
        the result is valid until the next gather with the same tag; the attention core uses it at once."""
        b, nb = table.shape
        out = {}
        for name, pool in self.storage[layer].items():
            if pool.device.type != "cpu":
                # A GPU's caching allocator hands a fresh tensor back without page faults: no scratch to keep.
                out[name] = pool.index_select(0, table.reshape(-1)).view(b, nb * self.block_size, *pool.shape[2:])
                continue
            buf = self._scratch.get((scratch, name))
            if buf is None or buf.dtype != pool.dtype:
                buf = self._scratch[(scratch, name)] = pool.new_empty(0)
            # resize_(0) keeps the storage; index_select then grows the buffer only past its largest size so far.
            rows = torch.index_select(pool, 0, table.reshape(-1), out=buf.resize_(0))  # [B*nb, bs, *shape]
            out[name] = rows.view(b, nb * self.block_size, *pool.shape[2:])
        return out


@dataclass(frozen=True)
class PrefixHit:
    """What `KVCache.lookup_prefix` found: the cached blocks of the input's longest cached prefix and their keys."""

    blocks: list[int]
    keys: list[bytes]
    block_size: int

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block_size


class KVCache:
    """One sequence's view of the pool: its block table (ids, the same for every layer) and how many tokens it has.
    `reserve` before a step, `free` when the sequence ends (or is preempted). With prefix caching, `lookup_prefix` +
    `adopt` start an empty sequence from cached blocks and `commit` registers its full blocks as they fill."""

    def __init__(self, pool: PagedKVPool):
        self.pool = pool
        self.blocks: list[int] = []  # changed in place only: the finalizer below holds this list
        self.length = 0  # tokens written (and attended) so far
        self.keys: list[bytes] = []  # hash-chain keys of blocks 0..len(keys)-1 (full, committed)
        # False once a step computed this sequence's tokens with moved or dropped expert slots (degrade, shedding,
        # capacity): from then on its blocks hold what a normal run would not, so none is registered.
        self.shareable = pool.prefix_root is not None
        # The linear layers' state slot (experts/state_cache.py): [] or [slot], a list the finalizer holds.
        self.state_slots: list[int] = []
        # A cache dropped without free() (a caller's loop that just lets go of it) still returns its blocks.
        weakref.finalize(self, _release, pool.allocator, self.blocks, pool.states, self.state_slots)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_size

    def blocks_needed(self, new_tokens: int) -> int:
        """Blocks to allocate before `new_tokens` more tokens fit."""
        return max(0, blocks_for(self.length + new_tokens, self.pool.block_size) - len(self.blocks))

    @property
    def state_slot(self) -> int | None:
        """The slot of this sequence's linear-attention state, None before its first tokens (or without one)."""
        return self.state_slots[0] if self.state_slots else None

    def needs_state(self) -> bool:
        """Whether the next `reserve` takes a state slot (a linear-attention model's sequence that has none)."""
        return self.pool.states is not None and not self.state_slots

    def reserve(self, new_tokens: int) -> None:
        """Make room for `new_tokens` more tokens, and take a state slot with the first ones where the model has
        linear layers (OutOfBlocks, allocating nothing, when the pool cannot)."""
        need = self.blocks_needed(new_tokens)
        take_state = new_tokens > 0 and self.needs_state()
        if take_state and self.pool.states.num_free == 0:
            raise OutOfStateSlots(self.pool.states.slots)
        if need:
            self.blocks.extend(self.pool.allocate(need))
        if take_state:
            self.state_slots.append(self.pool.states.allocate())

    def free(self) -> None:
        """Return every block to the pool (registered ones stay cached); the cache is empty (length 0) and
        reusable."""
        _release(self.pool.allocator, self.blocks, self.pool.states, self.state_slots)
        self.length = 0
        self.keys = []
        self.shareable = self.pool.prefix_root is not None

    # ---- prefix caching (README: Prefix caching) ------------------------------------------------------------

    def lookup_prefix(self, token_ids: list[int]) -> PrefixHit:
        """The cached blocks this empty sequence could start from, to feed `token_ids` (every token it will hold
        next): the longest cached run of its full blocks, never the block of the last token (its logits must be
        computed). Takes nothing; `adopt` takes them. Empty with prefix caching off."""
        assert self.length == 0 and not self.blocks, "lookup_prefix: only an empty sequence starts from a prefix"
        pool = self.pool
        if pool.prefix_root is None:
            return PrefixHit([], [], pool.block_size)
        keys = block_keys(token_ids, pool.block_size, pool.prefix_root,
                          upto_block=reusable_blocks(len(token_ids), pool.block_size))
        blocks = pool.allocator.match(keys)
        return PrefixHit(blocks, keys[:len(blocks)], pool.block_size)

    def adopt(self, hit: PrefixHit) -> int:
        """Start from `hit`'s blocks (a reference to each): they are this sequence's first hit.tokens tokens, which
        the caller no longer feeds. Returns hit.tokens."""
        assert self.length == 0 and not self.blocks, "adopt: only an empty sequence starts from a prefix"
        self.pool.allocator.share(hit.blocks)
        self.blocks.extend(hit.blocks)
        self.keys = list(hit.keys)
        self.length = hit.tokens
        return hit.tokens

    def uncommitted(self) -> bool:
        """Whether a full block was written since the last `commit` (and could be registered)."""
        return self.shareable and self.length // self.pool.block_size > len(self.keys)

    def commit(self, token_ids: list[int]) -> None:
        """Register this sequence's full blocks written since the last commit. token_ids: the tokens it holds, in
        order (at least `length` of them; any beyond are ignored). A block whose key another block already holds
        (computed twice at once) stays private; later blocks still get their keys."""
        if not self.uncommitted():
            return
        pool, first = self.pool, len(self.keys)
        parent = self.keys[-1] if self.keys else pool.prefix_root
        keys = block_keys(token_ids[:self.length], pool.block_size, parent, first_block=first)
        for i, key in enumerate(keys, start=first):
            pool.allocator.register(self.blocks[i], key)
        self.keys.extend(keys)

    def nbytes(self) -> int:
        """Bytes of the blocks this sequence holds."""
        return len(self.blocks) * self.pool.block_bytes

    def read(self, layer: int) -> dict[str, torch.Tensor]:
        """name -> [length, *shape]: this sequence's history at `layer` (a copy; for tests and debugging)."""
        table, _ = self.pool.block_table([self], [max(1, self.length)])
        return {name: t[0, :self.length].clone() for name, t in self.pool.gather(layer, table, "read").items()}


def _release(allocator: BlockAllocator, blocks: list[int], states: StatePool | None = None,
             slots: list[int] | None = None) -> None:
    if blocks:
        allocator.free(blocks)
        blocks.clear()
    if slots:
        for slot in slots:
            states.release(slot)
        slots.clear()
