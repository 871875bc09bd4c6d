"""The Tinker API's routers, one per area (``service``: client setup, sessions and futures;
``training``: models and their calls; ``weights``: saving and loading them; ``sampling``;
``listings``: the REST checkpoint listings; ``openai``: OpenAI-compatible sampling), each with module-level handlers over the
:class:`~tinker_server.registry.Registry`, which they reach as the dependency :data:`Server`.
``tinker_server.app`` includes them."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from tinker_server.registry import Registry


def registry_of(request: Request) -> Registry:
    """The app's registry (``app.state.tinker``)."""
    return request.app.state.tinker


Server = Annotated[Registry, Depends(registry_of)]
