"""OpenAI-shaped errors: the status, and {"error": {message, type, param, code}} naming the field. Its own module so
the request parsers (openai_api.py, structured_output.py, tool_calls.py) raise them without importing each other."""

from __future__ import annotations

import re

# gRPC status code names (router_service/proto_mapping.py ApiError.code) -> HTTP status.
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "UNAUTHENTICATED": 401,
               "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503,
               "DEADLINE_EXCEEDED": 504, "INTERNAL": 500}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
              503: "service_unavailable_error", 504: "timeout_error", 500: "server_error"}
_FIELD = re.compile(r"^[A-Za-z_][\w.\[\]]*$")


class OpenAIError(Exception):
    """An error as OpenAI returns it: HTTP status and {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        kind = ERROR_TYPE.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind,
                          "param": self.param, "code": self.code}}

    def __reduce__(self):
        return (OpenAIError, (self.status, self.message, self.param, self.code))


def invalid(param: str | None, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}" if param else message, param=param, code="invalid_value")


def from_status(code: str, message: str) -> OpenAIError:
    """An ApiError (gRPC code name, "field: message") as an OpenAI error; the field becomes `param`."""
    status = HTTP_STATUS.get(code, 500)
    head = message.split(": ", 1)[0]
    param = head if ": " in message and _FIELD.match(head) else None
    error_code = {404: "model_not_found" if param == "model" else "not_found", 429: "rate_limit_exceeded",
                  503: "service_unavailable", 401: "invalid_api_key"}.get(status)
    if status == 400:
        error_code = "invalid_value"
    return OpenAIError(status, message, param=param, code=error_code)
