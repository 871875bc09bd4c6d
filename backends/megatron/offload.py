"""Offload by freeing storage in place: keep a host copy, ``resize_(0)`` the storage, restore later.

megatron's parameters, ``main_grad`` and (with the distributed optimizer) optimizer shards are
*views* into contiguous DDP buffers; moving a buffer with ``.to()`` would leave those views on
the old storage. Resizing the shared storage keeps every view valid, releases the memory for
real (on CPU too, which is what the CPU test checks), and restores bit-identical contents.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class StorageOffloader:
    """Holds the host copies of the storages it freed."""

    def __init__(self) -> None:
        # keyed by the allocation's address: every untyped_storage() call is a new Python object
        self._saved: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}

    def offload(self, tensors: Iterable[torch.Tensor], keep: set[int] = frozenset()) -> None:
        """Copy each distinct storage of ``tensors`` to the host, then free it; storages whose
        address is in ``keep`` are left alone."""
        pin = torch.cuda.is_available()
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in self._saved or storage.data_ptr() in keep:
                continue
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(_bytes_of(storage))
            self._saved[storage.data_ptr()] = (storage, host)
            storage.resize_(0)

    def restore(self) -> None:
        """Reallocate every freed storage on its device and copy its contents back."""
        for storage, host in self._saved.values():
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._saved.clear()

    @property
    def offloaded_bytes(self) -> int:
        """Bytes currently held on the host instead of the compute device."""
        return sum(host.numel() for _, host in self._saved.values())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
