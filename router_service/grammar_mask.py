"""Per-step token masks from an llguidance grammar (router_service/structured_output.py builds the grammar). No Ray.

A constrained sequence owns a `GrammarState` (an llguidance matcher over the model's tokenizer). Each step the
batcher asks it for the allowed tokens (a bitmask llguidance computes on the host, one bit per token), applies them
to the sequence's logits on the logits' device (`mask_logits`) before greedy / sampling, and feeds the chosen token
back (`consume`). The sequence ends when the grammar forces the end (`stopped`) or the model picks eos while the
grammar accepts (llguidance allows eos only then).

Devices (experts/device_rule.py): the bitmask is host bytes; it crosses to the logits' device once per step and is
unpacked there, so no device tensor is read back for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from llguidance import LLMatcher, LLTokenizer

from .errors import RequestError

_BITS = torch.arange(8, dtype=torch.uint8)  # host; moved to the logits' device in mask_logits


def grammar_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_id: int | None) -> LLTokenizer:
    """llguidance's view of the checkpoint's tokenizer (its tokenizer.json text), sized to the model's vocabulary
    (a model may have more logits than its tokenizer has tokens: those are never allowed). ~1 s: build once."""
    return LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id)


@dataclass(frozen=True)
class TokenGrammar:
    """A grammar bound to a tokenizer: what a GenerationRequest carries; each sequence starts its own state."""

    tokenizer: LLTokenizer
    grammar: str
    param: str = "response_format"  # the request field it came from, for errors

    def start(self) -> GrammarState:
        matcher = LLMatcher(self.tokenizer, self.grammar)
        if matcher.is_error():
            raise RequestError(self.param, f"cannot be compiled for this model's tokenizer: "
                                           f"{matcher.get_error()[:300]}")
        return GrammarState(matcher, self.param)


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: LLMatcher, param: str):
        self.matcher = matcher
        self.param = param

    def bitmask(self) -> bytes:
        """The tokens allowed next: bit t of the little-endian bytes is token t."""
        return self.matcher.compute_bitmask()

    def consume(self, token: int) -> None:
        """Advance past the chosen token. A token the mask forbade (cannot happen: the mask chose it) or the
        grammar's own limits put the matcher in an error state: the sequence is then `stopped`."""
        self.matcher.consume_token(token)

    def consume_all(self, tokens: list[int]) -> None:
        if tokens:
            self.matcher.consume_tokens(tokens)

    @property
    def stopped(self) -> bool:
        """The grammar allows nothing more (complete, or in error): the sequence ends."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


def allowed(bitmask: bytes, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bitmask bytes (bit t of byte t // 8, little-endian) -> bool [vocab_size] on `device`; tokens past the mask's
    end are not allowed."""
    raw = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8)  # host; [ceil(n / 8)]
    raw = raw.to(device)
    bits = ((raw[:, None] >> _BITS.to(device)) & 1).reshape(-1).bool()  # [8 × bytes]
    if bits.numel() >= vocab_size:
        return bits[:vocab_size]
    return torch.cat([bits, torch.zeros(vocab_size - bits.numel(), dtype=torch.bool, device=device)])


def mask_logits(logits: torch.Tensor, bitmask: bytes) -> torch.Tensor:
    """logits: [V] -> [V] on the same device, -inf where the grammar forbids the token (input not modified)."""
    keep = allowed(bitmask, logits.numel(), logits.device)  # [V]
    return logits.masked_fill(~keep, float("-inf"))
