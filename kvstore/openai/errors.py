"""HTTP errors in vLLM's (and OpenAI's) shape: ``{"error": {"message", "type", "param", "code"}}``.

The ``type`` names follow vLLM's server (``BadRequestError``,
``NotFoundError``, ...), so a client that branches on them behaves the same
in front of kvstore as in front of vLLM; ``param`` names the offending
field wherever there is one.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    429: "TooManyRequestsError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class ApiError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or _TYPES.get(status) or _phrase(status)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def _phrase(status: int) -> str:
    """The type of an error with no name of vLLM's own: its HTTP reason phrase ("Method Not Allowed"), as
    vLLM's server types the framework's HTTP errors."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "BadRequestError" if status < 500 else "InternalServerError"


def model_not_found(model: str) -> ApiError:
    """vLLM's answer to a request naming a model it does not serve."""
    return ApiError(404, f"The model `{model}` does not exist.", param="model")
