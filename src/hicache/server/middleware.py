"""ASGI middleware around the app: the API key check and the last-resort error handler.

Both are plain ASGI (not Starlette's BaseHTTPMiddleware) so streamed responses pass through
untouched. :class:`CatchAllErrors` exists because Starlette's own handler for unexpected
exceptions answers 500 and then re-raises, and the server then drops the client's keep-alive
connection; here the 500 is answered in OpenAI's shape and the connection stays usable.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any, Awaitable, Callable

from .protocol import APIError

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# probes and scrapers need no key (as in vLLM); ``/`` is the connectivity check clients make
# without one (Claude Code's HEAD /)
OPEN_PATHS = frozenset({"/", "/health", "/metrics"})


async def send_error(send: Send, e: APIError, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class CatchAllErrors:
    """Any exception a handler lets escape becomes a 500 ``server_error`` (logged with its
    traceback) if the response has not started; otherwise the response is cut short."""

    def __init__(self, app: ASGIApp, on_error: Callable[[], None]) -> None:
        self.app, self.on_error = app, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            logger.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            self.on_error()
            if not started:
                await send_error(send, APIError(500, f"internal server error: {type(e).__name__}.",
                                                type="server_error", code="internal_error"))


class RequireApiKey:
    """``Authorization: Bearer <key>`` (or ``x-api-key: <key>``, as the anthropic SDK sends it) on
    every path but :data:`OPEN_PATHS`; a missing or
    wrong key is 401 ``invalid_api_key``. The scheme is case-insensitive (RFC 7235: ``bearer``
    and ``BEARER`` too) and may be followed by several spaces; the key is compared in constant
    time."""

    def __init__(self, app: ASGIApp, api_key: str, on_reject: Callable[[], None]) -> None:
        self.app, self.on_reject, self._expected = app, on_reject, api_key.encode()

    def _accepts(self, authorization: bytes) -> bool:
        scheme, _, key = authorization.partition(b" ")
        # Compare the key even when the scheme is wrong: the time taken says nothing either way.
        key_ok = hmac.compare_digest(key.lstrip(b" "), self._expected)
        return scheme.lower() == b"bearer" and key_ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        # The anthropic SDK sends its key as x-api-key (the Messages API's header): taken as a bearer key.
        x_key = next((v for k, v in scope["headers"] if k == b"x-api-key"), None)
        if x_key is not None and not given:
            given = b"Bearer " + x_key
        if self._accepts(given):
            await self.app(scope, receive, send)
            return
        self.on_reject()
        what = "a wrong API key" if given else "no API key"
        await send_error(send, APIError(401, f"the request has {what}; send 'Authorization: Bearer <key>' "
                                             "with the server's --api-key.", code="invalid_api_key"),
                         headers=[(b"www-authenticate", b"Bearer")])
