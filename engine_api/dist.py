"""Small helpers over ``torch.distributed`` that also work when it is not initialised.

Every helper takes the process group explicitly (``None`` means the default world group),
so callers always say which group a collective runs over. When ``torch.distributed`` is
not initialised the process is treated as a group of one and collectives are no-ops, which
is what lets engines and tests run single-process without a rendezvous.

Rank failure (issue 6; ``tests/reliability/test_rank_failure.py``). What bounds the time a
surviving rank spends waiting for a failed peer (gloo):

* The failed rank's process exits (an exception nobody catches, a crash, a kill): the OS
  closes its sockets and every peer blocked in, or later entering, a collective with it raises
  ``RuntimeError: ... Connection closed by peer`` within seconds (measured: under 2 s on the
  2-core CI machine), then exits non-zero unless it catches that. No timeout is involved.
* The failed rank stays alive without joining the collective (it swallowed the exception, or
  hangs in I/O): the peers raise ``RuntimeError: ... Timed out waiting <T>ms`` after the
  collective timeout T of the group they wait in. :func:`init_process_group` sets T for the
  world group (``timeout_s``, else ``$ENGINEKIT_DIST_TIMEOUT_S``, else torch's default of 30
  minutes); groups made later with ``new_group`` get torch's default unless their creator passes
  :func:`process_group_timeout` on (megatron's ``initialize_model_parallel`` takes it as
  ``distributed_timeout_minutes``).
* NCCL has neither property without torch's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``);
  under ``torchrun`` the elastic agent also terminates the other ranks when one exits non-zero.
"""

from __future__ import annotations

import atexit
import json
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist

# Seconds a rank waits in a collective for a missing peer, read by init_process_group.
TIMEOUT_ENV = "ENGINEKIT_DIST_TIMEOUT_S"


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (1 when torch.distributed is not initialised)."""
    return dist.get_world_size(group) if is_initialized() else 1


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group`` (0 when torch.distributed is not initialised)."""
    return dist.get_rank(group) if is_initialized() else 0


