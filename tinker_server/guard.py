"""What every request passes before a handler sees it: the API key (``X-API-Key``, or a bearer
token for OpenAI clients), the body size limit (counted as the body arrives, also after zstd
decompression) and the JSON nesting limit.

:class:`Guard` is ASGI middleware: an unknown key is answered 401 and a body over
``server.max_body_mb`` 413 before the app runs; it serves the rest of the request as the key's
tenant (``tinker_server.tenants``). :func:`read_json` and :func:`decompress` are the handlers' way
to read a body within the same limits.
"""

from __future__ import annotations

import json

import zstandard
from fastapi import Request

from tinker_server import tenants, wire
from tinker_server.contract import UserError

MAX_JSON_DEPTH = 64


class BodyTooLarge(Exception):
    """A request body over the limit (answered 413)."""


def too_large_body(limit: int) -> dict:
    """The SDK's error body for a request body over ``limit`` bytes."""
    return wire.error_body(wire.too_large_message("request body", limit))


class Guard:
    """ASGI middleware: the API key, and the body size limit (counted as the body arrives)."""

    def __init__(self, app, api_keys: tuple[str, ...], max_body: int, tenants_on: bool = True):
        self.app = app
        self.api_keys = set(api_keys)
        self.max_body = max_body
        self.enforced = tenants.enforced(self.api_keys, tenants_on)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = api_key_of(headers)
        if self.api_keys and scope["path"] != "/api/v1/healthz" and key not in self.api_keys:
            shown = "missing" if key is None else "not one of this server's keys"
            body = wire.error_body(
                f"X-API-Key (or Authorization: Bearer): {shown}; pass api_key= (or TINKER_API_KEY) with a key from the server's api_keys"
            )
            return await _send_json(send, 401, body)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await _send_json(send, 413, too_large_body(self.max_body))
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                raise BodyTooLarge()
            return message

        token = tenants.enter(tenants.tag_of(key), self.enforced)
        try:
            return await self.app(scope, counted, send)
        finally:
            tenants.leave(token)


def api_key_of(headers: dict[str, str]) -> str | None:
    """The request's API key: ``X-API-Key`` (the Tinker SDK's), else an ``Authorization: Bearer``
    token (what OpenAI clients of ``/oai/api/v1`` send)."""
    if "x-api-key" in headers:
        return headers["x-api-key"]
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})


async def read_json(request: Request, what: str) -> dict:
    """The request's JSON object (an empty body reads as ``{}``); a :class:`UserError` for a body
    that is not JSON, not an object, or nested more than :data:`MAX_JSON_DEPTH` deep."""
    raw = await request.body()
    try:
        data = json.loads(raw or b"{}")
    except RecursionError:
        data = None  # nested past Python's recursion limit: refused below
    except ValueError as e:
        raise UserError(f"{what}: the body is not JSON ({e})") from None
    if data is None or _depth_over(data, MAX_JSON_DEPTH):
        raise UserError(f"{what}: the body nests JSON arrays or objects more than {MAX_JSON_DEPTH} deep; no request of the API does")
    if not isinstance(data, dict):
        raise UserError(f"{what}: the body must be a JSON object")
    return data


def _depth_over(data: object, limit: int) -> bool:
    """Whether ``data`` nests lists / dicts more than ``limit`` deep (iterative: no recursion)."""
    stack = [(data, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def decompress(raw: bytes, limit: int) -> bytes:
    """A zstd body, refused as too large once it inflates past ``limit`` (a small bomb stays small)."""
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(raw) as reader:
            while chunk := reader.read(1 << 20):
                out += chunk
                if len(out) > limit:
                    raise BodyTooLarge()
    except zstandard.ZstdError as e:
        raise UserError(f"request body: not valid zstd ({e})") from None
    return bytes(out)
