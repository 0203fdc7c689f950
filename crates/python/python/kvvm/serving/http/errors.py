"""Errors of the HTTP server in OpenAI's shape: ``{"error": {"message", "type", "param",
"code"}}`` with the status a client acts on (``docs/server.md``, errors)."""

from __future__ import annotations

import math

from starlette.responses import JSONResponse

__all__ = ["ApiError", "error_response"]


class ApiError(Exception):
    """An error answered to the client (never a 5xx for something the client can fix).

    Attributes:
        status: the HTTP status.
        message: what is wrong, for a person.
        type: OpenAI's error type (``invalid_request_error``, ``authentication_error``, ...).
        code: a machine-readable code (``model_not_found``, ``context_length_exceeded``, ...).
        param: the request field at fault, if one is.
        retry_after: seconds, sent as ``Retry-After`` (429 and 503).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict[str, object]:
        """The error as OpenAI's API writes one: ``{"error": {message, type, param, code}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(e: ApiError) -> JSONResponse:
    """The JSON response of ``e``, with ``Retry-After`` (whole seconds, at least 1) and
    ``WWW-Authenticate`` where they belong."""
    headers = {}
    if e.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(e.retry_after)))
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 ``invalid_request_error``."""
    return ApiError(400, message, param=param, code=code)
