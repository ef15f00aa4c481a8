"""Errors a caller can act on. Ray-free, so pure modules (sampling, batching, api) can raise them."""


class RequestError(ValueError):
    """Bad input from a caller; `field` names what to fix."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
