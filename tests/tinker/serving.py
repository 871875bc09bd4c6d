"""A Tinker server in this test process: uvicorn in a thread on a free port, telemetry off."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from recipes.tinker_server.app import build_app

KEY = "tml-test"


@contextlib.contextmanager
def running_server(settings, factory) -> Iterator[str]:
    """Serve ``factory`` with ``settings`` (host and port ignored: 127.0.0.1, a free port); yields
    the base URL, then stops the server (which closes every run and the factory)."""
    old = os.environ.get("TINKER_TELEMETRY")
    os.environ["TINKER_TELEMETRY"] = "0"
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(settings, factory), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the server did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
        if old is None:
            os.environ.pop("TINKER_TELEMETRY", None)
        else:
            os.environ["TINKER_TELEMETRY"] = old
