"""One exception tree, rendered as OpenAI's error envelope {"error": {message, type, param, code}}."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson
from starlette.types import Send


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


class UnsupportedMediaType(APIError):
    status_code = 415
    error_type = "invalid_request_error"
    default_code = "unsupported_media_type"


class MisdirectedRequest(APIError):
    status_code = 421
    error_type = "invalid_request_error"
    default_code = "invalid_host"


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


class ShuttingDown(APIError):
    """The shutdown grace period ran out before the request finished."""

    status_code = 503
    error_type = "server_error"
    default_code = "shutting_down"


class CacheFilesLeft(APIError):
    """A cache removal the disk refused (a read-only cache dir, an immutable file): what is in RAM
    went, the files stay and would be read again."""

    status_code = 500
    error_type = "server_error"
    default_code = "cache_files_not_removed"


class GenerationFailed(APIError):
    status_code = 500
    error_type = "server_error"
    default_code = "generation_failed"


class BadGateway(APIError):
    """Proxy mode: the upstreams answered, with errors (or broke off their answer)."""

    status_code = 502
    error_type = "server_error"
    default_code = "upstream_error"


class UpstreamUnavailable(APIError):
    """Proxy mode: no upstream could be reached."""

    status_code = 503
    error_type = "server_error"
    default_code = "upstream_unavailable"


def error_envelope(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


async def send_error(send: Send, error: APIError, extra_headers: Iterable[tuple[bytes, bytes]] = (),
                     body: dict[str, Any] | None = None) -> None:
    """Answer with `error` from ASGI middleware, which runs outside FastAPI's exception handlers
    (`body`: the envelope, when not OpenAI's)."""
    payload = orjson.dumps(error.envelope() if body is None else body)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in error.headers.items()), *extra_headers]
    await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
