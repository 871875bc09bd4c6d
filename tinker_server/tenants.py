"""Tenants: each API key owns what it creates; with two or more keys, another key finds none of it.

Two things are kept apart:

* **the owner that is recorded**: every session, training run, future and sampler, and every
  run record (``run.json``) on disk, carries the tag of the key that created it, whatever the
  server's settings. A run created while the server had one key (or ``server.tenants=false``)
  therefore stays that key's when a second key is added later.
* **whether visibility is enforced**: with two or more ``api_keys`` and ``server.tenants`` (on by
  default) a request sees only what its own key owns; another key's ids are answered as ids that
  do not exist (404, or "does not exist on this server"), listings leave them out. With one key
  (or none) configured, or ``server.tenants=false``, every client sees everything.

The tag is never the key: ``k-`` and the first 16 hex digits of the key's SHA-256. A request sent
without a key (only a server with no ``api_keys`` accepts one) has the empty tag: what it creates
has no owner.

A run record without an owner (written by a server before issue 60, or by a request without a
key) belongs to no key while visibility is enforced: it is left out of listings and refused by
name, unless the operator assigns such records to one key (``server.ownerless_runs_owner``, a
key or its tag). It is never shared with every key by default.

The tenant of the request being served rides in a context variable, set by the server's ASGI
guard before the endpoint runs (every handler of a request runs in its context).
"""

from __future__ import annotations

import contextvars
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

TAG = re.compile(r"k-[0-9a-f]{16}")


@dataclass(frozen=True)
class Tenant:
    """The request being served: its key's tag, and whether other tags' things are hidden from it."""

    tag: str = ""
    enforced: bool = False


_OUTSIDE = Tenant()  # outside a request (frozen: safe as the default)
_CURRENT: contextvars.ContextVar[Tenant] = contextvars.ContextVar("tinker_tenant", default=_OUTSIDE)


def tag_of(key: str | None) -> str:
    """The owner tag recorded for requests sent with ``key`` ("" without a key)."""
    if not key:
        return ""
    return "k-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def owner_tag(key_or_tag: str) -> str:
    """``key_or_tag`` as a tag: a tag (``k-`` + 16 hex digits) as it is, a key (``tml-...``) hashed."""
    return key_or_tag if TAG.fullmatch(key_or_tag) else tag_of(key_or_tag)


def enforced(keys: Iterable[str], tenants: bool) -> bool:
    """Whether visibility is enforced: ``server.tenants`` and two or more keys."""
    return tenants and len(tuple(keys)) >= 2


def enter(tag: str, enforce: bool) -> contextvars.Token:
    """Serve the rest of this request as ``tag`` (``leave`` with the token afterwards)."""
    return _CURRENT.set(Tenant(tag, enforce))


def leave(token: contextvars.Token) -> None:
    """End what :func:`enter` began."""
    _CURRENT.reset(token)


def current() -> str:
    """The tag of the request being served ("" outside one, or for a request without a key)."""
    return _CURRENT.get().tag


def is_enforced() -> bool:
    """Whether the request being served sees only its own key's things."""
    return _CURRENT.get().enforced


def visible(owner: str | None) -> bool:
    """Whether the current request may see something owned by ``owner`` (module docstring): always
    when visibility is not enforced, else only its own key's (never something without an owner)."""
    mine = _CURRENT.get()
    return not mine.enforced or (bool(owner) and owner == mine.tag)
