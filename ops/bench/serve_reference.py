"""What `expertmesh bench serve` compares against: `transformers` `generate` in this process, on the same model, the
same prompts, batch size = stream count, the same number of new tokens (greedy; `min_new_tokens` = `max_new_tokens`,
so every sequence generates exactly that many, as the served streams do with `ignore_eos`).

One batch per request round of the served level (the served level runs `requests_per_stream` requests one after
another on each stream), so both sides produce the same number of tokens; the rate is tokens over wall time, and the
benchmark runs it right before and right after each served level (serve_report.combine_rates).
"""

from __future__ import annotations

import time

import torch


class TransformersReference:
    """The model loaded once (float32, eval) and timed at any batch size."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.model_dir = model_dir
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        config = self.model.config
        self.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0

    def _generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        ids = torch.tensor(prompts, dtype=torch.int64)  # [B, S], equal lengths: no padding
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, do_sample=False, pad_token_id=self.pad_token_id)
        return int(out.shape[0] * (out.shape[1] - ids.shape[1]))  # tokens generated

    def warm_up(self, prompt: list[int]) -> None:
        self._generate([prompt], 4)

    def rate(self, rounds: list[list[list[int]]], max_tokens: int) -> dict:
        """rounds: per request round, the batch's prompts. -> tokens, seconds, tokens/s."""
        return timed_rate(self._generate, rounds, max_tokens)


class EngineReference:
    """expertmesh's own decoder in this process with every expert local (experts/reference.py: the same dense code,
    KV cache and expert math the router and the actors run, no process hop), timed like TransformersReference: the
    served rate's upper bound on this machine, which splits η_serve into engine ÷ transformers (the math) and
    served ÷ engine (what distribution costs)."""

    def __init__(self, model_dir: str):
        from ...experts.reference import load_reference_model

        self.model = load_reference_model(model_dir)

    def _generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        """Greedy, every sequence exactly max_tokens new tokens: one prefill step, then max_tokens - 1 decode steps
        of the whole batch (continuous batching with nobody joining or leaving)."""
        caches = [self.model.new_cache() for _ in prompts]
        try:
            logits = self.model.forward([torch.tensor(p) for p in prompts], caches, logits="last")
            for _ in range(max_tokens - 1):
                logits = self.model.forward([x[-1].argmax().reshape(1) for x in logits], caches, logits="last")
        finally:
            for cache in caches:
                cache.free()
        return len(prompts) * max_tokens

    def warm_up(self, prompt: list[int]) -> None:
        self._generate([prompt], 4)

    def rate(self, rounds: list[list[list[int]]], max_tokens: int) -> dict:
        """As TransformersReference.rate, after one untimed round at this batch size (it runs once per level, not
        before and after every server, so nothing else warms its first steps at a new shape)."""
        self._generate(rounds[0], max_tokens)
        return timed_rate(self._generate, rounds, max_tokens)


def timed_rate(generate, rounds: list[list[list[int]]], max_tokens: int) -> dict:
    """generate(prompts, max_tokens) -> tokens, run once per round: tokens, seconds, tokens/s."""
    started = time.perf_counter()
    tokens = sum(generate(prompts, max_tokens) for prompts in rounds)
    wall = time.perf_counter() - started
    return {"tokens": tokens, "wall_s": round(wall, 4), "tokens_per_s": round(tokens / wall, 3),
            "batch": len(rounds[0]), "rounds": len(rounds), "torch_threads": torch.get_num_threads()}
