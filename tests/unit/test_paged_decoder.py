"""The decoder over the paged KV cache equals the obvious path: per sequence, a history grown by `torch.cat` and one
`attend_prefill` call per sequence (the cache the decoder had before paging). Also: the batched attention core over
a pool against attend_prefill (windows, sinks, an MLA-like entry), chunked prefill, lm_head rows, KV bytes per
token. No Ray."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from expertmesh.experts import modeling, step_group
from expertmesh.experts.attention_core import StepLayout, attend, attend_prefill
from expertmesh.experts.kv_cache import KVCacheSettings, PagedKVPool
from expertmesh.experts.modeling import MoEDecoder
from expertmesh.experts.reference import load_reference_model
from tests.tiny_checkpoints import write_hf_checkpoint

TOL = 1e-5  # fp32: the same math in other batch shapes (padding, one call for many sequences)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed))


def _small_pool(model: MoEDecoder, block_size: int = 4, tokens: int = 256) -> MoEDecoder:
    """The same weights and experts over a pool of small blocks, so sequences span and interleave blocks."""
    return MoEDecoder(model.cfg, model.w, model.experts, kv_cache=KVCacheSettings(block_size, max_tokens=tokens))


class CatOracle:
    """Stands in for attention_core.attend: each sequence (named by the test, per step) keeps, per layer, its
    history grown with torch.cat and attends it alone with attend_prefill."""

    def __init__(self):
        self.history: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self.names: list[str] = []  # the sequences of the current step, in order

    def __call__(self, layout, layer, q, entries, keys_values, scale, window, sinks, chunk=None, select=None):
        assert select is None  # a DSA top-k selection: none of the families this oracle stands for has one
        outs, offset = [], 0
        for name, n, start in zip(self.names, layout.lengths, layout.starts):
            held = self.history.get((name, layer))
            new = {k: t[offset:offset + n] for k, t in entries.items()}
            held = new if held is None else {k: torch.cat([held[k], new[k]]) for k in new}
            assert next(iter(held.values())).shape[0] == start + n
            self.history[(name, layer)] = held
            k, v = keys_values(held)  # [L, kvh, D]
            outs.append(attend_prefill(q[offset:offset + n], k, v, start, scale, window, sinks, chunk))
            offset += n
        return torch.cat(outs)


@pytest.fixture(scope="module")
def mixtral(checkpoints):
    return load_reference_model(checkpoints["mixtral"])


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    folder = write_hf_checkpoint("mixtral", tmp_path_factory.mktemp("paged") / "sw", sliding_window=5)
    return load_reference_model(folder)


# A schedule of steps: per step, (sequence, tokens it feeds). Prefills, chunks of a prompt after history, decodes
# and a late join share steps; with blocks of 4 the sequences' blocks interleave in the pool.
SCHEDULE = [
    [("a", 7), ("b", 5)],
    [("a", 1), ("b", 4), ("c", 9)],  # b: a chunk after 5 tokens of history; c joins
    [("a", 1), ("b", 1), ("c", 1)],
    [("c", 3), ("a", 1)],
    [("a", 1), ("b", 1), ("c", 1)],
    [("b", 6)],  # a longer chunk after history, alone
]


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    """Llama 4: chunked attention (chunk 8) on its RoPE layers, position-scaled queries on its NoPE layers."""
    from tests.tiny_llama4 import write_llama4_checkpoint

    return load_reference_model(write_llama4_checkpoint(tmp_path_factory.mktemp("paged") / "llama4"))


@pytest.mark.parametrize("which", ["mixtral", "windowed", "chunked"])
def test_paged_steps_equal_the_concatenated_cache_oracle(which, request, monkeypatch):
    """Prefill, decode, mixed steps and chunks, through block tables: the same logits as the cat-grown cache with
    one attention call per sequence (and the sliding window masks the same keys)."""
    model = _small_pool(request.getfixturevalue(which))
    seeds = {"a": 1, "b": 2, "c": 3}
    streams = {name: _ids(40, seed) for name, seed in seeds.items()}
    fed = dict.fromkeys(seeds, 0)
    caches = {name: model.new_cache() for name in seeds}
    oracle = CatOracle()
    for step in SCHEDULE:
        tokens = [streams[name][fed[name]:fed[name] + n] for name, n in step]
        got = model.forward(tokens, [caches[name] for name, _ in step])
        with monkeypatch.context() as patch:
            patch.setattr(modeling, "attend", oracle)
            patch.setattr(step_group, "StepLayout", _OracleLayout)  # what StepGroup.layout builds
            oracle.names = [name for name, _ in step]
            oracle_caches = [_Length(fed[name]) for name, _ in step]
            want = model.forward(tokens, oracle_caches)
        for name, n in step:
            fed[name] += n
        for g, w in zip(got, want):
            assert (g - w).abs().max().item() <= TOL
    assert fed == {"a": 11, "b": 17, "c": 14}
    if which == "windowed":
        assert model.cfg.sliding_layers and max(fed.values()) > model.cfg.sliding_window  # the window did bite
    if which == "chunked":
        assert model.cfg.chunked_layers and max(fed.values()) > 2 * model.cfg.attention_chunk_size  # 3 chunks


class _OracleLayout:
    """What the oracle needs of a step's layout: lengths and starts (no pool, no block tables)."""

    @staticmethod
    def build(lengths, starts, caches, device) -> SimpleNamespace:
        return SimpleNamespace(lengths=lengths, starts=starts)


class _Length:
    """A cache stand-in for the oracle run: only the length (the oracle keeps the history)."""

    def __init__(self, length: int):
        self.length = length

    def reserve(self, n: int) -> None:
        pass


