"""How a router replica logs refused requests (router_service/error_log.py): one line per client error, rate-limited,
no traceback; Serve's own traceback for an ApiError dropped, its access lines kept off stderr, everything else kept."""

from __future__ import annotations

import logging
import sys

from expertmesh.router_service.error_log import ClientErrorLog, QuietClientErrors
from expertmesh.router_service.log_limit import LogRateLimit
from expertmesh.router_service.proto_mapping import ApiError


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def logger_with(name: str, *filters: logging.Filter) -> tuple[logging.Logger, Lines]:
    logger = logging.getLogger(name)
    logger.handlers.clear()
    logger.filters.clear()
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    lines = Lines()
    logger.addHandler(lines)
    for f in filters:
        logger.addFilter(f)
    return logger, lines


def exc_info(exc: BaseException):
    try:
        raise exc
    except BaseException:
        return sys.exc_info()


def test_serves_traceback_for_an_api_error_is_dropped_and_other_records_kept():
    logger, lines = logger_with("test.serve.quiet", QuietClientErrors())

    class Wrapped(Exception):  # Serve's gRPCStatusError keeps the user's exception as original_exception
        def __init__(self, original):
            super().__init__("wrapped")
            self.original_exception = original

    logger.error("Request failed.", exc_info=exc_info(ApiError("NOT_FOUND", "model: unknown")))
    logger.error("Request failed.", exc_info=exc_info(Wrapped(ApiError("INVALID_ARGUMENT", "prompt: empty"))))
    logger.error("Request failed.", exc_info=exc_info(RuntimeError("a bug of ours")))
    logger.info("CALL Score OK 3ms", extra={"serve_access_log": True})
    logger.info("replica started")
    assert [r.getMessage() for r in lines.records] == ["Request failed.", "CALL Score OK 3ms", "replica started"]
    assert lines.records[0].exc_info[0] is RuntimeError  # our own fault keeps its traceback
    assert lines.records[1].log_to_stderr is False  # Serve's stderr handler skips it; its file handler does not
    assert not hasattr(lines.records[2], "log_to_stderr")


def test_client_errors_are_one_line_each_rate_limited_by_code():
    logger, lines = logger_with("test.serve.errors")
    errors = ClientErrorLog(LogRateLimit(burst=2, window_s=3600), logger)
    for _ in range(50):
        errors.log("Score", ApiError("NOT_FOUND", "model: unknown model 'x'"))
    errors.log("Generate", ApiError("RESOURCE_EXHAUSTED", "server busy"))
    errors.log("Generate", ApiError("INTERNAL", "internal error (KeyError)"))  # logged with its traceback elsewhere
    got = [(r.levelno, r.getMessage()) for r in lines.records]
    assert got == [(logging.INFO, "Score NOT_FOUND: model: unknown model 'x'")] * 2 + [
        (logging.WARNING, "Generate RESOURCE_EXHAUSTED: server busy")]
    assert all(r.exc_info is None for r in lines.records)


def test_an_error_is_logged_once_and_a_long_message_is_cut():
    logger, lines = logger_with("test.serve.once")
    errors = ClientErrorLog(LogRateLimit(), logger)
    error = ApiError("INVALID_ARGUMENT", "prompt: " + "x" * 10_000)
    errors.log("Generate", error)
    errors.log("Generate", error)  # re-raised through a second handler
    assert len(lines.records) == 1 and len(lines.records[0].getMessage()) < 400
