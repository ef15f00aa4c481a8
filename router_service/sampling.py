"""Next-token choice: greedy, or temperature / top-k / top-p sampling with a per-request seed. Pure torch.

A sampled step draws exactly one exponential variate per vocabulary entry from the request's generator, whatever
the distribution, so the generator's state after k steps is known without the logits of those steps: a request
resumed after k tokens (router failover, router_service/continuation.py) skips k × vocabulary draws and samples the
same tokens as the uninterrupted run.

Devices (experts/device_rule.py): the generator lives on the logits' device (a CPU generator cannot drive a CUDA
draw), and the choice stays a device tensor until `sample_tokens` reads every sequence's choice of a step at once:
one device read per step, not one per sequence. A seed gives the same tokens on every run on the same kind of
device, and after a resume on another replica of that kind; CPU and CUDA generators are different algorithms
(mt19937 and Philox), so the same seed samples different tokens on a CPU router and a GPU router.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import RequestError

MAX_REPETITION_PENALTY = 2.0  # our bound (CTRL's paper uses 1.2); far above it the text only degenerates


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    presence_penalty: float = 0.0  # [-2, 2]: subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # [-2, 2]: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0; 1 = off: divides (or multiplies, if ≤ 0) logits of prompt+output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError("temperature", f"must be finite and ≥ 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise RequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError("top_k", f"must be ≥ 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError("seed", f"must be in [0, 2^63), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise RequestError(name, f"must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise RequestError("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), got "
                                                     f"{self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if vocab_size is not None and not 0 <= token < vocab_size:
                raise RequestError("logit_bias", f"token id {token} is outside the vocabulary of {vocab_size}")
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise RequestError("logit_bias", f"bias of token {token} must be in [-100, 100], got {bias}")
        return self

    @property
    def adjusts_logits(self) -> bool:
        """Whether any logit rule is on (otherwise the logits are used as the model gave them)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """The request's generator on `device` (where its logits are), or None for greedy decoding."""
        if self.greedy:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed if self.seed is not None else torch.seed())
        return gen


def adjust_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                  suppress_ids: frozenset[int] | set[int] = frozenset()) -> torch.Tensor:
    """logits: [V] -> [V] on the same device with the request's logit rules applied (the input is not modified).

    prompt_ids / output_ids: host lists of the prompt's and the generated tokens (the repetition penalty sees both,
    presence/frequency only the output); suppress_ids: tokens set to -inf (eos and stop ids before min_tokens).
    """
    if not params.adjusts_logits and not suppress_ids:
        return logits
    device, vocab = logits.device, logits.numel()
    out = logits.clone()  # [V]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64, device=device)  # [B]
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype, device=device)  # [B]
        out.index_add_(0, ids, bias)
    if suppress_ids:
        out.index_fill_(0, torch.tensor(sorted(suppress_ids), dtype=torch.int64, device=device), float("-inf"))
    if params.repetition_penalty != 1.0:
        seen_ids = torch.tensor(list(prompt_ids) + list(output_ids), dtype=torch.int64, device=device)  # [P+O]
        seen = torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, seen_ids, True)  # [V]
        penalty = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        generated = torch.tensor(list(output_ids), dtype=torch.int64, device=device)  # [O]
        counts = torch.zeros(vocab, dtype=out.dtype, device=device).index_add_(
            0, generated, torch.ones(generated.numel(), dtype=out.dtype, device=device))  # [V]
        out = out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(out.dtype)
    return out


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """logits: [V] float32 -> the next token id (one device read; `sample_tokens` reads a whole step's at once)."""
    return int(choose(logits, params, generator))


def sample_tokens(logits: list[torch.Tensor], params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> list[int]:
    """A step's next tokens: per sequence logits [V] (on one device), its sampling and generator -> token ids, with
    one device read for them all."""
    if not logits:
        return []
    return torch.stack([choose(x, p, g) for x, p, g in zip(logits, params, generators)]).tolist()


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: [V] float32 -> the next token id as a 0-dim int64 tensor on the logits' device (not read)."""
    if params.greedy:
        return torch.argmax(logits)
    # Shift so the best logit is 0 before dividing, in float64: a tiny temperature then sends the others to -inf
    # (greedy in the limit) instead of overflowing to inf and making softmax NaN.
    logits = logits.double()
    scaled = (logits - logits.max()) / params.temperature  # [V], ≤ 0
    if params.top_k and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p  # [V] in sorted order
        drop[0] = False
        # Back to vocabulary order with a scatter: indexing with the mask would read the device (a nonzero count).
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [V]
    # torch.multinomial(probs, 1) spelled out (the exponential race: argmax p / q with q ~ Exp(1)), the same tokens
    # from the same generator, written here so the number of draws per step is ours to rely on (skip_draws).
    race = torch.empty_like(probs).exponential_(generator=generator)  # [V]
    return torch.argmax(probs / race)


def skip_draws(generator: torch.Generator | None, vocab_size: int, steps: int) -> None:
    """Advance `generator` past `steps` sampled steps over a vocabulary of `vocab_size`, as sample_next would."""
    if generator is None or steps <= 0:
        return
    # sample_next's probabilities are float64, on the generator's device
    scratch = torch.empty(vocab_size, dtype=torch.float64, device=generator.device)
    for _ in range(steps):
        scratch.exponential_(generator=generator)
