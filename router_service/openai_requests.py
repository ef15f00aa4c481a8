"""An OpenAIJob (router_service/openai_api.py) -> the batcher's GenerationRequest, and the batcher's events -> the
plain dicts the router deployment streams back to the HTTP front. Pure (no Ray): the deployment passes in its
tokenizer functions and the checkpoint's chat template.

Errors are RequestErrors naming the OpenAI field (`prompt`, `messages`, `max_tokens` / `max_completion_tokens`), so
the HTTP front's 400 carries the field the client sent.
"""

from __future__ import annotations

from collections.abc import Callable

from ..experts.config import MoEModelConfig
from .batching import DoneEvent, GenerationRequest, TokenEvent
from .chat_template import ChatTemplate
from .errors import RequestError, check_budget, check_token_ids
from .openai_api import OpenAIJob
from .proto_mapping import PROMPT_BYTES_PER_TOKEN
from .sampling import SamplingParams


def generation_request(job: OpenAIJob, cfg: MoEModelConfig, encode: Callable[[str], list[int]],
                       encode_rendered: Callable[[str], list[int]], chat_template: ChatTemplate | None
                       ) -> GenerationRequest:
    """encode: a completion prompt's text -> ids (as gRPC Generate tokenizes it); encode_rendered: a rendered chat
    prompt -> ids without the tokenizer adding special tokens (the template wrote them, as transformers does)."""
    context = cfg.max_position_embeddings
    field = job.prompt_param
    if job.kind == "chat":
        if chat_template is None:
            raise RequestError("messages", "this model's checkpoint has no chat template (tokenizer_config.json "
                                           "chat_template); use /v1/completions with a prompt")
        text = chat_template.render(list(job.messages), add_generation_prompt=True)
        _check_size(text, context, field)
        ids = encode_rendered(text)
    elif job.prompt is not None:
        _check_size(job.prompt, context, field)
        ids = encode(job.prompt)
    else:
        ids = list(job.prompt_ids)
    if not ids:
        raise RequestError(field, "encodes to no tokens")
    check_token_ids(ids, cfg.vocab_size, context, field)
    max_tokens = job.max_tokens
    if max_tokens is None:  # chat without a limit: what the context leaves
        max_tokens = context - len(ids)
        if max_tokens < 1:
            raise RequestError(field, f"{len(ids)} tokens fill the model's context of {context}")
    try:
        check_budget(len(ids), max_tokens, context)
    except RequestError as exc:
        raise RequestError(job.max_tokens_param, str(exc).split(": ", 1)[1]) from None
    sampling = SamplingParams(temperature=job.temperature, top_p=job.top_p, seed=job.seed).validate()
    return GenerationRequest(prompt_ids=ids, max_tokens=max_tokens, sampling=sampling, stop_strings=job.stop,
                             eos_token_id=cfg.eos_token_id, top_logprobs=job.top_logprobs)


def _check_size(text: str, context: int, field: str) -> None:
    """Refuse text that cannot fit the context from its size alone, before tokenizing it (as gRPC's prompt)."""
    limit = context * PROMPT_BYTES_PER_TOKEN
    size = len(text) if len(text) > limit else len(text.encode("utf-8", "replace"))
    if size > limit:
        raise RequestError(field, f"{size} bytes cannot fit the model's context of {context} tokens")


def event_dict(event: TokenEvent | DoneEvent, token_text: Callable[[int], str]) -> dict:
    """One batcher event as plain data: {"token": {ids, text, logprobs}} or {"done": {...}}."""
    if isinstance(event, DoneEvent):
        return {"done": {"finish_reason": event.finish_reason, "prompt_tokens": event.prompt_tokens,
                         "completion_tokens": event.completion_tokens,
                         "tokens_per_expert": {int(k): list(v) for k, v in event.tokens_per_expert.items()},
                         "rerouted": event.rerouted, "degraded": event.degraded, "dropped": event.dropped,
                         "shed": event.shed}}
    logprobs = None
    if event.logprobs is not None:
        logprobs = [{"token": token_text(token), "logprob": chosen,
                     "top": [[token_text(t), lp] for t, lp in top]}
                    for token, (chosen, top) in zip(event.token_ids, event.logprobs)]
    return {"token": {"ids": list(event.token_ids), "text": event.text, "logprobs": logprobs}}
