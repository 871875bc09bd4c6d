"""Futures (the SDK's ``request_id`` promises, long polled) and the one worker thread that runs them.

**Futures.** Every call that does work answers ``{"request_id": ...}`` at once; the SDK then polls
``retrieve_future``. :meth:`FuturesTable.wait` holds such a poll open until the result is there or
``poll_timeout_s`` passed (the SDK re-polls a ``try_again`` at once, so an open poll costs nothing
and answers the moment the work ends). Results can be large (per-token outputs of a whole batch),
so one is dropped ``grace_s`` after it was first handed out (the SDK may poll again after a
dropped connection) and an uncollected one after ``keep_s``; a poll for an id that is not (or no
longer) in the table is answered as expired.

A future is pending, then started (its work is running), then done. ``cancel_future`` cancels a
pending one only (:meth:`FuturesTable.cancel`): the work of a started call runs to its end and
keeps its effect (a ``forward_backward``'s gradients reach the next ``optim_step``), so its future
keeps the call's real outcome instead of claiming a cancel that did not happen.

**Execution.** All calls into the training side (``TrainingRun``, ``Sampler``, ``RunFactory``) run
on one thread, :class:`OrderedWorker`: the engines share the process, its CUDA context and its
``torch.distributed`` state, and are not written to be called concurrently. Work is queued per
key: a model's queue runs its jobs strictly in ``seq_id`` order (job ``n`` waits until ``n - 1``
ran; the SDK sends the chunks of one ``forward_backward`` concurrently, the first one last), other
queues (a sampling session, control work) are FIFO. Each queue belongs to a tenant (the owner tag
of its API key, ``tinker_server.tenants``). The worker serves the tenants round-robin, and within
a tenant its queues round-robin, one runnable job per turn: a tenant with many queues (runs,
sampling sessions) holds another tenant's call back by at most one call, however many it opens.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from tinker_server import tenants
from tinker_server.contract import UserError
from tinker_server.wire import error_body

log = logging.getLogger(__name__)

JSON = "application/json"


@dataclass(frozen=True)
class Outcome:
    """A future's final answer: the response body and its media type."""

    body: bytes
    media_type: str = JSON

    @staticmethod
    def json(data: dict) -> Outcome:
        # allow_nan: a NaN loss is worth seeing; Python's json (the SDK's) reads it back.
        return Outcome(json.dumps(data, allow_nan=True).encode())

    @staticmethod
    def failed(message: str, category: str) -> Outcome:
        return Outcome.json(error_body(message, category))


def outcome_of_exception(e: Exception, what: str) -> Outcome:
    """A :class:`UserError` -> category ``user``; anything else -> ``server`` (logged with traceback)."""
    if isinstance(e, UserError):
        return Outcome.failed(str(e), "user")
    log.error("%s failed", what, exc_info=e)
    return Outcome.failed(f"{what} failed on the server: {type(e).__name__}: {e}", "server")


@dataclass
class _Entry:
    loop: asyncio.AbstractEventLoop
    event: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    done_at: float = 0.0
    handed_out_at: float | None = None
    owner: str = ""  # the tenant that made the request (tinker_server.tenants)
    started: bool = False  # its work began (it can no longer be cancelled)


