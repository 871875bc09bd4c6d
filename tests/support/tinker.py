"""What the Tinker server tests share: a server in this test process (uvicorn in a thread on a free
port, telemetry off) that fails the test which leaves an SDK session open, seeded datums, and the
comparison of tensor sets."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import torch
import uvicorn
from tinker import types

from tinker_server.app import build_app
from tinker_server.contract import DatumIn
from tinker_server.demo import closing_service_clients  # noqa: F401  (re-exported for the tests)

KEY = "tml-test"
RANK, ALPHA = 4, 32.0
ADAM = dict(learning_rate=0.02, beta1=0.9, beta2=0.95, eps=1e-3, weight_decay=0.01, grad_clip_norm=0.0)
VOCAB = 21  # the character tokenizer of tests/support/user_data.py


def open_sessions(url: str, key: str = KEY) -> list[str]:
    """The sessions the server at ``url`` still holds (a client that was never closed keeps
    heartbeating its session, and warns "Session heartbeat failed ... Tinker is down" every 10 s
    for as long as its process lives once the server is gone)."""
    answer = httpx.get(f"{url}/api/v1/sessions", params={"limit": 1000}, headers={"X-API-Key": key}, timeout=10)
    answer.raise_for_status()
    return answer.json()["sessions"]


def check_no_open_sessions(url: str, key: str = KEY) -> None:
    """Fail naming the sessions a test left open (and the fix)."""
    left = open_sessions(url, key)
    assert not left, (
        f"the tests left Tinker sessions open: {left}; fix: close every ServiceClient "
        "(service.close('success').result(), or use it as a context manager)"
    )


@contextlib.contextmanager
def running_server(settings, factory) -> Iterator[str]:
    """Serve ``factory`` with ``settings`` (host and port ignored: 127.0.0.1, a free port); yields
    the base URL, then stops the server (which closes every run and the factory). Fails if the
    tests left a session open (:func:`check_no_open_sessions`)."""
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
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield url
        check_no_open_sessions(url, settings.api_keys[0] if settings.api_keys else KEY)
    finally:
        server.should_exit = True
        thread.join(60)
        if old is None:
            os.environ.pop("TINKER_TELEMETRY", None)
        else:
            os.environ["TINKER_TELEMETRY"] = old


def datums(seed: int, n: int = 6, loss: str = "cross_entropy") -> list[types.Datum]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 4 + (i * 3) % 7
        tokens = torch.randint(3, VOCAB, (length,), generator=g)
        inputs = {"target_tokens": torch.randint(3, VOCAB, (length,), generator=g)}
        if loss == "cross_entropy":
            inputs["weights"] = torch.randn(length, generator=g)
        else:
            inputs["logprobs"] = -torch.rand(length, generator=g) * 4
            inputs["advantages"] = torch.randn(length, generator=g)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens.tolist()), loss_fn_inputs=inputs))
    return out


def plain(datums: list[types.Datum]) -> list[DatumIn]:
    """The same datums as the training side's plain type (what the HTTP layer hands it)."""
    return [
        DatumIn(torch.tensor(d.model_input.to_ints()), {k: torch.as_tensor(v.to_torch()) for k, v in d.loss_fn_inputs.items()})
        for d in datums
    ]


def rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Relative L2 difference of two tensor sets as one vector."""
    num = sum(float(((got[k] - want[k]).double() ** 2).sum()) for k in want)
    return (num / sum(float((v.double() ** 2).sum()) for v in want.values())) ** 0.5
