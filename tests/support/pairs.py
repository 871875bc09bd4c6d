"""The preference tests' batch of pairs (``tests/roles/test_preference.py``,
``test_reward_model.py``): rows chosen, rejected, ... with jagged prompts and responses."""

from __future__ import annotations

import torch

from engine_api import make_batch
from tests.support.hf_utils import VOCAB

# (prompt, chosen response, rejected response) lengths of 4 pairs
SHAPES = ((3, 4, 2), (5, 1, 6), (2, 7, 3), (4, 3, 3))


def pair_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for p, c, r in SHAPES:
        prompt = torch.randint(0, VOCAB, (p,), generator=g)
        for n in (c, r):
            ids.append(torch.cat([prompt, torch.randint(0, VOCAB, (n,), generator=g)]))
            masks.append(torch.cat([torch.zeros(p), torch.ones(n)]))
    return make_batch(ids, loss_mask=masks)
