"""An OpenAIJob (router_service/openai_api.py) -> the batcher's GenerationRequests (one per prompt and candidate),
the echoed prompt's log-probabilities, best_of's selection, and the batcher's events -> the plain dicts the router
deployment streams back to the HTTP front (their shapes: router_service/openai_responses.py). Pure (no Ray): the
deployment passes in its tokenizer functions and the checkpoint's chat template.

Errors are RequestErrors naming the OpenAI field (`prompt`, `messages`, `max_tokens` / `max_completion_tokens`,
`logit_bias`, `stop_token_ids`), so the HTTP front's 400 carries the field the client sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..experts.config import MoEModelConfig
from . import tool_calls
from .batching import DoneEvent, GenerationRequest, TokenEvent
from .chat_template import ChatTemplate
from .errors import RequestError, check_budget, check_token_ids
from .grammar_mask import TokenGrammar
from .openai_api import OpenAIError, OpenAIJob
from .proto_mapping import PROMPT_BYTES_PER_TOKEN
from .sampling import SamplingParams


@dataclass(frozen=True)
class Plan:
    """What one job runs: per prompt its ids (and text to echo, None: decode the ids), and the GenerationRequests,
    prompt-major (prompt p's candidate j is requests[p × candidates + j])."""

    prompt_ids: list[list[int]]
    prompt_texts: list[str | None]
    requests: list[GenerationRequest]
    tool_family: str | None = None  # chat with tools: the syntax the model writes calls in (tool_calls.py)


def plan(job: OpenAIJob, cfg: MoEModelConfig, encode: Callable[[str], list[int]],
         encode_rendered: Callable[[str], list[int]], chat_template: ChatTemplate | None,
         grammar_tokenizer: Callable[[], object] | None = None,
         special_tokens: Callable[[], dict[str, int]] | None = None) -> Plan:
    """encode: a completion prompt's text -> ids (as gRPC Generate tokenizes it); encode_rendered: a rendered chat
    prompt -> ids without the tokenizer adding special tokens (the template wrote them, as transformers does);
    grammar_tokenizer(): llguidance's tokenizer of the model (grammar_mask.grammar_tokenizer), asked for only when
    the job has an output constraint (None: the checkpoint has no tokenizer, constraints are refused);
    special_tokens(): the tokenizer's special tokens (text -> id), for a forced tool call's grammar."""
    if job.kind == "chat":
        if chat_template is None:
            raise RequestError("messages", "this model's checkpoint has no chat template (tokenizer_config.json "
                                           "chat_template); use /v1/completions with a prompt")
        tool_family = None
        if job.tools is not None:
            tool_family = tool_calls.family_of(chat_template.source)
            if job.tools.forced:  # the call in this model's syntax, its markers as this tokenizer has them
                specials = special_tokens() if special_tokens is not None else {}
                try:
                    job = replace(job, constraint=tool_calls.forced_grammar(job.tools, tool_family, specials))
                except OpenAIError as exc:
                    raise RequestError("tools", exc.message.split(": ", 1)[-1]) from None
        text = chat_template.render(list(job.messages), add_generation_prompt=True,
                                    tools=list(job.tools.tools) if job.tools is not None else None)
        _check_size(text, cfg.max_position_embeddings, "messages")
        prompts, texts = [encode_rendered(text)], [None]
        fields = ["messages"]
    else:
        prompts, texts, fields, tool_family = [], [], [], None
        for i, prompt in enumerate(job.prompts):
            field = "prompt" if len(job.prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                _check_size(prompt, cfg.max_position_embeddings, field)
                prompts.append(encode(prompt))
                texts.append(prompt)
            else:
                prompts.append(list(prompt))
                texts.append(None)
            fields.append(field)
    sampling = _sampling(job, cfg)
    stop_ids = frozenset(job.stop_token_ids)
    bad = [t for t in stop_ids if t >= cfg.vocab_size]
    if bad:
        raise RequestError("stop_token_ids", f"token id {min(bad)} is outside the vocabulary of {cfg.vocab_size}")
    # best_of ranks candidates by their cumulative logprob: each reports its chosen tokens' logprobs.
    top = job.top_logprobs if job.top_logprobs is not None or job.best_of is None else 0
    grammar = _grammar(job, grammar_tokenizer)
    requests = []
    for ids, field in zip(prompts, fields):
        max_tokens = _max_tokens(job, ids, cfg, field)
        for j in range(job.candidates):
            # Choice j of a seeded request samples with seed + j: reproducible, and the choices differ.
            seeded = sampling if sampling.seed is None or j == 0 else _with_seed(sampling, (sampling.seed + j) % 2**63)
            requests.append(GenerationRequest(
                prompt_ids=ids, max_tokens=max_tokens, sampling=seeded, stop_token_ids=stop_ids,
                stop_strings=job.stop, eos_token_id=None if job.ignore_eos else cfg.eos_token_id,
                top_logprobs=top, min_tokens=job.min_tokens, grammar=grammar))
    if job.resumed:
        requests = _resumed(job, requests, cfg.vocab_size)
    return Plan(prompt_ids=prompts, prompt_texts=texts, requests=requests, tool_family=tool_family)


def _resumed(job: OpenAIJob, requests: list[GenerationRequest], vocab_size: int) -> list[GenerationRequest]:
    """A job re-sent after failover (router_service/openai_continuation.py): each choice continues after the token
    ids its client already has. Only without best_of (choice index = request index); the front never sends more."""
    if job.best_of is not None or len(job.resumed) != len(requests):
        raise RequestError("resumed", f"{len(job.resumed)} resumed choices for {len(requests)} sequences"
                                      + (" (best_of cannot resume)" if job.best_of is not None else ""))
    out = []
    for request, ids in zip(requests, job.resumed):
        if len(ids) > request.max_tokens:
            raise RequestError("resumed", f"{len(ids)} tokens already streamed exceed max_tokens "
                                          f"({request.max_tokens})")
        if any(not 0 <= t < vocab_size for t in ids):
            raise RequestError("resumed", "a resumed token id is outside the vocabulary")
        out.append(replace(request, resumed_ids=tuple(ids)) if ids else request)
    return out


def _grammar(job: OpenAIJob, grammar_tokenizer: Callable[[], object] | None) -> TokenGrammar | None:
    constraint = job.constraint
    if constraint is None:
        return None
    if grammar_tokenizer is None:
        raise RequestError(constraint.param, "needs the model's tokenizer (tokenizer.json), which this checkpoint "
                                             "does not have")
    grammar = TokenGrammar(grammar_tokenizer(), constraint.grammar, constraint.param)
    grammar.start()  # compile once here (off the event loop) so a grammar this tokenizer cannot serve is a 400
    return grammar


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return replace(params, seed=seed)


def _sampling(job: OpenAIJob, cfg: MoEModelConfig) -> SamplingParams:
    return SamplingParams(
        temperature=job.temperature, top_p=job.top_p, top_k=job.top_k, seed=job.seed,
        presence_penalty=job.presence_penalty, frequency_penalty=job.frequency_penalty,
        repetition_penalty=job.repetition_penalty, logit_bias=job.logit_bias,
    ).validate(vocab_size=cfg.vocab_size)


def _max_tokens(job: OpenAIJob, ids: list[int], cfg: MoEModelConfig, field: str) -> int:
    context = cfg.max_position_embeddings
    if not ids:
        raise RequestError(field, "encodes to no tokens")
    check_token_ids(ids, cfg.vocab_size, context, field)
    max_tokens = job.max_tokens
    if max_tokens is None:  # chat without a limit: what the context leaves
        max_tokens = context - len(ids)
        if max_tokens < 1:
            raise RequestError(field, f"{len(ids)} tokens fill the model's context of {context}")
    if max_tokens == 0:  # echo alone (the parser allows 0 only with echo): nothing generated
        return 0
    try:
        check_budget(len(ids), max_tokens, context)
    except RequestError as exc:
        raise RequestError(job.max_tokens_param, str(exc).split(": ", 1)[1]) from None
    return max_tokens


def _check_size(text: str, context: int, field: str) -> None:
    """Refuse text that cannot fit the context from its size alone, before tokenizing it (as gRPC's prompt)."""
    limit = context * PROMPT_BYTES_PER_TOKEN
    size = len(text) if len(text) > limit else len(text.encode("utf-8", "replace"))
    if size > limit:
        raise RequestError(field, f"{size} bytes cannot fit the model's context of {context} tokens")


def prompt_logprobs(logits: torch.Tensor, ids: list[int], top: int
                    ) -> list[tuple[float | None, list[tuple[int, float]] | None]]:
    """Score's logits [S, V] of a prompt of S tokens -> per position (log-probability of that token given the ones
    before it, the `top` most likely (id, log-probability)); the first position has none (None, None). One device
    read for the whole prompt."""
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)  # [S-1, V]: position i predicts token i + 1
    following = torch.tensor(ids[1:], dtype=torch.int64, device=logprobs.device)  # [S-1]
    chosen = logprobs.gather(1, following[:, None])[:, 0]  # [S-1]
    values, top_ids = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1)  # [S-1, top]
    chosen_l, values_l, ids_l = chosen.tolist(), values.tolist(), top_ids.tolist()
    return [(None, None)] + [(c, list(zip(i, v))) for c, i, v in zip(chosen_l, ids_l, values_l)]


