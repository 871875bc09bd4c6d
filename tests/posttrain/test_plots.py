"""``posttrain.plots.plot_run``: the PNGs a run's metrics support, each a valid image, from RL
and SFT metrics files with gaps, None values and a line cut by a crash."""

from __future__ import annotations

import json
import os

from matplotlib.image import imread

from posttrain.plots import plot_run, read_metrics

PNG = b"\x89PNG\r\n\x1a\n"


def _write(path, rows, tail: str = "") -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
        f.write(tail)
    return str(path)


def _assert_pngs(paths, out_dir, names):
    assert sorted(paths) == sorted(os.path.join(out_dir, f"{n}.png") for n in names)
    assert sorted(os.listdir(out_dir)) == sorted(f"{n}.png" for n in names)
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == PNG
        image = imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0  # drawn, not blank


def test_rl_run_gets_every_plot_and_a_cut_line_is_ignored(tmp_path):
    rows = []
    for step in range(1, 31):
        row = {
            "step": step,
            "reward": step / 30,
            "actor_loss": -0.1,
            "critic_loss": 1 / step,
            "response_len": 10 + step % 3,
            "rollout/kl_k3": 0.001 * step,
            "lr": 1e-3,
        }
        if step % 10 == 0:
            row["val/reward"] = step / 25
        if step == 7:
            row["reward"] = None  # a gap, not a crash
        rows.append(row)
    path = _write(tmp_path / "metrics.jsonl", rows, tail='{"step": 31, "reward": 0.')  # cut by a crash
    assert len(read_metrics(path)) == 30
    out = str(tmp_path / "plots")
    paths = plot_run(path, out, title="PPO")
    _assert_pngs(paths, out, ["loss", "val", "reward", "response_len", "kl"])


def test_sft_run_gets_loss_and_val_only(tmp_path):
    rows = [{"step": s, "loss": 2.0 / s, "grad_norm": 1.0, "tokens_per_s": 100.0} for s in range(1, 21)]
    rows[9].update({"val/loss": 0.5, "val/token_acc": 0.7})
    rows[19].update({"val/loss": 0.25, "val/token_acc": 0.9, "kl": None})  # a key that is only ever None: no plot
    out = str(tmp_path / "plots")
    _assert_pngs(plot_run(_write(tmp_path / "m.jsonl", rows), out), out, ["loss", "val"])


def test_a_run_without_known_keys_writes_nothing(tmp_path):
    path = _write(tmp_path / "m.jsonl", [{"step": 1, "lr": 0.1}], tail="not json\n")
    out = str(tmp_path / "plots")
    assert plot_run(path, out) == []
    assert os.listdir(out) == []
