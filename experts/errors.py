"""Errors a user can act on. Each message names the file and the key (or field) at fault."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: unsupported architecture, missing tensor, shape mismatch."""


class ConfigError(ValueError):
    """A setting that cannot be used; `field` is its dotted path in the configuration tree ("router.transport")."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
