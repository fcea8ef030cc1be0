"""The proxy's client-visible error: raised anywhere in the proxy, formatted by each API adapter
in its own error body (gyre/proxy/server.py)."""

from __future__ import annotations


class ApiError(Exception):
    """A client-visible error; adapters format it in their API's own error body."""

    def __init__(self, status: int, kind: str, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind  # invalid_request | authentication | not_found | too_large | rate_limit | overloaded | internal
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds, sent as Retry-After (429)