class FuturesTable:
    """request_id -> result, filled from any thread, awaited on the event loop."""

    def __init__(self, keep_s: float = 900.0, grace_s: float = 60.0):
        self._keep_s = keep_s
        self._grace_s = grace_s
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._next_sweep = 0.0
        self._prefix = uuid.uuid4().hex[:8]  # ids of an earlier server process never match
        self._ids = itertools.count(1)

    def create(self, started: bool = False) -> str:
        """A new pending future (call on the event loop), owned by the request's tenant;
        ``started``: its work is already under way (it cannot be cancelled)."""
        entry = _Entry(asyncio.get_running_loop(), owner=tenants.current(), started=started)
        with self._lock:
            self._expire()
            request_id = f"{self._prefix}-{next(self._ids)}"
            self._entries[request_id] = entry
        return request_id

    def complete(self, request_id: str, outcome: Outcome) -> None:
        """Set the result (from any thread; a second completion is ignored)."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.outcome is not None:
                return
            entry.outcome = outcome
            entry.done_at = time.monotonic()
        try:
            entry.loop.call_soon_threadsafe(entry.event.set)
        except RuntimeError:  # the loop is closed: the server is shutting down, nobody waits
            pass

    def start(self, request_id: str) -> bool:
        """Mark the request's work as begun; False (do not run it) when it was cancelled, or is
        unknown. Atomic with :meth:`cancel`: a call is either cancelled or run, never both."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.outcome is not None:
                return False
            entry.started = True
            return True

    def cancel(self, request_id: str, outcome: Outcome) -> str:
        """Cancel a pending request (its outcome becomes ``outcome``; its work never runs).
        Returns ``"cancelled"``, or why not: ``"started"`` (its work is running or ran: the
        outcome stays the work's own), ``"done"``, ``"unknown"``."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None:
                return "unknown"
            if entry.outcome is not None:
                return "done"
            if entry.started:
                return "started"
            entry.outcome = outcome
            entry.done_at = time.monotonic()
        try:
            entry.loop.call_soon_threadsafe(entry.event.set)
        except RuntimeError:  # the loop is closed: nobody waits
            pass
        return "cancelled"

    def known(self, request_id: str) -> bool:
        """Whether the request exists for the current tenant (another tenant's is unknown to it)."""
        with self._lock:
            entry = self._entries.get(request_id)
            return entry is not None and tenants.visible(entry.owner)

    async def wait(self, request_id: str, timeout: float) -> Outcome | None:
        """The result, waiting up to ``timeout`` s; ``None`` if still pending; ``KeyError`` if unknown."""
        with self._lock:
            entry = self._entries[request_id]
        if not tenants.visible(entry.owner):
            raise KeyError(request_id)  # another tenant's: unknown to this one
        if entry.outcome is None:
            try:
                await asyncio.wait_for(entry.event.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        entry.handed_out_at = entry.handed_out_at or time.monotonic()
        return entry.outcome

    def _expire(self) -> None:
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + 1.0  # a sweep is a scan of the table: at most once a second
        for request_id, entry in list(self._entries.items()):
            if entry.outcome is not None and (
                (entry.handed_out_at is not None and entry.handed_out_at < now - self._grace_s) or entry.done_at < now - self._keep_s
            ):
                del self._entries[request_id]


class QueueClosed(Exception):
    """The queue (a model, a sampling session) was closed; the message says why."""


class SeqConflict(Exception):
    """A ``seq_id`` that already ran (or is below the queue's start)."""


Job = Callable[[], None]


@dataclass
class _Queue:
    ordered: bool
    owner: str = ""  # its tenant's tag: the worker's turns go to tenants first
    next_seq: int = 0
    held: dict[int, tuple[Job, Callable[[str], None]]] = field(default_factory=dict)  # seq -> (job, fail)
    fifo: collections.deque = field(default_factory=collections.deque)  # (job, fail)
    claimed: dict[int, str | None] = field(default_factory=dict)  # seq -> request id (None: no future)

    def pop_runnable(self):
        if self.ordered:
            item = self.held.pop(self.next_seq, None)
            if item is not None:
                self.next_seq += 1
                # Keep the recent claims only (for duplicate detection of retried sends).
                self.claimed.pop(self.next_seq - 1025, None)
            return item
        return self.fifo.popleft() if self.fifo else None


class OrderedWorker:
    """The single thread that runs every training-side call (see the module docstring)."""

    def __init__(self, name: str = "tinker-worker"):
        self._cond = threading.Condition()
        self._queues: dict[str, _Queue] = {}
        # round-robin order of the tenants, and of each tenant's queue keys
        self._tenants: collections.deque[str] = collections.deque()
        self._turns: dict[str, collections.deque[str]] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ queues
    def open(self, key: str, ordered: bool, owner: str = "") -> None:
        """Create the queue ``key`` (ordered: jobs run in seq order from 0) of tenant ``owner``."""
        with self._cond:
            if key not in self._queues:
                self._queues[key] = _Queue(ordered=ordered, owner=owner)
                if owner not in self._turns:
                    self._turns[owner] = collections.deque()
                    self._tenants.append(owner)
                self._turns[owner].append(key)

    def is_open(self, key: str) -> bool:
        with self._cond:
            return key in self._queues

    def claimed(self, key: str, seq: int) -> tuple[bool, str | None]:
        """Whether ``seq`` was already submitted to ``key`` (a retried send), and its request id."""
        with self._cond:
            queue = self._queues.get(key)
            if queue is None or seq not in queue.claimed:
                return False, None
            return True, queue.claimed[seq]

    def submit(self, key: str, seq: int | None, job: Job, fail: Callable[[str], None], request_id: str | None = None) -> None:
        """Queue ``job``; ``fail(message)`` is called instead if the queue is closed before it runs."""
        with self._cond:
            queue = self._queues.get(key)
            if queue is None:
                raise QueueClosed(f"{key} is closed")
            if queue.ordered:
                if seq is None:
                    raise SeqConflict("seq_id is required")
                if seq < queue.next_seq or seq in queue.held or seq in queue.claimed:
                    raise SeqConflict(f"seq_id {seq} was already used (the next one expected is {queue.next_seq})")
                queue.held[seq] = (job, fail)
                queue.claimed[seq] = request_id
            else:
                queue.fifo.append((job, fail))
            self._cond.notify()

    def skip(self, key: str, seq: int) -> None:
        """Mark ``seq`` as done without work (a refused request) so the ones after it still run."""
        try:
            self.submit(key, seq, lambda: None, lambda _msg: None)
        except (QueueClosed, SeqConflict):
            pass

    def close(self, key: str, reason: str) -> None:
        """Drop the queue; its waiting jobs fail with ``reason`` (a running job finishes)."""
        with self._cond:
            queue = self._queues.pop(key, None)
            if queue is None:
                return
            keys = self._turns[queue.owner]
            keys.remove(key)
            if not keys:  # the tenant's last queue: it leaves the rotation
                del self._turns[queue.owner]
                self._tenants.remove(queue.owner)
            waiting = [fail for _, fail in queue.held.values()] + [fail for _, fail in queue.fifo]
        for fail in waiting:
            fail(reason)

    def call(self, fn: Callable[[], object], key: str | None = None) -> concurrent.futures.Future:
        """Run ``fn`` on the worker; its result (or what it raised) as a future. ``key``: the
        (open, unordered) queue it waits in, taking its turn as that key's calls do; None:
        control work (closing runs), in a queue of its own that never waits behind a busy key.
        A queue closed before ``fn`` ran fails the future with :class:`QueueClosed`.

        Raises:
            QueueClosed: ``key``'s queue is not open.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()

        def job() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as e:  # noqa: BLE001 - handed to the waiter
                    future.set_exception(e)

        def fail(message: str) -> None:
            if future.set_running_or_notify_cancel():
                future.set_exception(QueueClosed(message))

        if key is None:
            key = "__control__"
            self.open(key, ordered=False, owner=key)  # a tenant of its own
        self.submit(key, None, job, fail)
        return future

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the running job, then end the thread (waiting jobs are dropped)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread
    def _next(self):
        # Tenants first, then that tenant's queues: each rotation moves past what was just served.
        for _ in range(len(self._tenants)):
            tenant = self._tenants[0]
            self._tenants.rotate(-1)
            keys = self._turns[tenant]
            for _ in range(len(keys)):
                key = keys[0]
                keys.rotate(-1)
                item = self._queues[key].pop_runnable()
                if item is not None:
                    return item
        return None

    def _loop(self) -> None:
        while True:
            with self._cond:
                item = self._next()
                while item is None and not self._stopping:
                    self._cond.wait()
                    item = self._next()
                if self._stopping:
                    return
            job, _ = item
            try:
                job()
            except Exception:  # noqa: BLE001 - jobs report their own errors; this keeps the worker alive
                log.exception("a worker job raised")
