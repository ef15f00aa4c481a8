"""Keys of full KV-cache blocks for automatic prefix caching: a hash chain over token ids (no tensors, no torch).

What a full block of the paged KV cache holds at a layer is a function of the tokens at and before its positions
(their keys and values, or MLA's latents, are computed from the residual stream of those tokens at those rotary
positions), of the model and of how it computes (dtype, block size). So a block is keyed, as vLLM does, by
`key_i = H(key_{i-1} || token ids of block i)`, with `key_{-1}` the root: a digest of the model's identity (its
config, the pool's dtype, block size and cache layout). Equal keys mean the same tokens at the same positions after
the same prefix, under the same model: the block's content can be shared. Nothing else feeds a block (no dynamic
RoPE scaling here; sliding-window layers keep full history; gpt-oss's sinks are weights, not cached tokens).

BLAKE2b with a 128-bit digest: a collision would silently serve another prefix's keys and values, so not Python's
`hash` (64 bits, salted per process for str).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DIGEST_BYTES = 16


def root_key(*identity: object) -> bytes:
    """The chain's root for a model: a digest of `identity` (anything with a stable repr: the config, the dtype,
    the block size, the cache specs). Different identities never share a block."""
    return hashlib.blake2b(repr(identity).encode(), digest_size=DIGEST_BYTES).digest()


def block_keys(token_ids: Sequence[int], block_size: int, parent: bytes, first_block: int = 0,
               upto_block: int | None = None) -> list[bytes]:
    """Keys of the full blocks first_block .. upto_block-1 of `token_ids` (default: every full block), `parent`
    being the key of block first_block-1 (the root for block 0). A partial last block gets no key."""
    assert block_size >= 1, block_size
    full = len(token_ids) // block_size
    end = full if upto_block is None else min(full, upto_block)
    keys, key = [], parent
    for i in range(first_block, end):
        chunk = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()  # int64: ids are never truncated
        key = hashlib.blake2b(key + chunk, digest_size=DIGEST_BYTES).digest()
        keys.append(key)
    return keys


def reusable_blocks(prompt_len: int, block_size: int) -> int:
    """How many leading full blocks of a `prompt_len`-token input may come from the cache: never the block of the
    last token, which must be computed so its logits exist (a prompt of exactly k blocks reuses k - 1)."""
    return max(0, prompt_len - 1) // block_size