def all_reduce(tensor: torch.Tensor, op: str, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over ``group`` with ``op`` in {"sum", "max", "min"}.

    A group of one returns ``tensor`` unchanged without touching the backend.
    """
    if group_size(group) == 1:
        return tensor
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    dist.all_reduce(tensor, op=ops[op], group=group)
    return tensor


def all_gather_objects(obj: object, group: dist.ProcessGroup | None) -> list[object]:
    """Gather one picklable object from every rank of ``group``, in group-rank order."""
    size = group_size(group)
    if size == 1:
        return [obj]
    gathered: list[object] = [None] * size
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def all_gather_rows(tensor: torch.Tensor, group: dist.ProcessGroup | None, counts: list[int] | None = None) -> list[torch.Tensor]:
    """Gather a tensor whose first dimension may differ per rank (the other dimensions and the
    dtype must agree), in group-rank order, with tensor collectives on the communication device
    (``comm_device``): the rows padded to the longest, in one all-gather, after one all-gather of
    the sizes unless every rank's row count is given (``counts``). Results come back on
    ``tensor``'s device. Collective over ``group``."""
    size = group_size(group)
    if size == 1:
        return [tensor]
    device, home = comm_device(group), tensor.device
    # gloo has no bool all-gather; bytes travel the same way
    send = tensor.to(device).view(torch.uint8) if tensor.dtype == torch.bool else tensor.to(device)
    if counts is None:
        sizes = torch.tensor([send.shape[0]], dtype=torch.long, device=device)
        all_sizes = [torch.empty_like(sizes) for _ in range(size)]
        dist.all_gather(all_sizes, sizes, group=group)
        counts = [int(c) for c in torch.cat(all_sizes).tolist()]
    padded = send.new_zeros((max(counts), *send.shape[1:]))
    padded[: send.shape[0]] = send
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    out = []
    for part, count in zip(parts, counts, strict=True):
        part = part[:count]
        out.append((part.view(torch.bool) if tensor.dtype == torch.bool else part).to(home))
    return out


# What encoding a sender's input can raise: a non-tensor value, an extra JSON cannot carry.
_ENCODE_ERRORS = (TypeError, ValueError, AttributeError, RuntimeError)


def broadcast_tensors(
    named: list[tuple[str, torch.Tensor]] | None,
    extra: object,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device | str = "cpu",
) -> tuple[list[tuple[str, torch.Tensor]], object]:
    """``named`` (``(name, tensor)`` pairs) and ``extra`` (anything JSON can carry: numbers,
    including inf and nan, strings, lists, dicts) of global rank ``src``, on every rank of
    ``group``; the other ranks pass ``None`` and anything for ``extra``. Tensor collectives
    only, on the communication device (``comm_device``): a JSON header (names, shapes, dtypes,
    ``extra``) as bytes, its length before it, then one flat buffer per dtype, so a bucket of
    tensors costs a fixed number of broadcasts, and nothing is pickled (a header is data, never
    code). Results come back on ``device``; every rank, the sender included, gets ``extra`` as
    JSON returns it (tuples become lists, dict keys strings) and tensors that are views of one
    flat buffer per dtype (clone one to keep it alone). If the sender cannot encode its input
    (``extra`` not JSON-able, a non-tensor value), it raises and the other ranks raise a
    ``RuntimeError`` instead of waiting. A group of one returns its input."""
    if group_size(group) == 1:
        return list(named or []), extra
    comm = comm_device(group)
    mine = dist.get_rank() == src
    failure = None
    if mine:
        try:
            tensors = [t.detach() for _, t in named]
            header = {
                "names": [n for n, _ in named],
                "shapes": [list(t.shape) for t in tensors],
                "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                "extra": extra,
            }
            raw = torch.frombuffer(bytearray(json.dumps(header, allow_nan=True).encode()), dtype=torch.uint8).to(comm)
            length = torch.tensor([raw.numel()], dtype=torch.long, device=comm)
        except _ENCODE_ERRORS as exc:  # tell the receivers (length -1) instead of leaving them blocked
            failure = exc
            length = torch.tensor([-1], dtype=torch.long, device=comm)
    else:
        length = torch.empty(1, dtype=torch.long, device=comm)
    dist.broadcast(length, src=src, group=group)
    if failure is not None:
        raise failure
    if int(length) < 0:
        raise RuntimeError(f"broadcast_tensors: rank {src} could not send its tensors (see its own error); nothing was received")
    if not mine:
        raw = torch.empty(int(length), dtype=torch.uint8, device=comm)
    dist.broadcast(raw, src=src, group=group)
    # Decoded on every rank, the sender too, so all ranks see the same JSON round trip of extra.
    header = json.loads(bytes(raw.cpu().numpy()).decode())
    dtypes = [getattr(torch, d) for d in header["dtypes"]]
    numels = [math.prod(s) for s in header["shapes"]]
    out: list[torch.Tensor | None] = [None] * len(dtypes)
    for dtype in dict.fromkeys(dtypes):  # one flat buffer per dtype, in order of first use
        idx = [i for i, d in enumerate(dtypes) if d == dtype]
        wire = torch.uint8 if dtype == torch.bool else dtype  # gloo has no bool broadcast
        if mine:
            flat = torch.cat([tensors[i].reshape(-1).view(wire) if dtype == torch.bool else tensors[i].reshape(-1) for i in idx]).to(comm)
        else:
            flat = torch.empty(sum(numels[i] for i in idx), dtype=wire, device=comm)
        dist.broadcast(flat, src=src, group=group)
        flat = flat.to(device)
        offset = 0
        for i in idx:
            piece = flat[offset : offset + numels[i]]
            out[i] = (piece.view(torch.bool) if dtype == torch.bool else piece).view(header["shapes"][i])
            offset += numels[i]
    return list(zip(header["names"], out, strict=True)), header["extra"]


def comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """Device a small collective buffer must live on: CUDA for NCCL, CPU for gloo."""
    if is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(
    backend: str, init_method: str | None = None, rank: int | None = None, world_size: int | None = None, timeout_s: float | None = None
) -> None:
    """``torch.distributed.init_process_group`` with an explicit collective timeout.

    Args:
        backend: ``gloo`` or ``nccl``.
        init_method, rank, world_size: as for torch (``None``: torchrun's environment).
        timeout_s: how long a collective waits for a missing peer before raising; ``None``
            reads ``$ENGINEKIT_DIST_TIMEOUT_S``, and without it torch's default (30 minutes).

    Raises:
        ValueError: the timeout (argument or environment) is not a positive number.
    """
    source = "timeout_s"
    if timeout_s is None and os.environ.get(TIMEOUT_ENV):
        source, raw = f"${TIMEOUT_ENV}", os.environ[TIMEOUT_ENV]
        try:
            timeout_s = float(raw)
        except ValueError:
            raise ValueError(f"{source} = {raw!r}: not a number; fix: the process-group timeout in seconds, e.g. 600") from None
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"{source} = {timeout_s!r}: the process-group timeout must be positive; fix: seconds > 0, e.g. 600")
    # Only the given arguments: torch's own defaults (rank = world_size = -1) mean "read the
    # environment"; passing None instead fails the env:// rendezvous under torchrun.
    given = {"init_method": init_method, "rank": rank, "world_size": world_size}
    kwargs = {k: v for k, v in given.items() if v is not None}
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, **kwargs)


