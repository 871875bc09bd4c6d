"""Per-rank RNG streams after a data-parallel resize (issue 28, item 9).

A checkpoint saved on N ranks and resumed on M != N cannot restore per-rank RNG states (there
are N of them for M ranks): ``engine_api.ckpt_layout.load_extra`` hands every rank rank 0's
per-rank file with ``rng=None``, and ``apply_extra`` seeds torch, numpy and python from
``derived_seed(seed, step, stream)``. What a user would notice if that went wrong: every rank
drawing the same dropout masks / samples (streams not distinct), or a resumed run that is not
reproducible (streams not the documented function of seed, step and rank).

In-process and fast: the rank and world size this code reads (``group_rank`` /
``group_size`` of ``engine_api.ckpt_layout``) are set by monkeypatch, as a spawned rank would
see them. The reference for the derived seed is the documented formula (``docs/checkpoints.md``:
a sha256 of ``"{seed}/{step}/{stream}"``, first 4 bytes little-endian, shifted right by one),
written out here independently; the reference for what a seed draws is a fresh generator of
each library seeded with it.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
import torch

from engine_api import ckpt_layout

SEED, STEP = 1234, 7


def _formula(seed: int, step: int, stream: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{step}/{stream}".encode()).digest()[:4], "little") >> 1


def _draws() -> tuple[list[float], list[float], list[float]]:
    """What the three global RNGs give next (torch, numpy, python)."""
    return torch.rand(4).tolist(), np.random.rand(4).tolist(), [random.random() for _ in range(4)]


def _expected_draws(seed: int) -> tuple[list[float], list[float], list[float]]:
    t = torch.rand(4, generator=torch.Generator().manual_seed(seed)).tolist()
    n = np.random.RandomState(seed % 2**32).rand(4).tolist()
    p = random.Random(seed)
    return t, n, [p.random() for _ in range(4)]


@pytest.fixture(autouse=True)
def _keep_global_rng():
    """These tests reseed the process's RNGs: give the next test the state it had."""
    state = torch.get_rng_state(), np.random.get_state(), random.getstate()
    yield
    torch.set_rng_state(state[0])
    np.random.set_state(state[1])
    random.setstate(state[2])


def _scheduler(lr: float = 0.1):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _as_rank(monkeypatch, rank: int, world: int) -> None:
    monkeypatch.setattr(ckpt_layout, "group_rank", lambda group=None: rank)
    monkeypatch.setattr(ckpt_layout, "group_size", lambda group=None: world)


@pytest.fixture
def saved_on_two_ranks(tmp_path):
    """``extra_rank0.pt`` / ``extra_rank1.pt`` as two ranks of a run would write them: each its
    own RNG state (different draws) and the shared scheduler state at step ``STEP``."""
    sched = _scheduler()
    for _ in range(STEP):
        sched.optimizer.step()
        sched.step()
    for rank in range(2):
        torch.manual_seed(100 + rank)
        np.random.seed(100 + rank)
        random.seed(100 + rank)
        torch.save(ckpt_layout.make_extra(sched, STEP), tmp_path / f"extra_rank{rank}.pt")
    return tmp_path, sched.state_dict()


@pytest.mark.parametrize("world", [1, 3, 4])
def test_after_a_resize_each_rank_draws_its_own_documented_stream(saved_on_two_ranks, monkeypatch, world):
    directory, sched_state = saved_on_two_ranks
    per_rank = []
    for rank in range(world):
        _as_rank(monkeypatch, rank, world)
        extra = ckpt_layout.load_extra(str(directory), {"world_size": 2})
        assert extra["rng"] is None and extra["resized_from"] == 2
        sched = _scheduler()
        assert ckpt_layout.apply_extra(extra, sched, SEED) == STEP
        assert sched.state_dict() == sched_state  # rank 0's scheduler, shared by every rank
        got = _draws()
        assert got == _expected_draws(_formula(SEED, STEP, rank)), f"rank {rank}: not the stream of (seed, step, rank)"
        per_rank.append(got)
    # Distinct per rank (torch, numpy and python alike), and none replays a saved rank's stream.
    for lib in range(3):
        assert len({tuple(d[lib]) for d in per_rank}) == world, f"library {lib}: two ranks draw alike"
    for old in (100, 101):
        torch.manual_seed(old)
        assert torch.rand(4).tolist() not in [d[0] for d in per_rank]


