"""The step -> samples order of the user's files (``StepOrder``).

The samples of step ``s`` are positions ``s * batch_size .. (s + 1) * batch_size - 1`` of the
endless sequence formed by one permutation of the rows per epoch (seeded by ``data.seed`` and the
epoch; identity when ``data.shuffle`` is false): a pure function of the config and the step, so a
resumed run sees the samples an uninterrupted run would have seen from its step on.
"""

from __future__ import annotations

import torch

from posttrain import sort_task as task


class StepOrder:
    """Which sample indices step ``s`` takes (see the module docstring): a pure function of
    ``(n, batch_size, seed, shuffle, s)``."""

    def __init__(self, n: int, batch_size: int, seed: int, shuffle: bool) -> None:
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self._epoch, self._perm = -1, torch.arange(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(task._step_seed(self.seed, epoch))
            self._perm = torch.randperm(self.n, generator=gen) if self.shuffle else torch.arange(self.n)
            self._epoch = epoch
        return self._perm

    def indices(self, step: int) -> list[int]:
        out = []
        for pos in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, i = divmod(pos, self.n)
            out.append(int(self._permutation(epoch)[i]))
        return out

    def epoch(self, step: int) -> float:
        """Epochs completed after step ``step`` (0-based), for logging."""
        return (step + 1) * self.batch_size / self.n
