"""The weight-transfer wire format (``posttrain.placement.transfer``): what the receivers
rebuild is bit-for-bit what the sender exported, for every dtype and shape, across buckets."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from posttrain.placement.transfer import TransferGroup, receive_weights, send_weights


def _weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(37, 16, generator=g)),
        ("norm.weight", torch.randn(16, generator=g).to(torch.bfloat16)),  # 2-byte elements: alignment matters
        ("scale", torch.tensor(3.25, dtype=torch.float64)),  # 0-d
        ("layer.0.bias", torch.randn(5, generator=g).half()),
        ("ids", torch.arange(7, dtype=torch.int64)),
        ("mask", torch.tensor([True, False, True])),
        ("lm_head.weight", torch.randn(16, 37, generator=g).t()),  # not contiguous
    ]


def _transfer(receivers: int, bucket_mb: float | None, pairs=None, errors: list | None = None) -> list[list[tuple[str, torch.Tensor]]]:
    """Send ``pairs`` (default: ``_weights()``) to ``receivers`` threads; what each received.
    Receiver errors go to ``errors`` (None: none allowed)."""
    size = 1 + receivers
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    received: list[list] = [[] for _ in range(receivers)]
    expect_errors = errors is not None
    errors = [] if errors is None else errors

    def receiver(i: int) -> None:
        try:
            group = TransferGroup("127.0.0.1", store.port, 1 + i, size, 60.0)
            received[i] = [(n, t.clone()) for n, t in receive_weights(group)]
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=receiver, args=(i,)) for i in range(receivers)]
    for t in threads:
        t.start()
    sender = TransferGroup("127.0.0.1", store.port, 0, size, 60.0, store=store)
    try:
        send_weights(iter(_weights()) if pairs is None else pairs, sender, bucket_mb)
    finally:
        for t in threads:
            t.join(60)
    assert expect_errors or not errors, errors
    return received


def _assert_same(got: list[tuple[str, torch.Tensor]]) -> None:
    want = _weights()
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(
            a.reshape(-1).view(torch.uint8) if a.dim() else a.reshape(1),
            b.contiguous().reshape(-1).view(torch.uint8) if b.dim() else b.reshape(1),
        ), name


def test_every_receiver_gets_the_exact_tensors_in_one_bucket():
    for got in _transfer(receivers=2, bucket_mb=None):
        _assert_same(got)


def test_small_buckets_split_the_stream_without_changing_it():
    # 0.001 MB (~1 KB) buckets: the 37x16 fp32 tensors (2.4 KB) each get a bucket of their own.
    (got,) = _transfer(receivers=1, bucket_mb=0.001)
    _assert_same(got)


def test_a_failing_export_aborts_the_receivers_instead_of_leaving_them_waiting():
    """The sender's export raises after one bucket: the sender re-raises it and every receiver
    raises at once (without the abort header they would wait out the collective timeout)."""

    def failing():
        yield from _weights()[:2]
        raise ValueError("export broke")

    start, errors = time.monotonic(), []
    with pytest.raises(ValueError, match="export broke"):
        _transfer(receivers=2, bucket_mb=0.001, pairs=failing(), errors=errors)
    assert time.monotonic() - start < 30
    assert len(errors) == 2 and all("weight transfer aborted" in str(e) for e in errors), errors
