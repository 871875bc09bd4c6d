"""The DCP ``.metadata`` allowlist refuses every class a forged file could use to run code, and
still reads what torch.distributed.checkpoint really writes (issue 28, item 9).

torch reads ``.metadata`` with plain ``pickle.load``, so ``engine_api.ckpt_integrity.scan``
parses it first with an unpickler that builds only the classes DCP writes there. These tests
are in-process and fast (no engine, no process group): a real single-process DCP save is the
"must load" reference, and hand-written pickles (raw opcodes, so they name exactly the
module/attribute an attacker would) are the "must refuse" cases. Every refused pickle would,
if built, create a marker file: the marker must not exist afterwards.
"""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch

from engine_api import ckpt_integrity


def _global_call(module: str, name: str, *args: str) -> bytes:
    """Protocol-0 pickle of ``module.name(*args)`` (string args): GLOBAL, MARK, UNICODE..., TUPLE,
    REDUCE, STOP. Written by hand so the module/name pair is exactly the one under test."""
    body = b"".join(b"V" + a.encode("raw_unicode_escape") + b"\n" for a in args)
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n(" + body + b"tR."


def _write_metadata(directory, payload: bytes) -> str:
    path = os.path.join(str(directory), ".metadata")
    with open(path, "wb") as f:
        f.write(payload)
    return path


@pytest.fixture
def dcp_dir(tmp_path):
    """A real DCP checkpoint: float32 and bf16 tensors (torch dtypes in the metadata) and a
    non-tensor object (a ``BytesStorageMetadata`` item, scanned with ``weights_only``)."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(3, 2), "h": torch.randn(4, dtype=torch.bfloat16), "extra": {"step": 3, "name": "run"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving as a single process"
        dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    return tmp_path / "ckpt"


def test_the_metadata_dcp_writes_passes_the_scan(dcp_dir):
    """What must keep working: a plain DCP save (dtypes, sizes, storage index, a bytes item)."""
    ckpt_integrity.scan(str(dcp_dir / ".metadata"))
    meta = ckpt_integrity._load_dcp_metadata(str(dcp_dir / ".metadata"))
    assert meta.state_dict_metadata["h"].properties.dtype is torch.bfloat16  # a torch dtype was built
    assert list(meta.state_dict_metadata["w"].size) == [3, 2]


# (module, name, args after the marker path): callables that would write the marker file. Each
# is what a loosened allowlist lets through: any `torch.<attr>` (not only dtypes), any name in an
# allowed module, a module prefix, the usual os/builtins/subprocess gadgets.
ATTACKS = [
    ("torch", "save", "payload"),  # allowed module "torch", but not a dtype
    ("torch.serialization", "save", "payload"),  # allowed module (_get_layout), other name
    ("pathlib", "Path", "{marker}"),  # allowed module (PosixPath), other name
    ("os", "system", "touch {marker}"),  # (pathlib.Path alone writes nothing: refused by name all the same)
    ("builtins", "exec", "open({marker!r}, 'w').close()"),
    ("subprocess", "check_call", "touch {marker}"),
]


@pytest.mark.parametrize(("module", "name", "args"), [(m, n, a) for m, n, *a in ATTACKS], ids=[f"{m}.{n}" for m, n, *_ in ATTACKS])
def test_a_forged_metadata_asking_for_anything_else_is_refused_without_running_it(tmp_path, module, name, args):
    marker = str(tmp_path / "ran")
    # save(obj, path) writes the marker; the others take the command / code / path as given.
    call = (args[0], marker) if name == "save" else tuple(a.format(marker=marker) for a in args)
    path = _write_metadata(tmp_path, _global_call(module, name, *call))
    with pytest.raises(ValueError, match=rf"asks for {module}\.{name}.*refused"):
        ckpt_integrity.scan(path)
    assert not os.path.exists(marker), f"{module}.{name} ran"


def test_a_torch_dtype_is_the_only_torch_attribute_let_through(tmp_path):
    """``torch.float16`` (a dtype) builds; ``torch.Tensor`` / ``torch.ones`` (not dtypes,
    callables) are refused by name."""
    ok = _write_metadata(tmp_path, b"ctorch\nfloat16\n.")
    assert ckpt_integrity._load_dcp_metadata(ok) is torch.float16
    for name in ("ones", "Tensor", "load"):
        path = _write_metadata(tmp_path, _global_call("torch", name))
        with pytest.raises(ValueError, match=rf"asks for torch\.{name}"):
            ckpt_integrity.scan(path)


def test_the_dcp_classes_are_allowed_only_in_their_own_module(tmp_path):
    """An allowed class name under another module (``os.Metadata`` would be ``os``'s attribute)
    is refused: the pair (module, name) is allowed, not the name alone."""
    for module, name in (("os", "Metadata"), ("torch.distributed.checkpoint.metadata", "os"), ("collections", "Size")):
        path = _write_metadata(tmp_path, _global_call(module, name))
        with pytest.raises(ValueError, match=rf"asks for {module}\.{name}"):
            ckpt_integrity.scan(path)


@pytest.mark.parametrize("order", ["as-saved", "tensors-first"])
@pytest.mark.parametrize("env", ["", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"])
def test_a_code_running_object_inside_a_shard_is_refused(dcp_dir, tmp_path, monkeypatch, order, env):
    """The non-tensor items of a shard are read by torch with ``weights_only=False``: the scan
    loads each with ``weights_only=True``. Here the last non-tensor item's bytes are replaced by
    a pickle that would write the marker. ``tensors-first``: the metadata (rewritten, as a
    forged manifest allows) lists the tensor items first, so every item must be looked at, not
    only a leading run. ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` (a common workaround for old
    checkpoints) turns torch's *default* to ``weights_only=False``: the scan must not rely on it."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    if env:
        monkeypatch.setenv(env, "1")
    meta = ckpt_integrity._load_dcp_metadata(str(dcp_dir / ".metadata"))
    is_bytes = {i: isinstance(meta.state_dict_metadata[i.fqn], BytesStorageMetadata) for i in meta.storage_data}
    if order == "tensors-first":
        meta.storage_data = dict(sorted(meta.storage_data.items(), key=lambda kv: is_bytes[kv[0]]))
        (dcp_dir / ".metadata").write_bytes(pickle.dumps(meta))
        assert not is_bytes[next(iter(meta.storage_data))], "a tensor item comes first"
    info = [s for i, s in meta.storage_data.items() if is_bytes[i]][-1]
    fqn = [i.fqn for i in meta.storage_data if is_bytes[i]][-1]
    marker = str(tmp_path / "ran")
    evil = pickle.dumps(_Evil(marker))
    assert len(evil) <= info.length, "the forged object must fit in the genuine item's bytes"
    shard = dcp_dir / str(info.relative_path)
    data = bytearray(shard.read_bytes())
    data[info.offset : info.offset + len(evil)] = evil
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{fqn.replace('.', r'[.]')}.*not plain tensor data.*refused"):
        ckpt_integrity.scan(str(dcp_dir / ".metadata"))
    assert not os.path.exists(marker)


@pytest.mark.parametrize("env", ["", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"])
def test_torch_files_load_only_as_plain_data(tmp_path, monkeypatch, env):
    """``*.pt`` (the per-rank state): a genuine one passes; a bare code-running pickle and a
    ``torch.save`` archive holding one are refused without running; a truncated one is named
    unreadable. Other files (JSON, raw shards) are not unpickled, so not scanned."""
    if env:
        monkeypatch.setenv(env, "1")
    good = tmp_path / "extra_rank0.pt"
    torch.save({"scheduler": {"last_epoch": 3}, "rng": torch.arange(5), "global_step": 3}, good)
    ckpt_integrity.scan(str(good))
    marker = str(tmp_path / "ran")
    bare, archive = tmp_path / "bare.pt", tmp_path / "archive.pt"
    bare.write_bytes(pickle.dumps(_Evil(marker)))
    torch.save({"state": _Evil(marker)}, archive)
    for path in (bare, archive):
        with pytest.raises(ValueError, match=r"not plain tensor data.*refused: loading it could run code"):
            ckpt_integrity.scan(str(path))
    assert not os.path.exists(marker)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:40])
    with pytest.raises(ValueError, match="unreadable"):
        ckpt_integrity.scan(str(cut))
    other = tmp_path / "notes.json"
    other.write_bytes(pickle.dumps(_Evil(marker)))  # never unpickled by a loader: not scanned
    ckpt_integrity.scan(str(other))
    assert not os.path.exists(marker)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))
