"""How a router replica logs a failed request: a client's error is one rate-limited line, only our own faults
(INTERNAL) carry a traceback.

Ray Serve logs every exception a deployment method raises as "Request failed." with a full traceback at ERROR, plus
an access line per call, on the replica's stderr (which Ray forwards to the driver's, i.e. `expertmesh serve`'s).
A client sending bad requests, or an overload answered with RESOURCE_EXHAUSTED, flooded the log with tracebacks.
`quiet_serve_request_logs()` puts a filter on Serve's replica logger that drops those records for ApiErrors (the
deployment logs them itself, through `ClientErrorLog`) and keeps access lines out of stderr; they stay in Serve's
replica log file (`<ray session>/logs/serve/replica_*.log`). Pure standard-library logging; no Ray import.
"""

from __future__ import annotations

import logging

from .log_limit import LogRateLimit
from .proto_mapping import ApiError

SERVE_LOGGER = "ray.serve"  # Serve's logger in a replica: its file and stderr handlers, and Serve's line format
MAX_LINE_CHARS = 300
# Codes that say something about the server (full, or an expert missing) rather than about the request.
OPERATOR_CODES = frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE"})


def _api_error(exc: BaseException | None) -> ApiError | None:
    """The ApiError in `exc`, also when Serve wrapped it (gRPCStatusError.original_exception, or a cause)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ApiError):
            return exc
        exc = getattr(exc, "original_exception", None) or exc.__cause__
        seen += 1
    return None


class QuietClientErrors(logging.Filter):
    """On Serve's replica logger: drop Serve's traceback for an ApiError, keep access lines off stderr."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and _api_error(record.exc_info[1]) is not None:
            return False  # ClientErrorLog wrote its one line (or, for INTERNAL, the original traceback)
        if getattr(record, "serve_access_log", False):
            record.log_to_stderr = False  # Serve's own stderr handler honours this; the file handler still writes
        return True


def quiet_serve_request_logs() -> None:
    logger = logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(f, QuietClientErrors) for f in logger.filters):
        logger.addFilter(QuietClientErrors())


class ClientErrorLog:
    """One line per failed request, at most `limit.burst` per (method, error code) per window; INFO for the caller's own
    mistakes, WARNING for what an operator should see (overload, lost experts). INTERNAL is not logged here: the
    deployment logs those with their traceback where it catches them."""

    def __init__(self, limit: LogRateLimit | None = None, logger: logging.Logger | None = None):
        self.limit = limit or LogRateLimit()
        self.logger = logger or logging.getLogger(SERVE_LOGGER)

    def log(self, method: str, error: ApiError) -> None:
        """Log `error` once: an error re-raised through a second handler (authorization inside a method) is not
        logged again."""
        if error.code == "INTERNAL" or getattr(error, "logged", False):
            return
        error.logged = True
        dropped = self.limit.admit((method, error.code))  # a flood of one kind never hides another
        if dropped is None:
            return
        message = error.message if len(error.message) <= MAX_LINE_CHARS else error.message[:MAX_LINE_CHARS] + "…"
        tail = f" ({dropped} more {method} {error.code} lines dropped)" if dropped else ""
        level = logging.WARNING if error.code in OPERATOR_CODES else logging.INFO
        self.logger.log(level, "%s %s: %s%s", method, error.code, message, tail)