def echo_dict(index: int, text: str, ids: list[int], scored: list | None, token_text: Callable[[int], str]) -> dict:
    """The echo event of one choice: its prompt's text and (when logprobs were asked) per-token log-probabilities."""
    entries = None
    if scored is not None:
        entries = [{"token": token_text(t), "logprob": lp,
                    "top": None if top is None else [[token_text(i), v] for i, v in top]}
                   for t, (lp, top) in zip(ids, scored)]
    return {"echo": {"index": index, "text": text, "logprobs": entries, "prompt_tokens": len(ids)}}


def empty_done(index: int, prompt_tokens: int) -> dict:
    """The done event of a choice that generates nothing (echo with max_tokens = 0)."""
    return {"done": {"index": index, "finish_reason": "length", "prompt_tokens": prompt_tokens,
                     "completion_tokens": 0, "tokens_per_expert": {}, "rerouted": 0, "degraded": 0, "dropped": 0,
                     "shed": 0, "cached_tokens": 0}}


def cumulative_logprob(events: list[dict]) -> float:
    """Sum of a candidate's chosen tokens' log-probabilities (its token events' logprobs)."""
    return sum(e["logprob"] for ev in events if "token" in ev for e in (ev["token"].get("logprobs") or []))


def best_of(candidates: list[list[dict]], n: int, keep_logprobs: bool) -> list[list[dict]]:
    """best_of: the n candidates (each its list of events) with the highest cumulative logprob, best first (ties: the
    earlier candidate), their logprobs dropped unless the client asked for them."""
    order = sorted(range(len(candidates)), key=lambda i: (-cumulative_logprob(candidates[i]), i))[:n]
    chosen = [candidates[i] for i in order]
    if keep_logprobs:
        return chosen
    return [[{"token": ev["token"] | {"logprobs": None}} if "token" in ev else ev for ev in events]
            for events in chosen]


