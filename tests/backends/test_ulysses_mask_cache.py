"""The Ulysses attention mask cache (``SequenceShard.mask``, ``backends/fsdp/ulysses.py``) keeps
one mask per (kernel, sliding window, dtype): in a model that alternates sliding and full layers
(gemma2, Qwen2 with ``max_window_layers``) the first layer's mask must not be reused by a layer
of the other kind. Checked on the cache itself, in this process (the mask needs no process
group): each call must equal a mask built fresh for its own window, in either order."""

from __future__ import annotations

import pytest
import torch

from backends.fsdp.ulysses import SequenceShard, _build_mask

# Two packed rows: [0..9] and [0..4, 0..4]: a window of 3 is shorter than every sequence.
POSITIONS = torch.tensor([list(range(10)), list(range(5)) + list(range(5))])


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("order", [(3, None, 3), (None, 3, None), (3, 5, None)])
def test_a_sliding_layers_mask_is_not_reused_by_a_full_layer_or_back(kernel, order):
    for positions in (POSITIONS[:1], POSITIONS):  # one plain sequence (sdpa: no mask) and packed rows
        shard = SequenceShard(group=None, positions=positions)
        for window in order:  # layer after layer of one forward
            got = shard.mask(kernel, window, torch.float32)
            want = _build_mask(positions, kernel, window, torch.float32)
            assert _same(got, want), (kernel, order, window, positions.tolist())
        assert len({w for w in order}) == len(shard._masks)  # one entry per window, reused within a kind
