"""Errors a user can act on. Each message names the file and the key (or field) at fault."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: unsupported architecture, missing tensor, shape mismatch."""