def with_index(event: dict, index: int) -> dict:
    kind, body = next(iter(event.items()))
    return {kind: body | {"index": index}}


def event_dict(event: TokenEvent | DoneEvent, token_text: Callable[[int], str], index: int = 0,
               prompt_tokens: int | None = None) -> dict:
    """One batcher event as plain data: {"token": {index, ids, text, logprobs, prompt_tokens}} or {"done": {...}}."""
    if isinstance(event, DoneEvent):
        return {"done": {"index": index, "finish_reason": event.finish_reason, "prompt_tokens": event.prompt_tokens,
                         "completion_tokens": event.completion_tokens,
                         "tokens_per_expert": {int(k): list(v) for k, v in event.tokens_per_expert.items()},
                         "rerouted": event.rerouted, "degraded": event.degraded, "dropped": event.dropped,
                         "shed": event.shed, "cached_tokens": event.cached_tokens}}
    logprobs = None
    if event.logprobs is not None:
        logprobs = [{"token": token_text(token), "logprob": chosen,
                     "top": [[token_text(t), lp] for t, lp in top]}
                    for token, (chosen, top) in zip(event.token_ids, event.logprobs)]
    token = {"index": index, "ids": list(event.token_ids), "text": event.text, "logprobs": logprobs}
    if prompt_tokens is not None:
        token["prompt_tokens"] = prompt_tokens
    return {"token": token}
