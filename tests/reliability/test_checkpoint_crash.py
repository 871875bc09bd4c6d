"""Crash-safe checkpoints (issue 6, item 2): a checkpoint becomes visible only when complete.

The protocol is ``engine_api.ckpt_layout`` (its docstring lists the commit steps). Two layers:

* the protocol alone, on hand-made states (no engine, no process group): how a root resolves,
  retention, the remote copy;
* every registered HF backend for real: a process saving step 2 is SIGKILLed at each step of
  the save (:data:`_ckpt_targets.STOPS`: half-written shards, all files but not published,
  ``latest`` written but not renamed, retention half done, remote copy half uploaded); then a
  fresh process loads the root: the previous checkpoint before the rename, the new one after,
  with bit-identical parameters; the next save cleans every leftover; and the remote copy
  round-trips through an in-memory fsspec filesystem with ``del_local_after_load`` both ways.
"""

from __future__ import annotations

import os
import time

import fsspec
import pytest
import torch

from engine_api import ckpt_layout
from engine_api.ckpt_integrity import MANIFEST
from tests.reliability import _ckpt_targets as T
from tests.reliability._ckpt_procs import RankGroup, wait_for
from tests.reliability._step_common import BACKENDS
from tests.support.ckpt_protocol import latest_name as _latest
from tests.support.ckpt_protocol import save_stand_in as _save
from tests.support.hf_utils import make_model
from tests.support.launch import run_distributed

START_TIMEOUT_S = 240  # several ranks start at once on a loaded 2-core machine


# ----------------------------------------------------------------------------- protocol alone
def test_a_root_resolves_to_latest_if_complete_else_the_newest_complete_before_it(tmp_path):
    root = str(tmp_path)
    assert _latest(root) is None
    _save(root, 1)
    _save(root, 2)
    assert _latest(root) == "global_step_2"
    # A save killed after `latest` was replaced but before its rename (commit steps 3-4).
    tmp = ckpt_layout.begin(root, 3)
    ckpt_layout._write_marker(tmp, {"global_step": 3})
    ckpt_layout._set_latest(root, 3)
    assert _latest(root) == "global_step_2"
    # Incomplete directories in the checkpoint namespace are never chosen.
    os.makedirs(os.path.join(root, "global_step_11"))
    assert _latest(root) == "global_step_2"
    # A deliberate rollback: resumed from step 1, saved step 2 again; a higher abandoned step stays ignored.
    _save(root, 10)
    _save(root, 2)
    assert _latest(root) == "global_step_2" and "global_step_10" in os.listdir(root)
    # No readable marker: the newest complete checkpoint.
    with open(os.path.join(root, ckpt_layout.LATEST), "w") as f:
        f.write("garbage")
    assert _latest(root) == "global_step_10"
    # A checkpoint directory itself resolves to itself.
    assert ckpt_layout.latest_checkpoint(os.path.join(root, "global_step_1")) == os.path.join(root, "global_step_1")


def test_retention_never_deletes_the_newest_complete_checkpoint_and_cleans_leftovers(tmp_path):
    root = str(tmp_path)
    _save(root, 1)
    _save(root, 2)
    os.makedirs(os.path.join(root, "global_step_9"))  # newer but incomplete: neither counted nor touched
    os.makedirs(os.path.join(root, ".tmp_global_step_8"))  # a crashed save
    os.makedirs(os.path.join(root, ".del_global_step_0"))  # a crashed retention
    _save(root, 3, keep=1)
    assert sorted(os.listdir(root)) == ["global_step_3", "global_step_9", ckpt_layout.LATEST]
    assert _latest(root) == "global_step_3"
    # Retention keeps the checkpoint just written even when higher steps exist (rollback).
    _save(root, 5)
    _save(root, 4, keep=1)
    assert ckpt_layout.complete_steps(root) == [4] and _latest(root) == "global_step_4"


def test_remote_copy_is_complete_only_with_its_marker_and_downloads_honour_keep(tmp_path):
    remote = "memory://enginekit-test/step2"
    _save(str(tmp_path / "a"), 2, remote=remote)
    fs, path = fsspec.core.url_to_fs(remote)
    assert sorted(os.path.basename(p) for p in fs.ls(path, detail=False)) == [
        "__0_0.distcp",
        ckpt_layout.MARKER,
        "extra_rank0.pt",
        MANIFEST,
    ]
    # Downloaded into a temporary directory, deleted by finish_load ...
    found, downloaded = ckpt_layout.resolve(str(tmp_path / "b"), remote)
    assert found == downloaded and os.path.basename(found).startswith(".tmp_download_")
    ckpt_layout.finish_load(downloaded)
    assert os.listdir(tmp_path / "b") == []
    # ... or kept as a regular local checkpoint that loads without the remote.
    found, downloaded = ckpt_layout.resolve(str(tmp_path / "c"), remote, keep_download=True)
    assert downloaded is None and found == str(tmp_path / "c" / "global_step_2")
    assert _latest(tmp_path / "c") == "global_step_2"
    # An upload cut short (no marker) is refused by name, not loaded half.
    fs.rm(f"{path}/{ckpt_layout.MARKER}")
    with pytest.raises(ckpt_layout.CheckpointError, match="upload did not finish"):
        ckpt_layout.resolve(str(tmp_path / "d"), remote)


def test_a_failed_remote_copy_raises_but_keeps_the_local_checkpoint(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    with pytest.raises(ckpt_layout.CheckpointError, match="rank 0 failed committing .*global_step_1"):
        _save(str(tmp_path / "ckpt"), 1, remote=f"file://{blocker}/copy")
    assert _latest(tmp_path / "ckpt") == "global_step_1"


# ----------------------------------------------------------------------------- real backends, SIGKILL
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("hf") / "llama", "llama")


