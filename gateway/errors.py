"""One exception tree, rendered as OpenAI's error envelope {"error": {message, type, param, code}}."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    status_code = 500
    error_type = "server_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code
        self.headers = headers or {}

    def envelope(self) -> dict[str, Any]:
        return error_envelope(self.message, self.error_type, self.param, self.code)


class BadRequest(APIError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(BadRequest):
    default_code = "context_length_exceeded"


class Unauthorized(APIError):
    status_code = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"


class NotFound(APIError):
    status_code = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFound(NotFound):
    default_code = "model_not_found"


class RequestTimeout(APIError):
    status_code = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"


class PayloadTooLarge(APIError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class Overloaded(APIError):
    status_code = 429
    error_type = "rate_limit_error"
    default_code = "queue_full"


class ModelLoading(APIError):
    status_code = 503
    error_type = "server_error"
    default_code = "model_loading"


class ModelLoadFailed(APIError):
    status_code = 503
    error_type = "server_error"
    default_code = "model_load_failed"


class GenerationFailed(APIError):
    status_code = 500
    error_type = "server_error"
    default_code = "generation_failed"


def error_envelope(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
