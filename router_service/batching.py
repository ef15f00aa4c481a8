"""Continuous batching: concurrent generations share every forward step.

A step is one forward over the decode tokens of every running sequence plus chunks of prompts being prefilled, at
most `max_prefill_tokens` prompt tokens in all (chunked prefill: a long prompt is split over several steps, so
running streams keep getting a token every step meanwhile). One expert call per layer serves the whole step.

Memory is the paged KV cache (experts/kv_cache.py): a waiting request is admitted when its prompt's blocks are free
(and reserves them); a finished, cancelled or timed-out stream frees its blocks at the next step boundary. When a
decode step needs a block and none is free, the youngest running sequence is preempted: its blocks are freed and it
goes back to the head of the queue, to be recomputed later from its prompt + the tokens it already generated (same
tokens: the recompute's logits are the ones its next decode step would have had). A request that could never fit
the cache is refused (RequestError naming the field and the limit). Models with linear-attention layers (Qwen3-Next,
Qwen3.5) also need a free state slot to admit a sequence (experts/state_cache.py); preemption frees it with the
blocks, and the recompute rebuilds the state.

Prefix caching (README: Prefix caching): at admission a sequence starts from the cached blocks of its longest cached
prefix and feeds only the rest (at least its last token, whose logits it needs), so a repeated system prompt is not
computed again; after each step its newly full blocks are registered for others. A preempted sequence's blocks stay
cached while nothing needs the room, so its recompute mostly finds them. A step that moved or dropped expert slots
of a sequence (degrade, shedding, capacity) stops that sequence registering blocks: they hold what a normal run
would not compute.

Forwards run one at a time on a worker thread so the event loop keeps accepting requests and cancellations while
experts compute.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..experts.device_rule import routing_on_host
from ..experts.kv_cache import KVCache, blocks_for
from ..experts.modeling import MoEDecoder
from .affinity_admission import prompt_signature, reorder_waiting, shards_called
from .batching_config import BatcherConfig  # noqa: F401  (re-exported; defined there so the configuration imports no torch)
from .errors import RequestError
from .grammar_mask import GrammarState, TokenGrammar, mask_logits
from .sampling import SamplingParams, adjust_logits, sample_tokens, skip_draws
from .step_profile import StageClock


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later (gRPC RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    eos_token_id: int | None = None  # None: do not stop at end-of-sequence
    # Tokens this request already generated and delivered, when it resumes after its router replica died
    # (router_service/continuation.py): they count toward max_tokens and usage and are not streamed again.
    resumed_ids: tuple[int, ...] = ()
    # Log-probabilities to report per generated token (OpenAI `logprobs`): None = none; k ≥ 0 = the chosen token's
    # and the k most likely tokens' (from the model's raw distribution, before temperature / top-p).
    top_logprobs: int | None = None
    # Until this many tokens are generated, eos and stop_token_ids cannot be sampled (their logits are -inf) and
    # stop strings do not end the generation (vLLM's min_tokens).
    min_tokens: int = 0
    # Structured output (router_service/grammar_mask.py): each step's logits are masked to the tokens the grammar
    # allows, and the sequence ends when the grammar is complete. None: unconstrained.
    grammar: TokenGrammar | None = None

    def suppressed_ids(self, generated: int) -> frozenset[int]:
        """Token ids that may not be sampled after `generated` tokens: eos and stop ids while under min_tokens."""
        if generated >= self.min_tokens:
            return frozenset()
        eos = frozenset() if self.eos_token_id is None else frozenset({self.eos_token_id})
        return self.stop_token_ids | eos


@dataclass
class TokenEvent:
    token_ids: list[int]
    text: str
    # One entry per token id when the request asked for them: (its log-probability, [(id, logprob)] top ones).
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class DoneEvent:
    finish_reason: str  # "length" | "eos" | "stop"
    prompt_tokens: int
    completion_tokens: int
    tokens_per_expert: dict[int, list[int]]  # layer -> [E] routed slots over the whole request
    rerouted: int = 0
    dropped: int = 0
    degraded: int = 0  # slots moved off an expert that had no live replica (degrade policy)
    shed: int = 0  # slots moved off an overloaded expert (overload shedding)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (OpenAI usage.prompt_tokens_details)


@dataclass(eq=False)  # identity: `seq in self._active` must not compare every field (tensors, queues) per step
class _Sequence:
    request: GenerationRequest
    events: asyncio.Queue
    cache: KVCache | None
    next_input: torch.Tensor  # tokens not yet fed to the model: (the rest of) the prompt, or the last sampled token
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    emitted_text: str = ""
    tokens_per_expert: dict[int, torch.Tensor] = field(default_factory=dict)
    rerouted: int = 0
    dropped: int = 0
    degraded: int = 0
    shed: int = 0
    cancelled: bool = False
    replaying: bool = False  # the first step re-derives the last resumed token instead of sampling a new one
    admitted: int = -1  # admission order (the youngest is preempted first)
    routed: int = 0  # positions whose routing is counted (a recompute after preemption does not count them twice)
    stop_from: int = 0  # stop strings are searched from this character on (text emitted before min_tokens is final)
    span: Any = None  # the request's OpenTelemetry span (tracing on), parent or link of its steps
    grammar: GrammarState | None = None  # where the sequence stands in its request's grammar (None: unconstrained)
    cached_tokens: int | None = None  # prompt tokens its first admission took from the prefix cache
    arrived: float = field(default_factory=time.monotonic)  # affinity admission's fairness bound counts from here
    experts: frozenset[int] | None = None  # its predicted experts (affinity admission), computed when first needed


@dataclass
class _StepRouting:
    """What one step routed for one sequence."""

    tokens_per_expert: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [E]
    rerouted: int = 0
    dropped: int = 0
    degraded: int = 0
    shed: int = 0


def step_routing(routings: dict, lengths: list[int], skip: list[int], num_experts: int) -> list[_StepRouting]:
    """What one step routed, per sequence: routings layer -> Routing over the step's tokens (sequences' tokens
    consecutive, `lengths` each); a sequence's first skip[i] tokens were counted before (a recompute). Whole-step
    tensor ops per layer, not a Python loop per sequence (at 32 streams that loop was ~7% of a router's CPU)."""
    lengths_t = torch.tensor(lengths)  # host: step bookkeeping; [B]
    batch = len(lengths)
    seq_of = torch.repeat_interleave(torch.arange(batch), lengths_t)  # host: bookkeeping; [T] each token's sequence
    firsts = torch.repeat_interleave(torch.cumsum(lengths_t, 0) - lengths_t, lengths_t)  # [T]
    offset = torch.arange(seq_of.numel()) - firsts  # host: step bookkeeping
    fresh = offset >= torch.tensor(skip)[seq_of]  # host: step bookkeeping; [T] not counted before
    per_seq = [_StepRouting() for _ in lengths]
    for layer, routing in routings.items():
        routing = routing_on_host(routing)  # the router's already is (experts/device_rule.py); the reference's not
        experts = routing.experts  # [T, K], -1 = dropped
        owner = seq_of[:, None].expand_as(experts)[fresh]  # [F, K]
        chosen = experts[fresh]  # [F, K]
        kept = chosen >= 0
        counts = torch.bincount(owner[kept] * num_experts + chosen[kept],
                                minlength=batch * num_experts).view(batch, num_experts)  # [B, E]
        dropped = torch.bincount(owner[~kept], minlength=batch).tolist()  # [B]
        degraded = _per_sequence(routing.degraded_per_token, seq_of, fresh, batch)
        rerouted = _per_sequence(routing.rerouted_per_token, seq_of, fresh, batch)
        shed = _per_sequence(routing.shed_per_token, seq_of, fresh, batch)
        for i, mine in enumerate(per_seq):
            mine.tokens_per_expert[layer] = counts[i]
            mine.dropped += dropped[i]
            if degraded is not None:
                mine.degraded += degraded[i]
            if rerouted is not None:
                mine.rerouted += rerouted[i]
            if shed is not None:
                mine.shed += shed[i]
    return per_seq


def _per_sequence(per_token: torch.Tensor | None, seq_of: torch.Tensor, fresh: torch.Tensor,
                  batch: int) -> list[int] | None:
    """[T] per-token counts -> per-sequence sums over the fresh tokens, or None when the routing has none."""
    if per_token is None:
        return None
    return torch.bincount(seq_of[fresh], weights=per_token[fresh].double(), minlength=batch).long().tolist()


class ContinuousBatcher:
    def __init__(self, model: MoEDecoder, decode: Callable[[list[int]], str] | None,
                 config: BatcherConfig | None = None):
        self.model = model
        self.decode = decode
        self.config = (config or BatcherConfig()).validate()
        self._waiting: deque[_Sequence] = deque()
        self._active: list[_Sequence] = []
        self._wakeup = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self._task: asyncio.Task | None = None
        self.steps = 0
        self.max_batch_seen = 0
        self.preemptions = 0
        self.prefix_query_tokens = 0  # prompt tokens of admitted requests (first admission)
        self.prefix_hit_tokens = 0  # of those, tokens taken from the prefix cache
        self._admissions = 0
        self.expert_shard_calls = 0  # distinct (layer, expert) shards each step called, summed: expert loads
        self.finished_requests = 0
        self._recent_experts: frozenset[int] = frozenset()  # affinity: the last running batch's predicted experts
        self.observer = None  # RouterObserver (router_service/observability.py): step spans; None = no tracing
        self.profile = StageClock()  # stage seconds (router_service/step_profile.py); shared with the router's

    # ---- observability ---------------------------------------------------------------------------------------

    @property
    def live_caches(self) -> int:
        """KV caches held right now (active sequences plus queued ones)."""
        return sum(s.cache is not None for s in (*self._active, *self._waiting))

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    def kv_cache_bytes(self) -> int:
        """Bytes of the KV-cache blocks sequences hold now."""
        return sum(s.cache.nbytes() for s in (*self._active, *self._waiting) if s.cache is not None)

    def stats(self) -> dict:
        pool = self.model.kv_pool
        return {"live_caches": self.live_caches, "active": len(self._active), "waiting": len(self._waiting),
                "steps": self.steps, "max_batch_seen": self.max_batch_seen, "preemptions": self.preemptions,
                "kv_blocks_free": pool.allocator.num_free, "kv_blocks_total": pool.num_blocks,
                "kv_blocks_cached": pool.allocator.num_cached, "prefix_query_tokens": self.prefix_query_tokens,
                "prefix_hit_tokens": self.prefix_hit_tokens, "expert_shard_calls": self.expert_shard_calls,
                "finished_requests": self.finished_requests, **graph_stats(getattr(self.model, "graphs", None))}

    # ---- requests --------------------------------------------------------------------------------------------

    async def stream(self, request: GenerationRequest, span: Any = None) -> AsyncIterator[TokenEvent | DoneEvent]:
        """Yields TokenEvents then one DoneEvent. Closing the iterator early cancels the sequence.
        span: the request's trace span (its steps become its children or link to it); None when tracing is off."""
        # Requests that arrive together all sit in `_waiting` until the loop next admits; count the free active
        # slots they will take so simultaneous arrivals are not refused while there is room.
        free_slots = max(0, self.config.max_active - len(self._active))
        if len(self._waiting) >= self.config.max_waiting + free_slots:
            raise QueueFullError(f"{len(self._waiting)} requests already waiting (max_waiting)")
        self._check_fits(request)
        seq = _Sequence(request=request, events=asyncio.Queue(), cache=self.model.new_cache(),
                        next_input=torch.tensor(request.prompt_ids, dtype=torch.int64),  # host: step bookkeeping
                        generator=request.sampling.generator(self.model.device), span=span,
                        grammar=None if request.grammar is None else request.grammar.start())
        if request.resumed_ids:
            await asyncio.to_thread(self._resume, seq)
        self._waiting.append(seq)
        self._ensure_loop()
        self._wakeup.set()
        try:
            while True:
                event = await seq.events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if isinstance(event, DoneEvent):
                    return
        finally:
            seq.cancelled = True  # no-op when it finished; otherwise the loop frees it at the next boundary
            if seq in self._waiting:
                self._waiting.remove(seq)
                seq.cache = None  # a waiting sequence holds no blocks

    def _check_fits(self, request: GenerationRequest) -> None:
        """Refuse a request the KV cache could never hold, even alone: its prompt, or prompt + max_tokens."""
        pool = self.model.kv_pool
        limit = (f"the KV cache holds at most {pool.capacity_tokens} tokens ({pool.num_blocks} blocks of "
                 f"{pool.block_size}; router.kv_cache_gb)")
        prompt_len = len(request.prompt_ids)
        if blocks_for(prompt_len + 1, pool.block_size) > pool.num_blocks:
            raise RequestError("prompt", f"{prompt_len} tokens do not fit: {limit}")
        if blocks_for(prompt_len + request.max_tokens, pool.block_size) > pool.num_blocks:
            raise RequestError("max_tokens", f"prompt ({prompt_len} tokens) + max_tokens ({request.max_tokens}) do "
                                             f"not fit: {limit}")

    def _resume(self, seq: _Sequence) -> None:
        """Set up a resumed sequence as the uninterrupted one stood just before its last delivered token.

        The prefill is prompt + all resumed tokens but the last, so the first step's logits are those that chose the
        last one: that step takes it (no draw, nothing streamed) and then runs the same finish checks, which ends a
        request whose last token was its final one (its done message was what got lost). Routing counts then cover
        the same tokens the uninterrupted run had routed by then; the text already streamed is replayed so stop
        strings and held-back text continue exactly where they were.
        """
        resumed = list(seq.request.resumed_ids)
        ids = seq.request.prompt_ids + resumed[:-1]
        seq.next_input = torch.tensor(ids, dtype=torch.int64)  # host: step bookkeeping
        for n in range(1, len(resumed)):
            seq.generated = resumed[:n]
            self._new_text(seq)
        seq.generated = resumed[:-1]
        if seq.grammar is not None:  # the last resumed token is consumed when the first step replays it
            seq.grammar.consume_all(seq.generated)
        seq.replaying = True

    async def run_exclusive(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the forward thread, between steps (for unary scoring that must not overlap a step)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    # ---- the loop --------------------------------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        profile = self.profile
        while True:
            began = time.perf_counter()
            self._release_cancelled()
            self._admit()
            if not self._active:
                self._wakeup.clear()
                profile.open("loop.idle", began)
                await self._wakeup.wait()
                profile.close("loop.idle")
                continue
            plan = self._plan_step()
            if not plan:
                continue  # every running sequence was preempted (cannot happen while _check_fits holds)
            batch = [seq for seq, _ in plan]
            scheduled = profile.since("loop.schedule", began)
            try:
                logits, routing, tokens = await loop.run_in_executor(self._executor, self._forward, plan)
            except Exception as exc:  # an expert failure fails this step's sequences, not the server
                for seq in batch:
                    seq.events.put_nowait(exc)
                    self._finish(seq)
                continue
            forwarded = profile.since("loop.executor", scheduled)
            self.steps += 1
            self.max_batch_seen = max(self.max_batch_seen, len(batch))
            for (seq, n), seq_logits, seq_routing, token in zip(plan, logits, routing, tokens):
                if seq.cancelled:
                    continue
                try:
                    self._count_routing(seq, seq_routing)
                    seq.next_input = seq.next_input[n:]
                    self._commit_blocks(seq, seq_routing)
                    if seq_logits is not None:  # the step fed its last pending token: take the next one
                        self._advance(seq, seq_logits, token)
                except Exception as exc:  # e.g. a failing detokenizer: fail this sequence, keep the loop alive
                    seq.events.put_nowait(exc)
                    self._finish(seq)
            profile.since("loop.post", forwarded)
            profile.since("loop.busy", began)

    @staticmethod
    def _commit_blocks(seq: _Sequence, routing: _StepRouting) -> None:
        """Register the sequence's blocks this step filled (README: Prefix caching), unless this or an earlier step
        moved or dropped its expert slots (capacity cap, degrade, shedding): those blocks hold what a normal run
        would not compute."""
        if seq.cache is None:
            return
        if routing.rerouted or routing.dropped or routing.degraded or routing.shed:
            seq.cache.shareable = False
        if seq.cache.uncommitted():
            # The cache holds a prefix of prompt + generated (resumed and recomputed sequences too).
            seq.cache.commit(seq.request.prompt_ids + seq.generated)

    def _release_cancelled(self) -> None:
        for seq in [s for s in self._active if s.cancelled]:
            self._finish(seq)

    def _admit(self) -> None:
        """Move waiting requests (in order) to the running set while a slot and their prompt's blocks are free. The
        blocks are reserved now, so a prompt never runs out of them half-way through its chunks. Blocks that running
        sequences will need next step (their last block is full) are kept back, so an admission does not force an
        immediate preemption. A sequence starts from its longest cached prefix (README: Prefix caching): those
        blocks are shared, not allocated, and their tokens are not fed again."""
        pool = self.model.kv_pool
        free = self.config.max_active - len(self._active)
        if self.config.admission == "affinity" and len(self._waiting) > free > 0:
            reorder_waiting(self._waiting, self._active, free, time.monotonic(), self.config.affinity_max_wait_s,
                            self._signature, self._recent_experts)
        while self._waiting and len(self._active) < self.config.max_active:
            seq = self._waiting[0]
            pending = seq.next_input.numel()
            hit = seq.cache.lookup_prefix(seq.next_input.tolist()) if seq.cache.length == 0 else None
            shared = [] if hit is None else hit.blocks
            # Cached free blocks it shares leave num_free as surely as new ones it allocates.
            need = seq.cache.blocks_needed(pending) - len(shared)
            if shared:
                need += pool.allocator.free_among(shared)
            headroom = sum(s.cache.blocks_needed(1) for s in self._active if s.next_input.numel() == 1)
            if need + headroom > pool.allocator.num_free:
                break
            # Linear-attention models: a sequence also needs a state slot (experts/state_cache.py), taken with its
            # first tokens; running sequences keep theirs, so no preemption ever waits on a slot.
            states = getattr(pool, "states", None)
            if states is not None and seq.cache.needs_state() and states.num_free == 0:
                break
            if hit is not None:
                reused = seq.cache.adopt(hit) if shared else 0
                seq.next_input = seq.next_input[reused:]
                if seq.cached_tokens is None:  # the request's first admission: what usage and the hit rate report
                    prompt_len = len(seq.request.prompt_ids)
                    seq.cached_tokens = min(reused, prompt_len)
                    self.prefix_query_tokens += prompt_len
                    self.prefix_hit_tokens += seq.cached_tokens
            seq.cache.reserve(seq.next_input.numel())
            seq.admitted, self._admissions = self._admissions, self._admissions + 1
            self._active.append(self._waiting.popleft())
        if self.config.admission == "affinity" and self._active:
            self._recent_experts = frozenset().union(*(self._signature(s) for s in self._active))

    def _signature(self, seq: _Sequence) -> frozenset[int]:
        if seq.experts is None:
            seq.experts = prompt_signature(self.model, seq.request.prompt_ids, self.config.affinity_experts)
        return seq.experts

    def _plan_step(self) -> list[tuple[_Sequence, int]]:
        """(sequence, tokens it feeds this step): every decoding sequence one token, then prompt chunks in admission
        order within max_prefill_tokens. Reserves the decode tokens' blocks, preempting the youngest running
        sequence while none is free."""
        budget = self.config.max_prefill_tokens
        plan: list[tuple[_Sequence, int]] = []
        for seq in sorted(self._active, key=lambda s: s.admitted):
            pending = seq.next_input.numel()
            decoding = pending == 1 and seq.cache.length > 0
            if decoding or budget > 0:
                n = 1 if decoding else min(pending, budget)
                budget -= 0 if decoding else n
                plan.append((seq, n))
        for seq, n in list(plan):
            if seq not in self._active:
                continue  # preempted below for an older sequence
            while not seq.cache.pool.allocator.can_allocate(seq.cache.blocks_needed(n)):
                self._preempt(max(self._active, key=lambda s: s.admitted))
                if seq not in self._active:
                    break
            if seq in self._active:
                seq.cache.reserve(n)
        return [(seq, n) for seq, n in plan if seq in self._active]

    def _preempt(self, seq: _Sequence) -> None:
        """Free a running sequence's blocks and queue it first, to recompute prompt + generated tokens later."""
        self.preemptions += 1
        seq.cache.free()
        ids = list(seq.request.prompt_ids) + seq.generated
        seq.next_input = torch.tensor(ids, dtype=torch.int64)  # host: step bookkeeping
        self._active.remove(seq)
        self._waiting.appendleft(seq)

    def _forward(self, plan: list[tuple[_Sequence, int]]
                 ) -> tuple[list[torch.Tensor | None], list[_StepRouting], list[int | None]]:
        """One forward over the step; per sequence, its next-token logits [V] (None: a prompt chunk that is not the
        prompt's last), what the step routed for its tokens that were not counted before, and its sampled next token
        (None: no logits, or a resumed sequence replaying its last delivered token). The step's tokens are sampled
        here, on the forward thread, with one device read for all of them."""
        started = time.perf_counter()
        batch = [seq for seq, _ in plan]
        lengths = [n for _, n in plan]
        inputs = [seq.next_input[:n] for seq, n in plan]
        wanted = ["last" if n == seq.next_input.numel() else "none" for seq, n in plan]
        starts = [seq.cache.length for seq in batch]
        if self.observer is not None and self.observer.tracer is not None:
            with self.observer.step_span([s.span for s in batch], sum(lengths)):
                logits = self.model.forward(inputs, [s.cache for s in batch], logits=wanted)
        else:
            logits = self.model.forward(inputs, [s.cache for s in batch], logits=wanted)
        self.profile.since("forward.model", started)
        # Tokens recomputed after a preemption were counted when first routed: skip them.
        skip = [max(0, seq.routed - start) for seq, start in zip(batch, starts)]
        for seq, start, n in zip(batch, starts, lengths):
            seq.routed = max(seq.routed, start + n)
        per_seq = step_routing(self.model.last_trace.routings, lengths, skip, self.model.cfg.num_experts)
        self.expert_shard_calls += shards_called(self.model.last_trace.routings)
        last = [x[-1] if w == "last" else None for x, w in zip(logits, wanted)]
        sampled = time.perf_counter()
        draw = [i for i, (seq, x) in enumerate(zip(batch, last)) if x is not None and not seq.replaying]
        # The request's logit rules (penalties, logit_bias, min_tokens) on the logits' device; reported logprobs
        # stay the model's raw distribution (`last`).
        adjusted = [adjust_logits(last[i], batch[i].request.sampling, batch[i].request.prompt_ids,
                                  batch[i].generated, batch[i].request.suppressed_ids(len(batch[i].generated)))
                    for i in draw]
        for k, i in enumerate(draw):  # structured output: only the tokens the grammar allows, on the logits' device
            if batch[i].grammar is not None:
                adjusted[k] = mask_logits(adjusted[k], batch[i].grammar.bitmask())
        chosen = sample_tokens(adjusted, [batch[i].request.sampling for i in draw],
                               [batch[i].generator for i in draw])
        tokens: list[int | None] = [None] * len(batch)
        for i, token in zip(draw, chosen):
            tokens[i] = token
        self.profile.since("forward.sampling", sampled)
        self.profile.since("forward.thread", started)
        return last, per_seq, tokens

    @staticmethod
    def _count_routing(seq: _Sequence, routing: _StepRouting) -> None:
        for layer, counts in routing.tokens_per_expert.items():
            seq.tokens_per_expert[layer] = seq.tokens_per_expert.get(layer, 0) + counts
        seq.rerouted += routing.rerouted
        seq.dropped += routing.dropped
        seq.degraded += routing.degraded
        seq.shed += routing.shed

    def _advance(self, seq: _Sequence, logits: torch.Tensor, sampled: int | None) -> None:
        """Take the step's next token (`sampled` by _forward; a replaying sequence takes its last resumed one)."""
        req = seq.request
        replayed = seq.replaying
        if replayed:
            seq.replaying = False
            token = req.resumed_ids[-1]
            skip_draws(seq.generator, logits.numel(), len(req.resumed_ids))  # the draws the resumed tokens took
        else:
            token = sampled
        seq.generated.append(token)
        seq.next_input = torch.tensor([token], dtype=torch.int64)  # host: step bookkeeping
        finish = None
        if req.eos_token_id is not None and token == req.eos_token_id:
            finish = "eos"
        elif token in req.stop_token_ids:
            finish = "stop"
        if seq.grammar is not None:
            seq.grammar.consume(token)
            if finish is None and seq.grammar.stopped:  # the grammar is complete (or broke): nothing may follow
                finish = "stop"
        decoded = time.perf_counter()
        text, stopped = self._new_text(seq)
        if stopped:
            finish = "stop"
        if finish is None and len(seq.generated) >= req.max_tokens:
            finish = "length"
        if finish in ("length", "eos") or (finish == "stop" and not stopped):
            text += self._flush(seq)
        self.profile.since("post.detokenise", decoded)
        if not replayed:  # a replayed token (and its text) reached the client before the failover
            logprobs = None if req.top_logprobs is None else [token_logprobs(logits, token, req.top_logprobs)]
            seq.events.put_nowait(TokenEvent(token_ids=[token], text=text, logprobs=logprobs))
        if finish is not None:
            seq.events.put_nowait(DoneEvent(
                finish_reason=finish, prompt_tokens=len(req.prompt_ids), completion_tokens=len(seq.generated),
                tokens_per_expert={layer: c.tolist() for layer, c in sorted(seq.tokens_per_expert.items())},
                rerouted=seq.rerouted, dropped=seq.dropped, degraded=seq.degraded, shed=seq.shed,
                cached_tokens=seq.cached_tokens or 0,
            ))
            self.finished_requests += 1
            self._finish(seq)

    def _new_text(self, seq: _Sequence) -> tuple[str, bool]:
        """The text the newest token completed, and whether a stop string ended the generation."""
        if self.decode is None:
            return "", False
        full = self.decode(seq.generated)
        if len(seq.generated) < seq.request.min_tokens:
            # Under min_tokens no stop string ends the generation: the text goes out whole (nothing held back)
            # and a later stop string is only looked for after it.
            if full.endswith("\ufffd"):
                return "", False
            piece = full[len(seq.emitted_text):]
            seq.emitted_text = full
            seq.stop_from = len(full)
            return piece, False
        for stop in seq.request.stop_strings:
            at = full.find(stop, seq.stop_from)
            if at != -1:
                piece = full[len(seq.emitted_text):at] if at >= len(seq.emitted_text) else ""
                seq.emitted_text = full[:at]
                return piece, True
        if full.endswith("\ufffd"):
            return "", False  # half of a multi-byte character: wait for the rest
        # Hold back a tail that could still grow into a stop string, so no part of a stop string is ever streamed.
        safe = len(full) - _stop_prefix_len(full, seq.request.stop_strings)
        piece = full[len(seq.emitted_text):safe] if safe > len(seq.emitted_text) else ""
        seq.emitted_text = full[:max(safe, len(seq.emitted_text))]
        return piece, False

    def _flush(self, seq: _Sequence) -> str:
        """Text held back for a possible stop string that never came: released when the sequence ends."""
        if self.decode is None:
            return ""
        full = self.decode(seq.generated)
        rest = full[len(seq.emitted_text):] if not full.endswith("\ufffd") else ""
        seq.emitted_text += rest
        return rest

    def _finish(self, seq: _Sequence) -> None:
        if seq.cache is not None:
            seq.cache.free()  # free the KV-cache blocks now, not when the client lets go of the stream
        seq.cache = None
        if seq in self._active:
            self._active.remove(seq)


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """logits: [V] -> (log-probability of `token`, the `top` most likely (id, log-probability), best first)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [V]
    values, ids = torch.topk(logprobs, min(top, logprobs.numel()))  # [top]
    return float(logprobs[token]), list(zip(ids.tolist(), values.tolist()))


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def graph_stats(graphs) -> dict:
    """The decoder's CUDA graphs (experts/decode_graphs.py DecodeGraphs, or None when off) as RouterStats fields."""
    if graphs is None:
        return {"cuda_graph_buckets": 0, "cuda_graph_replays": 0, "cuda_graph_captures": 0,
                "cuda_graph_failed_buckets": 0}
    s = graphs.stats()
    return {"cuda_graph_buckets": s["buckets"], "cuda_graph_replays": s["replays"],
            "cuda_graph_captures": s["captures"], "cuda_graph_failed_buckets": len(s["failed"])}