def process_group_timeout(group: dist.ProcessGroup | None = None) -> timedelta:
    """The collective timeout of ``group`` (default: the world group), to pass on to groups
    created later: ``new_group`` and megatron's parallel state do not inherit it."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    device = torch.device("cuda") if dist.get_backend(pg) == "nccl" else torch.device("cpu")
    try:
        # No public getter in torch 2.x: the backend's options carry the timeout it was made with.
        return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


# What a launcher (torchrun, torch.distributed.run, a Slurm wrapper exporting torch's variables)
# sets to describe the world a process belongs to; env:// reads exactly these.
LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


def launcher_world() -> tuple[int, int] | None:
    """``(world_size, rank)`` when the environment describes a launcher's world, else None.

    Raises:
        ValueError: the environment describes a world of more than one process but lacks
            what env:// needs to join it (a partial launcher environment would otherwise
            make every rank train alone).
    """
    present = {k: os.environ.get(k) for k in LAUNCHER_ENV if os.environ.get(k)}
    if "WORLD_SIZE" not in present:
        return None
    try:
        world = int(present["WORLD_SIZE"])
    except ValueError:
        raise ValueError(f"$WORLD_SIZE = {present['WORLD_SIZE']!r}: not an integer; fix: launch with torchrun, or unset it") from None
    missing = [k for k in LAUNCHER_ENV if k not in present]
    if missing:
        if world <= 1:
            return None  # WORLD_SIZE=1 alone (e.g. left over in a shell): one process, nothing to join
        raise ValueError(
            f"$WORLD_SIZE = {world} but {', '.join('$' + k for k in missing)} not set: this process cannot join the other "
            f"{world - 1} rank(s); fix: launch with torchrun (it sets {', '.join(LAUNCHER_ENV)}), or initialise "
            "torch.distributed yourself before init_model()"
        )
    return world, int(present["RANK"])


def compute_device() -> torch.device:
    """This process's compute device: ``cuda:$LOCAL_RANK`` (made current) when CUDA is
    available, else the CPU. One helper so every backend places work the same way."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def ensure_process_group(backend: str, timeout_s: float | None = None) -> None:
    """Make sure a default process group exists that spans the launcher's world.

    * A group exists: kept (the caller chose it). If it has one rank while the launcher's
      environment describes more (``$WORLD_SIZE > 1``), every rank would train alone without
      a word: that raises.
    * No group, and the environment describes a world (torchrun sets ``WORLD_SIZE``, ``RANK``,
      ``MASTER_ADDR``, ``MASTER_PORT``): join it through env:// with the collective timeout
      ``timeout_s`` (see :func:`init_process_group`).
    * No group and no launcher (plain ``python``): a 1-rank group, so backends built on
      torch.distributed (FSDP2 meshes, megatron parallel_state) run the same code in one process
      as under torchrun. Its rendezvous is a fresh file, so concurrent runs never collide.

    Raises:
        ValueError: a 1-rank group under a larger launcher world, or a partial launcher
            environment (see :func:`launcher_world`).
    """
    if is_initialized():
        wanted = os.environ.get("WORLD_SIZE", "")
        if wanted.isdigit() and int(wanted) > 1 and dist.get_world_size() == 1:
            raise ValueError(
                f"torch.distributed has a 1-rank group but $WORLD_SIZE = {wanted}: each rank would train alone; "
                "fix: let the engine join the launcher's world (do not initialise a 1-rank group yourself), or "
                "initialise it with init_method='env://'"
            )
        return
    if launcher_world() is not None:
        init_process_group(backend, timeout_s=timeout_s)
        atexit.register(_teardown_own_group, None)
        return
    import tempfile

    store = tempfile.NamedTemporaryFile(prefix="enginekit_pg_", delete=False).name
    init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1, timeout_s=timeout_s)
    atexit.register(_teardown_own_group, store)


def _teardown_own_group(store: str | None) -> None:
    """At interpreter exit, destroy the process groups of a default group the engine created
    (and remove its rendezvous file). A script that never tears down (the README's API example)
    otherwise leaves gloo's / NCCL's C++ worker threads to static destruction, where one rank
    could abort (``terminate called without an active exception``, SIGABRT) after its work was
    done, failing the job. No collective runs here: a peer that already exited is not awaited.
    A group the caller initialised is the caller's to destroy."""
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # every group: the default and its subgroups (meshes, megatron's)
    except Exception:  # noqa: BLE001 - at exit, a failed teardown must not turn a finished run into a failed one
        pass
    if store is not None and os.path.exists(store):
        os.remove(store)


def barrier(group: dist.ProcessGroup | None) -> None:
    """Barrier over ``group``; a no-op for a group of one."""
    if group_size(group) > 1:
        dist.barrier(group=group)


def broadcast_object(obj: object, src: int, group: dist.ProcessGroup | None) -> object:
    """``obj`` of global rank ``src``, on every rank of ``group`` (picklable objects)."""
    if group_size(group) == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]
