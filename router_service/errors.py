"""Errors a caller can act on. Ray-free, so pure modules (sampling, batching, api) can raise them."""


class RequestError(ValueError):
    """Bad input from a caller; `field` names what to fix."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def check_token_ids(token_ids: list[int], vocab_size: int, context: int, field: str = "token_ids") -> list[int]:
    """Non-empty, every id in the vocabulary, within the model's context; the error names `field`."""
    if len(token_ids) == 0:
        raise RequestError(field, "must not be empty")
    bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise RequestError(field, f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    if len(token_ids) > context:
        raise RequestError(field, f"{len(token_ids)} tokens exceed the model's context of {context}")
    return token_ids


def check_budget(prompt_len: int, max_tokens: int, context: int) -> None:
    """max_tokens is a positive integer and prompt + max_tokens fits the context."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise RequestError("max_tokens", f"must be a positive integer, got {max_tokens!r}")
    if prompt_len + max_tokens > context:
        raise RequestError("max_tokens", f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceed the "
                                         f"model's context of {context}")
