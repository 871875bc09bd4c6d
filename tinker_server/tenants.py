"""Tenants: on a server with two or more API keys, each key owns what it creates.

A session, its training runs, their futures and samplers, and their ``tinker://`` checkpoints
belong to the key that created the session (``server.tenants``, on by default). Another key
finds none of them: a request naming one is answered as for an id that does not exist (404, or
"does not exist on this server"), listings leave them out. With one key (or none) configured, or
``server.tenants=false``, every client sees everything, as before tenants existed.

The owner is recorded as a tag, never as the key: ``k-`` and the first 16 hex digits of the key's
SHA-256 (in memory, and in each run's ``run.json`` so checkpoints stay owned across restarts).
Assumption: a run record without an owner (written by a server before tenants) belongs to every
key, so no earlier checkpoint is lost to its user.

The tag of the request being served rides in a context variable, set by the server's ASGI guard
before the endpoint runs (every handler of a request runs in its context).
"""

from __future__ import annotations

import contextvars
import hashlib
from collections.abc import Iterable

_CURRENT: contextvars.ContextVar[str] = contextvars.ContextVar("tinker_tenant", default="")


def tag_of(key: str | None, keys: Iterable[str], tenants: bool) -> str:
    """The owner tag of a request sent with ``key`` ("" when the server does not separate keys)."""
    keys = tuple(keys)
    if not tenants or len(keys) < 2 or not key:
        return ""
    return "k-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def enter(tag: str) -> contextvars.Token:
    """Serve the rest of this request as ``tag`` (``leave`` with the token afterwards)."""
    return _CURRENT.set(tag)


def leave(token: contextvars.Token) -> None:
    _CURRENT.reset(token)


def current() -> str:
    """The tag of the request being served ("" outside one, or without tenants)."""
    return _CURRENT.get()


def visible(owner: str | None) -> bool:
    """Whether the current request may see something owned by ``owner`` (module docstring)."""
    mine = current()
    return not mine or not owner or owner == mine
