"""One exception type per failure, each mapped to exactly one HTTP status.

The ingress turns any :class:`SeekserveError` into an OpenAI-shaped body
``{"error": {"message", "type", "param", "code"}}``. The exceptions cross Ray
actor boundaries (replica -> ingress), so they must pickle with their fields:
``__reduce__`` rebuilds them from keyword arguments.
"""

from __future__ import annotations

from typing import Any


class SeekserveError(Exception):
    status_code: int = 500
    # grpc.StatusCode member name for the gRPC front end
    grpc_status: str = "INTERNAL"
    error_type: str = "internal_error"
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code

    def __reduce__(self):
        return (_rebuild, (type(self), self.message, self._extra()))

    def _extra(self) -> dict[str, Any]:
        return {"param": self.param, "code": self.code}

    def to_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {}


def _rebuild(cls, message, extra):
    return cls(message, **extra)


class InvalidRequestError(SeekserveError):
    status_code = 400
    grpc_status = "INVALID_ARGUMENT"
    error_type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    default_code = "context_length_exceeded"


class UnauthorizedError(SeekserveError):
    status_code = 401
    grpc_status = "UNAUTHENTICATED"
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class ForbiddenError(SeekserveError):
    status_code = 403
    grpc_status = "PERMISSION_DENIED"
    error_type = "permission_error"
    default_code = "forbidden"


class ModelNotFoundError(SeekserveError):
    status_code = 404
    grpc_status = "NOT_FOUND"
    error_type = "invalid_request_error"
    default_code = "model_not_found"


class NotFoundError(SeekserveError):
    status_code = 404
    grpc_status = "NOT_FOUND"
    error_type = "invalid_request_error"
    default_code = "not_found"


class ConflictError(SeekserveError):
    """The request does not apply to the resource's current state (e.g. promote a finished rollout)."""

    status_code = 409
    grpc_status = "FAILED_PRECONDITION"
    error_type = "invalid_request_error"
    default_code = "conflict"


class OverloadedError(SeekserveError):
    """The bounded queue is full; the client should retry after ``retry_after_s``."""

    status_code = 429
    grpc_status = "RESOURCE_EXHAUSTED"
    error_type = "rate_limit_error"
    default_code = "queue_full"

    def __init__(self, message: str, *, param=None, code=None, retry_after_s: float = 1.0):
        super().__init__(message, param=param, code=code)
        self.retry_after_s = retry_after_s

    def _extra(self):
        return {**super()._extra(), "retry_after_s": self.retry_after_s}

    def headers(self):
        # Retry-After takes whole seconds (RFC 9110); never advertise 0.
        return {"Retry-After": str(max(1, int(round(self.retry_after_s))))}


class EngineNotReadyError(SeekserveError):
    status_code = 503
    grpc_status = "UNAVAILABLE"
    error_type = "service_unavailable"
    default_code = "not_ready"


class KVCacheTooLargeError(EngineNotReadyError):
    """The configured KV cache does not fit the memory the engine may use; raised at start, before the cache
    is allocated, so the replica fails with the sizes instead of an out-of-memory error later."""

    default_code = "kv_cache_too_large"


class RequestTimeoutError(SeekserveError):
    status_code = 504
    grpc_status = "DEADLINE_EXCEEDED"
    error_type = "timeout_error"
    default_code = "timeout"


class EngineError(SeekserveError):
    """The engine failed while generating; the request cannot be completed."""

    status_code = 500
    error_type = "internal_error"
    default_code = "engine_error"