@pytest.fixture(scope="module")
def crashed(model_dir, tmp_path_factory):
    """Per backend (computed on first use): every stop's on-disk state right after the kill,
    and what a fresh process made of it (:func:`_ckpt_targets.inspect_crashed`)."""
    cache: dict = {}

    def get(strategy: str) -> dict:
        if strategy not in cache:
            cache[strategy] = _kill_at_every_stop(strategy, model_dir, str(tmp_path_factory.mktemp(f"crash_{strategy}")))
        return cache[strategy]

    return get


def _kill_at_every_stop(strategy: str, model_dir: str, base: str) -> dict:
    cases = {stop: os.path.join(base, stop) for stop in T.STOPS}
    # All stops at once: each is its own single-rank process.
    groups = {stop: RankGroup(T.save_until_killed, 1, (strategy, model_dir, d, stop), d) for stop, d in cases.items()}
    facts = {}
    try:
        deadline = time.time() + START_TIMEOUT_S
        for stop, group in groups.items():
            reached = wait_for(os.path.join(cases[stop], "reached"), group, deadline)
            group.kill()
            assert reached, f"{strategy}: the save never reached {stop!r}" + group.logs_tail()
            facts[stop] = {"exitcode": group.procs[0].exitcode, **_on_disk(cases[stop])}
    finally:
        for group in groups.values():
            group.kill()
    url = f"memory://enginekit-crash-{strategy}/step7"
    inspected = run_distributed(T.inspect_crashed, 1, strategy, model_dir, cases, url, timeout=300)[0]
    for stop in T.STOPS:
        facts[stop].update(inspected[stop])
        facts[stop]["expect"] = {s: torch.load(os.path.join(cases[stop], f"expect_{s}.pt")) for s in (1, 2)}
    facts["memory"] = {k: v for k, v in inspected.items() if k.startswith("memory")}
    return facts


def _on_disk(case_dir: str) -> dict:
    root, remote = os.path.join(case_dir, "ckpt"), os.path.join(case_dir, "remote")
    tmp = os.path.join(root, ".tmp_global_step_2")
    with open(os.path.join(root, ckpt_layout.LATEST)) as f:
        latest = f.read().strip()
    return {
        "listing": sorted(os.listdir(root)),
        "latest": latest,
        "tmp_files": sorted(os.listdir(tmp)) if os.path.isdir(tmp) else None,
        "remote_files": sorted(os.listdir(remote)) if os.path.isdir(remote) else None,
    }


def _backend_files(names) -> list[str]:
    return [n for n in names if n != ckpt_layout.MARKER and not n.startswith("extra_rank")]


# What the root must look like after a kill at each stop (proves the kill hit that step).
def _check_state(stop: str, f: dict) -> None:
    if stop in ("shard_written", "marker_written", "latest_written"):
        assert "global_step_2" not in f["listing"] and ".tmp_global_step_2" in f["listing"], f["listing"]
        assert _backend_files(f["tmp_files"]), f"no backend file was written before the kill: {f['tmp_files']}"
        assert (ckpt_layout.MARKER in f["tmp_files"]) == (stop != "shard_written"), f["tmp_files"]
        assert f["latest"] == ("2" if stop == "latest_written" else "1")
    if stop == "retention":
        assert f["listing"] == [".del_global_step_1", "global_step_2", ckpt_layout.LATEST] and f["latest"] == "2"
    if stop == "upload":
        assert "global_step_2" in f["listing"] and f["latest"] == "2"
        assert _backend_files(f["remote_files"]) and ckpt_layout.MARKER not in f["remote_files"], f["remote_files"]


@pytest.mark.slow
@pytest.mark.parametrize("stop", list(T.STOPS))
@pytest.mark.parametrize("strategy", BACKENDS)
def test_a_save_killed_at_any_step_leaves_the_newest_complete_checkpoint_loadable(crashed, strategy, stop):
    f = crashed(strategy)[stop]
    assert f["exitcode"] == -9, f"the saving process was not the one killed: exit code {f['exitcode']}"
    _check_state(stop, f)
    want = T.LOADS_AFTER_KILL[stop]
    assert f["step"] == want, f"after a kill at {stop!r} a fresh process loaded step {f['step']}, expected {want}"
    bad = [k for k, v in f["expect"][want].items() if not torch.equal(f["params"][k], v)]
    assert not bad, f"loaded params differ from step {want}'s: {bad}"
    # The next save publishes normally and removes every leftover (.tmp_*, .del_*).
    assert f["listing_after_next_save"] == sorted({n for n in f["listing"] if not n.startswith(".")} | {"global_step_3"})
    assert f["reloaded_step"] == 3
    if stop == "upload":
        assert f["remote_error"] and "upload did not finish" in f["remote_error"] and "fix:" in f["remote_error"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", BACKENDS)
def test_remote_copy_round_trip_honours_del_local_after_load(crashed, strategy):
    mem = crashed(strategy)["memory"]
    dropped, kept = mem["memory_keepFalse"], mem["memory_keepTrue"]
    assert dropped["step"] == kept["step"] == 7 and dropped["same_params"] and kept["same_params"]
    assert dropped["listing"] == [], f"del_local_after_load=True left {dropped['listing']}"
    assert kept["listing"] == ["global_step_7", ckpt_layout.LATEST] and kept["local_reload"] == 7