def test_the_stream_argument_and_the_step_select_the_stream(saved_on_two_ranks, monkeypatch):
    """Tensor-parallel peers pass one stream and must draw alike; another step or seed is
    another stream (a resume at step 7 must not replay step 6's randomness)."""
    directory, _ = saved_on_two_ranks
    for stream in (5, 0):  # 0 too: stream 0 is a stream, not "no stream given"
        draws = []
        for rank in (0, 1):
            _as_rank(monkeypatch, rank, 4)
            ckpt_layout.apply_extra(ckpt_layout.load_extra(str(directory), {"world_size": 2}), _scheduler(), SEED, stream=stream)
            draws.append(_draws())
        assert draws[0] == draws[1] == _expected_draws(_formula(SEED, STEP, stream)), f"stream {stream}"
    assert _formula(SEED, STEP, 5) != _formula(SEED, STEP - 1, 5) != _formula(SEED + 1, STEP, 5)
    assert ckpt_layout.derived_seed(SEED, STEP - 1, 5) == _formula(SEED, STEP - 1, 5)
    assert ckpt_layout.derived_seed(SEED + 1, STEP, 5) == _formula(SEED + 1, STEP, 5)
    assert 0 <= ckpt_layout.derived_seed(2**40, 10**6, 2**20) < 2**31


def test_at_the_saved_world_size_each_rank_gets_its_own_saved_state_back(saved_on_two_ranks, monkeypatch):
    """No resize: rank r loads ``extra_rank<r>.pt`` and continues exactly the stream it saved
    (the reference: reseed as that rank did before saving and draw)."""
    directory, _ = saved_on_two_ranks
    for rank in (0, 1):
        _as_rank(monkeypatch, rank, 2)
        extra = ckpt_layout.load_extra(str(directory), {"world_size": 2})
        assert extra["rng"] is not None and "resized_from" not in extra
        ckpt_layout.apply_extra(extra, _scheduler(), SEED)
        got = _draws()
        torch.manual_seed(100 + rank)
        np.random.seed(100 + rank)
        random.seed(100 + rank)
        assert got == _draws(), f"rank {rank} did not resume its own RNG stream"


def test_a_run_saved_on_one_rank_resumes_on_two_from_rank_0s_file(tmp_path, monkeypatch, capsys):
    """Saved on 1 rank there is only ``extra_rank0.pt``: every rank of the larger run reads it,
    and only rank 0 says (on stderr) that the RNG streams were re-derived."""
    sched = _scheduler()
    torch.save(ckpt_layout.make_extra(sched, STEP), tmp_path / "extra_rank0.pt")
    for rank in (0, 1):
        _as_rank(monkeypatch, rank, 2)
        extra = ckpt_layout.load_extra(str(tmp_path), {"world_size": 1})
        assert extra["rng"] is None and extra["resized_from"] == 1
        ckpt_layout.apply_extra(extra, _scheduler(), SEED)
        out = capsys.readouterr()
        assert out.out == ""
        if rank == 0:
            assert "saved on 1 rank(s), on 2" in out.err and f"seed={SEED}, step={STEP}" in out.err
        else:
            assert out.err == ""


def test_a_marker_without_a_world_size_is_read_as_the_same_world_size(saved_on_two_ranks, monkeypatch):
    """Checkpoints from before the world size was recorded: no resize, each rank its own file."""
    directory, _ = saved_on_two_ranks
    _as_rank(monkeypatch, 1, 2)
    extra = ckpt_layout.load_extra(str(directory), {})
    assert extra["rng"] is not None and "resized_from" not in extra


@pytest.mark.parametrize("env", ["", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"])
def test_the_per_rank_file_is_loaded_as_plain_data_only(tmp_path, monkeypatch, env):
    """A per-rank file holding a code-running object is refused (``CorruptCheckpointError``
    naming it), also when ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` turns torch's default off."""
    import os

    from engine_api.ckpt_integrity import CorruptCheckpointError

    if env:
        monkeypatch.setenv(env, "1")
    marker = tmp_path / "ran"
    torch.save({"scheduler": {}, "rng": None, "global_step": 1, "x": _Evil(str(marker))}, tmp_path / "extra_rank0.pt")
    _as_rank(monkeypatch, 0, 1)
    with pytest.raises(CorruptCheckpointError, match=r"extra_rank0\.pt is unreadable"):
        ckpt_layout.load_extra(str(tmp_path), {"world_size": 1})
    assert not os.path.exists(marker)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))
