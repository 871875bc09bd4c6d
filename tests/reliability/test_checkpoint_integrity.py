"""Checkpoints never run code and never load garbage (issue 13, item 2).

For each backend, one checkpoint is saved at step 2 and the engine trains one more step. Then
copies of the checkpoint are tampered with (``_integrity_targets.apply``) and loaded into that
engine. Every tampered copy must be refused with a ``ValueError`` that names the file and the
checkpoint, no code in it may run (the pickles ``touch`` a marker file), and the engine's
training state must stay bit-identical. Last, the untouched checkpoint must still load
bit-exactly (params, optimizer state, LR, step, RNGs).

On main before the fix: the ``extra_rank0.pt`` and ``.metadata`` pickles ran their code, flipped
or NaN bytes in a shard loaded silently, a truncated shard raised torch's
``CheckpointException`` (a ``BaseException``) naming no file.
"""

from __future__ import annotations

import os

import pytest

from tests.reliability import _integrity_targets as T
from tests.reliability._step_common import BACKENDS, run

pytestmark = pytest.mark.slow

# Every file of the checkpoint replaced by a code-running pickle, a torch archive holding one
# for the per-rank state, and byte-level damage to a weight shard and the per-rank state.
SHARD = "__0_0.distcp"
CASES = [
    (None, "evil"),
    ("extra_rank0.pt", "evil_zip"),
    (SHARD, "truncate"),
    (SHARD, "empty"),
    (SHARD, "flip"),
    (SHARD, "nan"),
    ("extra_rank0.pt", "truncate"),
    ("extra_rank0.pt", "delete"),
]
# A forged manifest vouching for a code-running file: only the scan can refuse these.
FORGED = [(".metadata", "forged"), ("extra_rank0.pt", "forged"), (SHARD, "forged")]


@pytest.fixture(scope="module")
def results(model_dir, tmp_path_factory):
    out = {}
    for strategy in BACKENDS:
        root = str(tmp_path_factory.mktemp(f"integrity_{strategy}"))
        out[strategy] = run(T.tamper_and_load, 1, strategy, model_dir, root, CASES + FORGED)[0]
        out[f"{strategy}-noverify"] = run(T.tamper_and_load, 1, strategy, model_dir, root + "_nv", FORGED, ["checkpoint.verify=false"])[0]
    return out


@pytest.mark.parametrize("verify", ["", "-noverify"])
@pytest.mark.parametrize("strategy", BACKENDS)
def test_tampered_checkpoints_are_refused_naming_the_file_without_running_code(results, strategy, verify):
    r = results[f"{strategy}{verify}"]
    assert r["cases"], "no case ran"
    if not verify:
        assert {rel for rel, kind in r["cases"] if kind == "evil"} == set(r["files"]), "every file was replaced once"
    for (rel, kind), case in r["cases"].items():
        what = f"{rel} ({kind})"
        assert not case["ran_code"], f"{what}: the checkpoint ran code"
        assert case["error"] is not None, f"{what}: loaded without an error"
        name, message, is_value_error = case["error"]
        assert is_value_error, f"{what}: {name} is not a ValueError: {message}"
        assert os.path.basename(rel) in message and case["dir"] in message, f"{what}: the message names neither: {message}"
        assert "fix:" in message, f"{what}: no fix in {message}"
        assert case["changed"] == [], f"{what}: the refused load changed {case['changed'][:5]}"


@pytest.mark.parametrize("strategy", BACKENDS)
def test_a_checkpoint_without_manifest_loads_only_with_verify_off(results, strategy):
    refused, loaded = results[strategy]["legacy"], results[f"{strategy}-noverify"]["legacy"]
    assert isinstance(refused, str) and "manifest.json" in refused and "checkpoint.verify=false" in refused, refused
    assert loaded == [], f"with verify off the pre-manifest checkpoint did not load exactly: {loaded}"


@pytest.mark.parametrize("strategy", BACKENDS)
def test_the_untouched_checkpoint_still_resumes_bit_exactly(results, strategy):
    r = results[strategy]
    assert r["intact_diff"] == [], r["intact_diff"][:5]