def test_chunked_prefill_equals_the_whole_prompt(mixtral):
    """A prompt fed in chunks that cross block boundaries: every position's logits equal the one-call prefill's,
    and greedy decoding after it gives the same tokens."""
    model = _small_pool(mixtral, block_size=4)
    ids = _ids(23, seed=7)
    whole = model.forward([ids])[0]  # [23, V], no cache
    cache = model.new_cache()
    pieces = [model.forward([ids[a:b]], [cache])[0] for a, b in ((0, 6), (6, 7), (7, 16), (16, 23))]
    assert (torch.cat(pieces) - whole).abs().max().item() <= TOL

    def greedy(chunks: list[tuple[int, int]]) -> list[int]:
        c = model.new_cache()
        for a, b in chunks:
            logits = model.forward([ids[a:b]], [c], logits="last")[0]
        out = [int(logits.argmax())]
        for _ in range(6):
            out.append(int(model.forward([torch.tensor(out[-1:])], [c], logits="last")[0].argmax()))
        return out

    assert greedy([(0, 23)]) == greedy([(0, 5), (5, 13), (13, 23)])


def test_lm_head_runs_only_on_the_rows_asked_for(mixtral, monkeypatch):
    a, b, c = _ids(6, 11), _ids(4, 12), _ids(5, 13)
    full = mixtral.forward([a, b, c])  # every row
    rows: list[int] = []
    linear = torch.nn.functional.linear

    def spy(x, weight, bias=None):
        if weight is mixtral.w.lm_head:
            rows.append(x.shape[0])
        return linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    got = mixtral.forward([a, b, c], logits=["all", "last", "none"])
    monkeypatch.undo()
    assert rows == [6 + 1]  # one lm_head call over a's 6 rows and b's last
    assert [tuple(t.shape) for t in got] == [(6, mixtral.cfg.vocab_size), (1, mixtral.cfg.vocab_size),
                                             (0, mixtral.cfg.vocab_size)]
    assert (got[0] - full[0]).abs().max().item() <= TOL
    assert (got[1][0] - full[1][-1]).abs().max().item() <= TOL


def test_kv_bytes_per_token_is_the_formula(mixtral):
    cfg = mixtral.cfg
    per_token = PagedKVPool.bytes_per_token(mixtral.cache_specs(), mixtral.dtype)
    assert per_token == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32
    pool = mixtral.kv_pool
    assert pool.block_bytes == per_token * pool.block_size
    assert pool.nbytes() == pool.num_blocks * pool.block_bytes


def test_cacheless_forward_takes_no_blocks_and_a_dropped_cache_returns_them(mixtral):
    pool = mixtral.kv_pool
    free = pool.allocator.num_free
    mixtral.forward([_ids(30, 21), _ids(9, 22)])
    assert pool.allocator.num_free == free
    cache = mixtral.new_cache()
    mixtral.forward([_ids(40, 23)], [cache])
    assert pool.allocator.num_free == free - len(cache.blocks) < free
    del cache  # a caller that just lets go of it
    assert pool.allocator.num_free == free


# ---------------------------------------------------------------- the attention core over a pool


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("spec", ["gqa", "latent"])
def test_attend_over_the_pool_equals_attend_prefill_per_sequence(window, with_sinks, spec):
    """Decode rows, a fresh prefill and a chunk after history in one step, against attend_prefill per sequence.
    'latent' caches one vector per token that keys_values expands (as MLA does), with Dv != Dqk."""
    g = torch.Generator().manual_seed(5)
    nh, kvh, d, dv = 4, 2, 8, 6
    if spec == "gqa":
        cache_spec = {"k": (kvh, d), "v": (kvh, dv)}

        def keys_values(e):
            return e["k"], e["v"]
    else:
        cache_spec = {"latent": (5,)}
        up_k, up_v = torch.randn(5, kvh * d, generator=g), torch.randn(5, kvh * dv, generator=g)

        def keys_values(e):
            lat = e["latent"]  # [..., L, 5]
            return (lat @ up_k).unflatten(-1, (kvh, d)), (lat @ up_v).unflatten(-1, (kvh, dv))
    sinks = torch.randn(nh, generator=g) if with_sinks else None
    pool = PagedKVPool([cache_spec], num_blocks=32, block_size=4, dtype=torch.float32)
    histories = {}  # name -> whole entries so far
    caches = {name: pool.new_sequence() for name in "abcd"}

    def step(rows: list[tuple[str, int]]):
        lengths = [n for _, n in rows]
        starts = [caches[name].length for name, _ in rows]
        for (name, n) in rows:
            caches[name].reserve(n)
        entries = {k: torch.randn(sum(lengths), *shape, generator=g) for k, shape in cache_spec.items()}
        q = torch.randn(sum(lengths), nh, d, generator=g)
        layout = StepLayout.build(lengths, starts, [caches[name] for name, _ in rows], torch.device("cpu"))
        got = attend(layout, 0, q, entries, keys_values, 0.3, window, sinks)  # [T, nh*dv]
        offset = 0
        for (name, n), start in zip(rows, starts):
            new = {k: t[offset:offset + n] for k, t in entries.items()}
            held = histories.get(name)
            histories[name] = new if held is None else {k: torch.cat([held[k], new[k]]) for k in new}
            k, v = keys_values(histories[name])
            want = attend_prefill(q[offset:offset + n], k, v, start, 0.3, window, sinks)
            assert (got[offset:offset + n] - want).abs().max().item() <= TOL, (name, n, start)
            offset += n
        for name, n in rows:
            caches[name].length += n

    step([("a", 6), ("b", 3), ("c", 1)])  # fresh prefills of different lengths, one of them a single token
    step([("a", 1), ("b", 1), ("c", 5), ("d", 7)])  # decodes + a chunk after history + a fresh prompt
    step([("d", 1), ("a", 1), ("b", 9)])
