"""The `ApiError` family: the only way the API process reports a failed request.

The HTTP server turns each into a status code and the OpenAI error envelope
(`ErrorResponse`, `{"error": {"message", "type", "param", "code"}}`) in one place;
request models, limits and the tokenizer manager raise them.
"""

from __future__ import annotations

from typing import Optional, Union

from pydantic import BaseModel


class ApiError(Exception):
    """A request that failed; `status_code` and `param` go straight into the response."""

    status_code = 500
    err_type = "server_error"

    def __init__(self, message: str, param: Optional[str] = None, code: Union[int, str, None] = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = self.status_code if code is None else code


class BadRequestError(ApiError):
    status_code = 400
    err_type = "invalid_request_error"


class NotFoundError(ApiError):
    status_code = 404
    err_type = "invalid_request_error"


class ServiceUnavailableError(ApiError):
    status_code = 503
    err_type = "service_unavailable"


class ClientDisconnectedError(ApiError):
    """The client went away before its answer was ready (nobody reads the response)."""

    status_code = 499
    err_type = "client_disconnected"


def error_for_status(status_code: int, message: str) -> ApiError:
    """The ApiError for a status the scheduler attached to an aborted request."""
    cls = {400: BadRequestError, 404: NotFoundError, 503: ServiceUnavailableError}.get(status_code, ApiError)
    return cls(message)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Union[int, str, None] = None


class ErrorResponse(BaseModel):
    """The nested OpenAI error envelope, used by every route (401 excepted)."""

    error: ErrorDetail

    @classmethod
    def of(cls, err: ApiError) -> "ErrorResponse":
        return cls(error=ErrorDetail(message=err.message, type=err.err_type, param=err.param, code=err.code))
