"""Weights from the training group to a rollout group on another pool, with tensor collectives.

The two groups are separate ``torch.distributed`` worlds, so the transfer runs on a process group
of its own that spans the actor's rank 0 (transfer rank 0, the sender) and every rollout rank
(transfer ranks 1..N): a gloo group on CPU, NCCL on GPU, built straight from a ``TCPStore`` that
the sender opens on a free port (``dist.new_group`` cannot span two worlds).

Per bucket (the actor's ``export_weights(bucket_mb)`` chunks, as the colocated sync streams
them): one broadcast of a small header ``[meta bytes, data bytes]``, one of the metadata (names,
dtypes, shapes; JSON) and one of the bucket's tensors packed into one flat byte buffer; a header
of zeros ends the stream and ``[-1, 0]`` aborts it (the sender's export failed: the receivers
raise instead of waiting). The receivers unpack views of the buffer and hand them to the rollout
engine through the same ``Rollout.sync_weights`` path as a colocated sync (``ReceivedWeights``
is its weight source), so the engine's update protocol is unchanged. No tensor is pickled and
nothing passes through the driver.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from engine_api.rollout import chunk_pairs

# Every tensor starts at a multiple of this many bytes in the flat buffer, so its view is aligned.
_ALIGN = 16
# The metadata size a header carries when the sender's export failed mid-stream.
_ABORT = -1


class TransferGroup:
    """A process group of ``size`` ranks outside the default world.

    Args:
        addr, port: the sender's store (``posttrain.placement.worker.master_store``).
        rank, size: this process's place (0: the sender).
        timeout_s: collective timeout (``engine.dist_timeout_s``).
        store: the sender's own store object (rank 0 only).
    """

    def __init__(self, addr: str, port: int, rank: int, size: int, timeout_s: float, store: dist.TCPStore | None = None) -> None:
        timeout = timedelta(seconds=timeout_s)
        store = store or dist.TCPStore(addr, port, size, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore("enginekit_weight_transfer", store)
        self.rank, self.size = rank, size
        if torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, dist.ProcessGroupNCCL.Options())
        else:
            self.device = torch.device("cpu")
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        self._store = store

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` into every rank's ``tensor`` (in place)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.pg.broadcast([tensor], opts).wait()
        return tensor

    def close(self) -> None:
        self.pg = None
        self._store = None


def send_weights(pairs: Iterable[tuple[str, torch.Tensor]], group: TransferGroup | None, bucket_mb: float | None) -> float:
    """Stream ``pairs`` to the receivers in buckets of about ``bucket_mb`` MB; returns the MB
    sent. ``group`` None (the actor's other ranks): the export is drained, nothing is sent
    (exporting is collective over the actor group). When the export fails, the receivers are
    told (an abort header) before the error is raised here, so none of them waits for buckets
    that will never come."""
    sent = 0
    try:
        for chunk in chunk_pairs(pairs, bucket_mb):
            if group is None:
                continue
            meta, flat = _pack(chunk, group.device)
            meta_bytes = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
            group.broadcast(torch.tensor([meta_bytes.numel(), flat.numel()], dtype=torch.long, device=group.device))
            group.broadcast(meta_bytes.to(group.device))
            group.broadcast(flat)
            sent += flat.numel()
    except Exception:
        if group is not None:
            group.broadcast(torch.tensor([_ABORT, 0], dtype=torch.long, device=group.device))
        raise
    if group is not None:
        group.broadcast(torch.zeros(2, dtype=torch.long, device=group.device))  # end of the stream
    return sent / 2**20


def receive_weights(group: TransferGroup) -> Iterator[tuple[str, torch.Tensor]]:
    """The pairs the sender streams, in its order, until its end mark."""
    while True:
        header = group.broadcast(torch.zeros(2, dtype=torch.long, device=group.device))
        n_meta, n_flat = (int(x) for x in header.tolist())
        if n_meta == _ABORT:
            raise RuntimeError("weight transfer aborted: the actor's export failed on the sending side (its error says why)")
        if n_meta == 0:
            return
        meta = json.loads(bytes(group.broadcast(torch.empty(n_meta, dtype=torch.uint8, device=group.device)).cpu().tolist()))
        flat = group.broadcast(torch.empty(n_flat, dtype=torch.uint8, device=group.device))
        yield from _unpack(meta, flat)


class ReceivedWeights:
    """A ``roles.rollout.Rollout`` weight source fed by a transfer group: what the actor on the
    other pool exports arrives here (both ends must run at the same time; the driver starts them
    together)."""

    def __init__(self, group: TransferGroup) -> None:
        self.group = group

    def export_weights(self, bucket_mb: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's full weights (its ``export_weights``), as they arrive."""
        return receive_weights(self.group)

    def export_adapter_weights(self) -> dict[str, torch.Tensor]:
        """The actor's LoRA adapter weights (its ``export_adapter_weights``)."""
        return dict(receive_weights(self.group))


def _pack(chunk: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[list[list], torch.Tensor]:
    """The chunk's metadata ``[name, dtype, shape, byte offset]`` and its bytes in one flat buffer on ``device``."""
    meta, pieces, offset = [], [], 0
    for name, tensor in chunk:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        pad = -data.numel() % _ALIGN
        meta.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset])
        pieces += [data.to(device), torch.zeros(pad, dtype=torch.uint8, device=device)]
        offset += data.numel() + pad
    return meta, torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8, device=device)


def _unpack(meta: list[list], flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a bucket: views of ``flat`` (aligned, so no copy)."""
    for name, dtype, shape, offset in meta:
        dt = getattr(torch, dtype)
        n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dt).element_size()
        yield name, flat[offset : offset + n].view(dt).reshape(shape)
