"""Checkpoint edge cases (issue 28): a LoRA checkpoint of a tied-embedding model, checkpoints that
are symbolic links, a checkpoint of another model, and a full disk during a save.

* **LoRA on a tied model** (FSDP; Qwen2-style ``tie_word_embeddings``): the checkpoint holds only
  trainable state. Its tensors add up to exactly ``trainable elements * 4 bytes * (1 + 2 AdamW
  moments) + 4 bytes of step per trainable tensor``, and its shard files to what ``torch.save``
  makes of those tensors plus a fixed allowance for the optimizer's param-group entries; the
  resume is bit-exact. Before the fix the frozen tied ``lm_head.weight`` was saved in full (torch's
  ``ignore_frozen_params`` drops a frozen parameter under its first name only).
* **Symbolic links** (old checkpoints moved to another disk and linked back): retention unlinks a
  linked checkpoint and keeps the data it points to; a save after any interrupted retention (a
  leftover ``.del_*`` directory, file, link or broken link) succeeds; a retention failure names
  the checkpoint and does not fail the save that was already published; loading through a link
  works; ``save_hf``'s directory swap handles a linked output directory. Before the fix retention
  called ``rmtree`` on the link, failing the save after publishing and every later save.
* **Another model's checkpoint**: refused with a ``ValueError`` naming the tensor and both shapes,
  saying the checkpoint is intact, with the engine's state untouched (both backends). Before:
  DCP's / megatron's size error, reported as a failed load advising "an intact checkpoint".
* **Full disk** (ENOSPC injected into the backend writer's fsync, both backends): a
  ``CheckpointError`` (an ``Exception``) saying "no space left on device" and naming the path; the
  temporary directory is gone, the earlier checkpoint loads exactly, the next save works. Before:
  torch's ``CheckpointException``, a ``BaseException``, escaped bare.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
from functools import partial

import pytest
import torch

from engine_api import ckpt_layout
from posttrain.tiny_model import build_tiny_model
from tests.reliability._ckpt_state import OVERRIDES, full_state, seed_all, state_diff, train_steps
from tests.reliability._ckpt_targets import _on_fsync
from tests.reliability._step_common import BACKENDS, new_engine, reset_layout, run
from tests.support.ckpt_protocol import latest_name as _latest
from tests.support.ckpt_protocol import save_stand_in as _save

STEP2 = f"{ckpt_layout.PREFIX}2"


# ----------------------------------------------------------------------------- symlinks, protocol alone
def _moved(root: str, step: int, elsewhere: str) -> str:
    """Move checkpoint ``step`` out of ``root`` (another disk) and link it back; returns the target."""
    target = os.path.join(elsewhere, f"{ckpt_layout.PREFIX}{step}")
    shutil.move(os.path.join(root, f"{ckpt_layout.PREFIX}{step}"), target)
    os.symlink(target, os.path.join(root, f"{ckpt_layout.PREFIX}{step}"))
    return target


def test_a_symlinked_checkpoint_loads_and_retention_unlinks_it_keeping_the_data(tmp_path):
    root, elsewhere = str(tmp_path / "root"), str(tmp_path / "other_disk")
    os.makedirs(elsewhere)
    _save(root, 1)
    target = _moved(root, 1, elsewhere)
    files = sorted(os.listdir(target))
    # A linked checkpoint is a checkpoint: it resolves and verifies through the link.
    assert _latest(root) == f"{ckpt_layout.PREFIX}1"
    path, _, info = ckpt_layout.open_checkpoint(root, None, False)
    assert path == os.path.join(root, f"{ckpt_layout.PREFIX}1") and info["global_step"] == 1
    # Retention removes the link, never the data on the other disk, and leaves nothing behind.
    _save(root, 2, keep=1)
    assert sorted(os.listdir(root)) == [STEP2, ckpt_layout.LATEST]
    assert sorted(os.listdir(target)) == files


@pytest.mark.parametrize("kind", ["dir", "file", "link", "broken_link"])
def test_a_save_after_an_interrupted_retention_succeeds_whatever_it_left(tmp_path, kind):
    """Retention renames a checkpoint to ``.del_global_step_<k>`` and then deletes it; a run
    killed (or failing) in between leaves that name behind as whatever the checkpoint was."""
    root, elsewhere = str(tmp_path / "root"), str(tmp_path / "other_disk")
    os.makedirs(elsewhere)
    _save(root, 1)
    _save(root, 2)
    leftover = os.path.join(root, f"{ckpt_layout.TRASH}{ckpt_layout.PREFIX}0")
    kept = os.path.join(elsewhere, f"{ckpt_layout.PREFIX}0")
    os.makedirs(kept)
    with open(os.path.join(kept, "shard"), "w") as f:
        f.write("data on the other disk")
    if kind == "dir":
        os.makedirs(os.path.join(leftover, "sub"))
    elif kind == "file":
        open(leftover, "w").close()
    elif kind == "link":
        os.symlink(kept, leftover)
    else:
        os.symlink(os.path.join(elsewhere, "gone"), leftover)
    _save(root, 3, keep=1)
    assert sorted(os.listdir(root)) == [f"{ckpt_layout.PREFIX}3", ckpt_layout.LATEST]
    assert open(os.path.join(kept, "shard")).read() == "data on the other disk"


def test_a_retention_failure_names_the_checkpoint_and_keeps_the_published_save(tmp_path, monkeypatch, capfd):
    root = str(tmp_path)
    _save(root, 1)

    def failing_rmtree(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied (injected)", path)

    monkeypatch.setattr(shutil, "rmtree", failing_rmtree)
    _save(root, 2, keep=1)  # published before retention: a failing delete must not fail it
    monkeypatch.undo()
    err = capfd.readouterr().err
    assert os.path.join(root, f"{ckpt_layout.PREFIX}1") in err and "Permission denied" in err and "fix:" in err, err
    assert _latest(root) == STEP2
    # The next save cleans the leftover and applies retention.
    _save(root, 3, keep=1)
    assert sorted(os.listdir(root)) == [f"{ckpt_layout.PREFIX}3", ckpt_layout.LATEST]


class _StandInModel:
    """What ``posttrain.export._write_dir`` needs of an HF model: ``save_pretrained``."""

    def __init__(self, text: str) -> None:
        self.text = text

    def save_pretrained(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "model.safetensors"), "w") as f:
            f.write(self.text)


def test_save_hf_into_a_symlinked_output_directory_replaces_the_export_where_it_points(tmp_path):
    from posttrain.export import _write_dir

    out, disk = str(tmp_path / "hf"), tmp_path / "other_disk"
    elsewhere = str(disk / "hf")
    no_tokenizer = str(tmp_path / "base")  # no tokenizer there: weights only
    os.makedirs(no_tokenizer)
    os.makedirs(disk)
    _write_dir(out, _StandInModel("v1"), no_tokenizer)
    shutil.move(out, elsewhere)
    os.symlink(elsewhere, out)
    for version in ("v2", "v3"):  # the second export meets whatever the first one left
        _write_dir(out, _StandInModel(version), no_tokenizer)
        assert os.path.islink(out) and open(os.path.join(out, "model.safetensors")).read() == version
    assert sorted(os.listdir(tmp_path)) == ["base", "hf", "other_disk"] and os.listdir(disk) == ["hf"]
    # A leftover .old / .tmp that is a link (broken or not) is unlinked, its target kept.
    plain = str(tmp_path / "plain")
    os.symlink(elsewhere, plain + ".old")
    os.symlink(str(tmp_path / "gone"), plain + ".tmp")
    _write_dir(plain, _StandInModel("v4"), no_tokenizer)
    _write_dir(plain, _StandInModel("v5"), no_tokenizer)
    assert open(os.path.join(plain, "model.safetensors")).read() == "v5"
    assert open(os.path.join(elsewhere, "model.safetensors")).read() == "v3"
    assert not os.path.lexists(plain + ".old") and not os.path.lexists(plain + ".tmp")


# ----------------------------------------------------------------------------- LoRA on a tied model
LORA = ("model.lora.rank=4", "model.lora.alpha=8")
MOMENTS = 2  # AdamW: exp_avg, exp_avg_sq (plus one 0-dim fp32 step per parameter)
# The optimizer's param-group entries (lr, betas, ...: 13 small pickles, 18.5 KB measured) are
# stored beside the tensors whatever the model size; the vocabulary makes the tied head 256 KiB.
PARAM_GROUP_ALLOWANCE = 32 << 10
TIED_VOCAB = 2048


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tied") / "qwen2", "qwen2", vocab_size=TIED_VOCAB, hidden_size=32, intermediate_size=64)


def lora_tied(rank, world, model_dir, root) -> dict:
    """Train 1 step, save, train 1 more (the reference); a fresh engine loads and trains the same step."""
    torch.set_num_threads(1)
    engine = new_engine("fsdp", model_dir, *OVERRIDES, *LORA)
    names = {}
    for name, p in engine.model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    tied = [sorted(n) for n in names.values() if len(n) > 1]
    trainable = [p for p in engine.model.parameters() if p.requires_grad]
    seed_all(0)
    train_steps(engine, 1)
    saved = full_state(engine)
    engine.save_checkpoint(root, global_step=1)
    after = train_steps(engine, 1)
    end = full_state(engine)
    fresh = new_engine("fsdp", model_dir, *OVERRIDES, *LORA)
    seed_all(7)
    fresh.load_checkpoint(root)
    loaded = state_diff(saved, full_state(fresh))
    again = train_steps(fresh, 1)
    return {
        "tied": tied,
        "elements": sum(p.numel() for p in trainable),
        "tensors": len(trainable),
        "shapes": [tuple(p.shape) for p in trainable],
        "loaded_diff": loaded,
        "same_step": again == after,
        "end_diff": state_diff(end, full_state(fresh)),
    }


def _torch_save_len(shape, dtype=torch.float32) -> int:
    buf = io.BytesIO()
    torch.save(torch.zeros(shape, dtype=dtype), buf)
    return len(buf.getvalue())


@pytest.mark.slow
def test_a_lora_checkpoint_of_a_tied_model_holds_only_trainable_state(tied_dir, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    r = run(lora_tied, 1, tied_dir, str(tmp_path))[0]
    assert any(any(n.endswith("lm_head.weight") for n in group) for group in r["tied"]), f"the model is not tied: {r['tied']}"
    ckpt = str(tmp_path / f"{ckpt_layout.PREFIX}1")
    meta = FileSystemReader(ckpt).read_metadata()  # our own just-written checkpoint
    tensors = {k: m for k, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    data = sum(torch.Size(m.size).numel() * m.properties.dtype.itemsize for m in tensors.values())
    want = r["elements"] * 4 * (1 + MOMENTS) + 4 * r["tensors"]
    frozen = sorted(k for k in tensors if ".lora_" not in k)
    assert data == want, f"the checkpoint's tensors hold {data} bytes, the trainable state {want}; not adapters: {frozen}"
    # On disk: each tensor is one torch.save archive in a shard (DCP's format), so the shards hold
    # exactly what torch.save makes of the trainable state, plus the param-group entries.
    shards = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.endswith(".distcp"))
    archives = sum((1 + MOMENTS) * _torch_save_len(s) + _torch_save_len(()) for s in r["shapes"])
    assert archives <= shards <= archives + PARAM_GROUP_ALLOWANCE, (shards, archives)
    assert r["loaded_diff"] == [] and r["same_step"] and r["end_diff"] == [], r


# ----------------------------------------------------------------------------- engines: disk full, links, another model
def _error(fn) -> dict | None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the test judges the type (CheckpointException is a BaseException)
        return {"type": type(exc).__name__, "is_exception": isinstance(exc, Exception), "message": str(exc)}
    return None


def edges(rank, world, strategy, model_dir, other_dir, root, elsewhere) -> dict:
    """Save step 1; a save of step 2 hits a full disk; load step 1 back; save step 2 for real;
    move step 1 to another disk and load it through a link; save step 3 keeping 1 (retention
    over the link); last, an engine of another model loads step 3 (refused, state untouched)."""
    torch.set_num_threads(1)
    out = {}
    engine = new_engine(strategy, model_dir, *OVERRIDES)
    seed_all(0)
    train_steps(engine, 1)
    saved1 = full_state(engine)
    engine.save_checkpoint(root, global_step=1)
    train_steps(engine, 1)

    def disk_full():
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    real_fsync = os.fsync
    _on_fsync(os.path.join(root, f"{ckpt_layout.TMP}{STEP2}"), instead=disk_full)
    try:
        out["enospc"] = _error(partial(engine.save_checkpoint, root, global_step=2))
    finally:
        os.fsync = real_fsync
    out["listing_after_enospc"] = sorted(os.listdir(root))
    out["loaded_after_enospc"] = engine.load_checkpoint(root)
    out["diff_after_enospc"] = state_diff(saved1, full_state(engine))
    train_steps(engine, 1)
    engine.save_checkpoint(root, global_step=2)
    out["listing_after_save"] = sorted(os.listdir(root))

    target = _moved(root, 1, elsewhere)
    out["linked_load"] = engine.load_checkpoint(os.path.join(root, f"{ckpt_layout.PREFIX}1"))
    out["diff_linked"] = state_diff(saved1, full_state(engine))
    train_steps(engine, 1)
    out["retention_over_link"] = _error(partial(engine.save_checkpoint, root, global_step=3, max_ckpt_to_keep=1))
    out["listing_after_retention"] = sorted(os.listdir(root))
    out["target_kept"] = sorted(os.listdir(target))
    del engine
    reset_layout(strategy)

    other = new_engine(strategy, other_dir, *OVERRIDES)
    before = full_state(other)
    out["other_model"] = _error(partial(other.load_checkpoint, root))
    out["other_diff"] = state_diff(before, full_state(other))
    return out


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """The reliability model (``make_model``: llama, hidden 32, 4 heads, 2 KV heads) with another MLP width."""
    return build_tiny_model(tmp_path_factory.mktemp("other") / "llama", "llama", vocab_size=64, hidden_size=32, intermediate_size=48)


@pytest.fixture(scope="module")
def edge_results(model_dir, other_dir, tmp_path_factory):
    out = {}
    for strategy in BACKENDS:
        base = tmp_path_factory.mktemp(f"edges_{strategy}")
        os.makedirs(base / "other_disk")
        out[strategy] = run(edges, 1, strategy, model_dir, other_dir, str(base / "ckpt"), str(base / "other_disk"))[0]
        out[strategy]["root"] = str(base / "ckpt")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", BACKENDS)
def test_a_full_disk_during_a_save_is_a_named_error_and_loses_nothing(edge_results, strategy):
    r = edge_results[strategy]
    err = r["enospc"]
    assert err is not None, "the save with a full disk did not fail"
    assert err["is_exception"] and err["type"] == "CheckpointError", err
    assert "no space left on device at" in err["message"] and r["root"] in err["message"], err["message"]
    assert "fix: free space there or point the checkpoint directory elsewhere" in err["message"], err["message"]
    assert r["listing_after_enospc"] == [f"{ckpt_layout.PREFIX}1", ckpt_layout.LATEST], "the temporary directory was left"
    assert r["loaded_after_enospc"] == 1 and r["diff_after_enospc"] == [], r["diff_after_enospc"]
    assert r["listing_after_save"] == [f"{ckpt_layout.PREFIX}1", STEP2, ckpt_layout.LATEST]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", BACKENDS)
def test_a_symlinked_checkpoint_loads_and_retention_unlinks_it(edge_results, strategy):
    r = edge_results[strategy]
    assert r["linked_load"] == 1 and r["diff_linked"] == [], r["diff_linked"]
    assert r["retention_over_link"] is None, r["retention_over_link"]
    assert r["listing_after_retention"] == [f"{ckpt_layout.PREFIX}3", ckpt_layout.LATEST]
    assert "enginekit.json" in r["target_kept"], "retention deleted the linked checkpoint's data"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", BACKENDS)
def test_a_checkpoint_of_another_model_is_refused_naming_tensor_and_shapes(edge_results, strategy):
    r = edge_results[strategy]
    err = r["other_model"]
    assert err is not None and err["type"] == "ValueError", err
    message = err["message"]
    assert "of another model" in message and "not corrupt" in message and "intact checkpoint" not in message, message
    # hidden 32, MLP width 64 in the checkpoint, 48 in this model: a down/up projection is named with both shapes
    assert "in the checkpoint" in message and "in this model" in message and "fix:" in message, message
    assert any(("mlp" in line) and ("64" in line) and ("48" in line) for line in message.splitlines()), message
    assert r["other_diff"] == [], f"the refused load changed {r['other_diff'][:5]}"


@pytest.mark.parametrize("rank", [0, 1])
def test_a_failed_write_leaves_the_shared_directory_to_rank_0(tmp_path, monkeypatch, rank):
    """A rank whose write fails alone (its disk full) must not delete the temporary directory
    its peers are still writing into: their errors would then name a vanished file, not the
    cause. Rank 0, which created it, removes it; another rank leaves it (never loaded; the next
    save's begin() removes it)."""
    tmp = tmp_path / f"{ckpt_layout.TMP}{ckpt_layout.PREFIX}1"
    tmp.mkdir()
    (tmp / "peer_shard.distcp").write_bytes(b"a peer's write in progress")
    monkeypatch.setattr(ckpt_layout, "group_rank", lambda group: rank)
    with pytest.raises(ckpt_layout.CheckpointError, match="no space left on device") as err:
        with ckpt_layout.writing(str(tmp)):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
    assert tmp.exists() == (rank != 0)
    assert ("was removed" if rank == 0 else "is removed by rank 0 or the next save") in str(err.value)
