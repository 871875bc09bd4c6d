"""``make gpu-check`` on CPU, on a simulated bare GPU machine (issues 18 and 52).

The machine ``make gpu-check`` runs on has CUDA torch, transformers, peft, pytest and the wheels of
``ci/gpu_wheels.sh``, and none of the optional extras this venv holds (Tinker, Ray, ``datasets``,
vLLM, the loggers, the server's web stack, TE, flash-attn). A ``sitecustomize`` on ``PYTHONPATH``
hides them (:data:`tests.support.extras.OPTIONAL_MODULES`) from every process of the run: an
import fails as it would there (``find_spec`` says absent too), and pytest loads only the plugin
that machine has (pytest-timeout). Under it:

* ``pytest -m gpu`` collects with no error (issue 52: five modules that imported ``tinker``,
  ``ray`` and ``zstandard`` at module level stopped the GPU run before its first test), the
  modules that need a missing extra skipped by name; where every extra must be installed
  (``ENGINEKIT_REQUIRE_EXTRAS=1``, as in ``make test``'s venv) the same module is an error;
* the gpu-check's smoke run passes: the same steps and report as on a GPU machine, the GPU tests
  skipped, every throughput row (hand-written loop, FSDP engine, each compiled and not, megatron)
  run on a tiny fp32 model; the report names every step, the environment and the optional GPU
  packages, and the loop and the engines start from the same loss (same weights, same batch,
  same micro-batches);
* a row that cannot run (megatron-core hidden too) is a failed row naming why, and the row
  measured before it is kept.

Without a GPU, the loop's CUDA attention call is checked against its CPU path with a stand-in
for torch's ``varlen_attn`` (the layouts, GQA, causal per sequence).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support.extras import OPTIONAL_MODULES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = ["loop", "fsdp engine", "megatron (local spec)", "loop compiled", "fsdp engine compiled"]

_HIDE = '''"""A bare GPU machine, simulated (tests/test_gpu_check.py): these modules are not installed."""
import sys

HIDDEN = frozenset({hidden!r})


class _Without:
    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return self._finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self._finder, attr)


sys.meta_path[:] = [_Without(f) for f in sys.meta_path]
'''


def bare_machine_env(tmp_path, require_extras: str = "0", hidden=OPTIONAL_MODULES) -> dict:
    """The environment of a process on the simulated bare machine (see the module docstring),
    without the modules ``hidden``."""
    site = tmp_path / "bare_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_HIDE.format(hidden=sorted(hidden)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(site), ROOT]),
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
        PYTEST_PLUGINS="pytest_timeout",
        ENGINEKIT_REQUIRE_EXTRAS=require_extras,
    )
    return env


def _pytest(args: list[str], env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_gpu_tests_collect_on_a_bare_machine(tmp_path):
    env = bare_machine_env(tmp_path)
    proc = subprocess.run([sys.executable, "-c", "import tinker"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "No module named 'tinker'" in proc.stderr, "the simulation does not hide the extras"

    proc = _pytest(["-m", "gpu", "--collect-only", "-q", "-rs"], env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "error" not in out.splitlines()[-1], out[-4000:]
    for path, module in [("tests/tinker/test_wire.py", "tinker"), ("tests/placement/test_ray_runs.py", "ray")]:
        assert f"SKIPPED [1] {path}: needs the optional module '{module}'" in out, out[-4000:]

    # Where every extra must be installed, the same module is a collection error naming it.
    proc = _pytest(["--collect-only", "-q", "tests/tinker/test_wire.py"], bare_machine_env(tmp_path, require_extras="1"))
    assert proc.returncode != 0 and "No module named 'tinker'" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.slow
def test_gpu_check_smoke_on_a_bare_machine(tmp_path):
    out_dir = tmp_path / "out"
    proc = subprocess.run(
        ["bash", "ci/gpu_check.sh", "--smoke", "--out", str(out_dir)],
        cwd=ROOT,
        env=bare_machine_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out_dir / "gpu_check.json").read_text())
    assert report["smoke"] is True and report["finished"] is True
    assert [s["step"] for s in report["steps"]] == ["pytest -m gpu", "benchmarks.gpu_throughput", "tensor gathers on NCCL"]
    assert all(s["ok"] for s in report["steps"]), report["steps"]
    tests = report["steps"][0]
    assert tests.get("skipped", 0) >= 4 and not tests.get("error") and not tests.get("errors")  # collected, skipped without CUDA
    rows = report["steps"][1]["rows"]
    assert [r["case"] for r in rows] == ROWS  # no TE row: transformer_engine is not installed
    assert all(r["status"] == "ok" for r in rows), rows
    assert [r.get("engine_over_loop") is not None for r in rows] == [False, True, False, False, True]

    measured = {r["case"]: r["values"] for r in json.loads((out_dir / "gpu_throughput.json").read_text())["rows"]}
    loss = measured["loop"]["first_loss"]
    for case in ROWS[1:]:
        assert measured[case]["first_loss"] == pytest.approx(loss, rel=1e-4), (case, measured[case]["first_loss"], loss)

    text = (out_dir / "gpu_check.md").read_text()
    assert "transformer_engine NOT installed" in text and "flash_attn NOT installed" in text
    assert "| fsdp engine compiled | ok |" in text


@pytest.mark.slow
def test_a_failed_row_is_recorded_and_the_rows_before_it_kept(tmp_path):
    """One backend that cannot run (here megatron-core is missing) is a failed row naming why; the
    row measured before it stays in the JSON, and the run exits 1."""
    json_path = tmp_path / "rows.json"
    rows = ["loop", "megatron (local spec)"]
    cmd = [sys.executable, "-m", "benchmarks.gpu_throughput", "--smoke", "--json", str(json_path), "--rows", *rows]
    env = bare_machine_env(tmp_path, hidden=OPTIONAL_MODULES | {"megatron"})
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = json.loads(json_path.read_text())
    assert saved["finished"] is True and [r["case"] for r in saved["rows"]] == rows
    loop, megatron = (r["values"] for r in saved["rows"])
    assert loop["status"] == "ok" and loop["step_s"] > 0
    assert megatron["status"] == "failed" and "No module named 'megatron'" in megatron["error"], megatron
    assert "- megatron (local spec): status=failed" in proc.stdout


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """torch's ``varlen_attn`` contract on CPU ([T, H, D] in and out), causal SDPA per sequence."""
    assert window_size == (-1, 0) and enable_gqa and cu_q is cu_k and max_q == max_k == int(cu_q.diff().max())
    b = cu_q.tolist()
    parts = [
        torch.nn.functional.scaled_dot_product_attention(
            *(t[x:y].transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale, enable_gqa=True
        ).transpose(0, 1)
        for x, y in zip(b[:-1], b[1:], strict=True)
    ]
    return torch.cat(parts)


def test_the_loops_varlen_call_lays_out_heads_as_per_sequence_attention():
    """The loop's CUDA attention path (what only a GPU runs) against its CPU path: the layouts
    between HF's [1, H, T, D] and varlen's [T, H, D], GQA heads, and causal per sequence."""
    from benchmarks.raw_fsdp_gpu import _varlen_kwargs, attention, packed_varlen

    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 3]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(1, h, sum(lengths), 8, generator=g) for h in (4, 2, 2))
    kwargs = _varlen_kwargs(_reference_varlen, 4, 2)
    assert kwargs == {"window_size": (-1, 0), "enable_gqa": True}
    got = packed_varlen(q, k, v, cu, max(lengths), 0.3, _reference_varlen, kwargs)
    want, _ = attention(None, q, k, v, None, scaling=0.3, varlen=None, varlen_kwargs={}, cu_seq_lens_q=cu, max_length_q=max(lengths))
    assert got.shape == want.shape == (1, sum(lengths), 4, 8)
    torch.testing.assert_close(got, want)

    def older(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None, scale=None):
        """torch 2.9-2.10's signature: ``is_causal``, no ``enable_gqa`` (GQA passes through)."""

    assert _varlen_kwargs(older, 4, 2) == {"is_causal": True}
