"""``posttrain.loggers``: what each logger writes, read back through its own library
(TensorBoard's ``EventAccumulator``, ``MlflowClient``, W&B's offline run file), across a resume;
the console line; the config checks; and that ranks other than 0 write nothing.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import struct
import time
from pathlib import Path

import pytest

from posttrain import loggers
from posttrain.loggers import LOGGERS, ConsoleLogger, build_loggers, logger_problems, missing_packages


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------------- console
class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_console_line_format_elapsed_and_eta():
    lines, clock = [], _Clock(100.0)
    log = ConsoleLogger(total_steps=160, write=lines.append, clock=clock)
    clock.now = 162.0  # 12 steps in 62 s: 62 / 12 s per step, 148 steps left -> 764.7 s
    metrics = {"step": 12, "loss": 0.42131, "reward": 0.5125, "val/loss": 0.39, "lr": 1e-3, "grad_norm": 1.25, "tokens_per_s": 3214.4}
    log.log_metrics(12, metrics)
    assert lines == [
        "step 12/160 | loss 0.4213 | reward 0.5125 | val/loss 0.39 | grad_norm 1.25 | 3,214 tok/s | elapsed 0:01:02 | eta 0:12:45"
    ]


def test_console_rl_keys_in_order_and_none_nan_do_not_crash():
    lines, clock = [], _Clock(0.0)
    log = ConsoleLogger(total_steps=10, write=lines.append, clock=clock)
    clock.now = 4.0
    metrics = {
        "tokens_per_s": None,
        "actor_grad_norm": 0.5,
        "response_len": 12.0,
        "kl": float("nan"),
        "reward": None,
        "critic_loss": 2.0,
        "actor_loss": -0.125,
        "entropy": 1.0,
    }
    log.log_metrics(2, metrics)
    assert lines == [
        "step 2/10 | actor_loss -0.125 | critic_loss 2 | reward n/a | kl nan | response_len 12 | actor_grad_norm 0.5 | n/a tok/s "
        "| elapsed 0:00:04 | eta 0:00:16"
    ]


def test_console_eta_counts_only_the_steps_of_this_process_on_resume():
    lines, clock = [], _Clock(0.0)
    log = ConsoleLogger(total_steps=160, start_step=100, write=lines.append, clock=clock)
    clock.now = 20.0  # 10 steps (101..110) in 20 s: 2 s per step, 50 left
    log.log_metrics(110, {"loss": 1.0})
    assert lines == ["step 110/160 | loss 1 | elapsed 0:00:20 | eta 0:01:40"]


def test_console_every_and_the_last_step_always(tmp_path):
    lines = []
    run_log = build_loggers(["console"], output_dir=str(tmp_path / "run"), total_steps=12, console_every=5, write=lines.append)
    for step in range(1, 13):
        run_log.log(step, {"loss": float(step)})
    run_log.message("val/loss 0.3")
    run_log.close()
    assert [line.split(" | ")[0] for line in lines] == ["step 5/12", "step 10/12", "step 12/12", "val/loss 0.3"]
    assert not (tmp_path / "run").exists()  # the console alone writes no file


def test_console_samples_are_truncated():
    lines = []
    log = ConsoleLogger(total_steps=10, write=lines.append)
    log.log_samples(3, [{"prompt": "p" * 500, "response": "line1\nline2", "reward": 0.5}])
    (block,) = lines
    assert block.splitlines() == [
        "samples at step 3:",
        "  [1] reward 0.5",
        "      prompt: " + "p" * 200 + "…",
        "      response: line1\\nline2",
    ]


# ---------------------------------------------------------------------------------- jsonl
def test_jsonl_values_resume_truncation_and_samples(tmp_path):
    out = str(tmp_path)
    with build_loggers(["jsonl"], output_dir=out, total_steps=4) as run_log:
        for step in range(1, 5):
            run_log.log(step, {"step": step, "loss": step / 4, "val/loss": None, "nan": float("nan"), "note": "x"})
        run_log.log_samples(2, [{"prompt": "a", "response": "b", "reward": 1.0}, {"prompt": "c", "response": "d", "reward": 0.0}])
        run_log.log_samples(4, [{"prompt": "e", "response": "f", "reward": 0.5}])
    rows = _read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"], r["val/loss"], r["note"]) for r in rows] == [(s, s / 4, None, "x") for s in range(1, 5)]
    assert all(math.isnan(r["nan"]) for r in rows)
    assert [(r["step"], r["prompt"]) for r in _read_jsonl(tmp_path / "samples.jsonl")] == [(2, "a"), (2, "c"), (4, "e")]

    # resume after step 2: steps 3 and 4 replayed with new values, each step once
    with build_loggers(["jsonl"], output_dir=out, total_steps=4, start_step=2) as run_log:
        run_log.log(3, {"loss": 30.0})
        run_log.log(4, {"loss": 40.0})
        run_log.log_samples(4, [{"prompt": "g", "response": "h", "reward": 1.0}])
    assert [(r["step"], r["loss"]) for r in _read_jsonl(tmp_path / "metrics.jsonl")] == [(1, 0.25), (2, 0.5), (3, 30.0), (4, 40.0)]
    assert [(r["step"], r["prompt"]) for r in _read_jsonl(tmp_path / "samples.jsonl")] == [(2, "a"), (2, "c"), (4, "g")]

    # a fresh run in the same directory starts both files over
    with build_loggers(["jsonl"], output_dir=out, total_steps=4) as run_log:
        run_log.log(1, {"loss": 7.0})
    assert _read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 7.0}]
    assert _read_jsonl(tmp_path / "samples.jsonl") == []


# ---------------------------------------------------------------------------------- tensorboard
def _tb(log_dir: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _scalars(acc, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_scalars_config_samples_and_purge_on_resume(tmp_path):
    out = str(tmp_path)
    config = {"trainer": {"total_steps": 4, "loggers": ["tensorboard"]}}
    with build_loggers(["tensorboard"], output_dir=out, config=config, total_steps=4) as run_log:
        for step in range(1, 5):
            metrics = {"loss": step / 2, "skipped": step == 2, "val/loss": 0.25 if step == 2 else None, "bad": float("inf"), "s": "x"}
            run_log.log(step, metrics)
        run_log.log_samples(4, [{"prompt": "a|b", "response": "c", "reward": 0.5}])
    acc = _tb(os.path.join(out, "tensorboard"))
    assert sorted(acc.Tags()["scalars"]) == ["loss", "skipped", "val/loss"]  # None, inf and str are not scalars
    assert _scalars(acc, "loss") == [(1, 0.5), (2, 1.0), (3, 1.5), (4, 2.0)]
    assert _scalars(acc, "skipped") == [(1, 0.0), (2, 1.0), (3, 0.0), (4, 0.0)]
    assert _scalars(acc, "val/loss") == [(2, 0.25)]
    texts = {
        tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
        for tag in ("config/text_summary", "samples/text_summary")
    }
    ((config_step, config_text),) = texts["config/text_summary"]
    assert config_step == 0 and config_text.startswith("```yaml\n") and "total_steps: 4" in config_text
    assert texts["samples/text_summary"] == [(4, "| prompt | response | reward |\n| --- | --- | --- |\n| a\\|b | c | 0.5 |")]

    # resume after step 2: the old events of steps 3 and 4 are purged, each step shows once
    with build_loggers(["tensorboard"], output_dir=out, total_steps=4, start_step=2) as run_log:
        run_log.log(3, {"loss": 30.0})
        run_log.log(4, {"loss": 40.0})
    acc = _tb(os.path.join(out, "tensorboard"))
    assert _scalars(acc, "loss") == [(1, 0.5), (2, 1.0), (3, 30.0), (4, 40.0)]
    assert _scalars(acc, "skipped") == [(1, 0.0), (2, 1.0)]


# ---------------------------------------------------------------------------------- mlflow
def test_mlflow_metrics_params_samples_and_resume_continue_the_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # Record MLFLOW_ALLOW_FILE_STORE as unset so the value the logger sets is undone after the test.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "placeholder")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    out = str(tmp_path / "run_a")
    config = {"trainer": {"lr": 1e-3, "loggers": ["mlflow"], "run_name": None}, "odd:key": "v" * 7000}
    # A real recipe config has a few hundred keys: more than one of MLflow's 100-param batches.
    many = {f"k{i}": i for i in range(230)}
    with build_loggers(["mlflow"], output_dir=out, project="proj", config={**config, "many": many}, total_steps=3) as run_log:
        for step in range(1, 4):
            run_log.log(step, {"loss": step / 4, "time/gen(s)": 1.5, "val/loss": 0.5 if step == 2 else None, "n": float("nan"), "s": "x"})
        run_log.log_samples(2, [{"prompt": "a", "response": "b", "reward": 1.0}])
        run_id = run_log.loggers[0].run_id
    with open(os.path.join(out, "mlflow_run_id")) as f:
        assert f.read().strip() == run_id

    client = MlflowClient(tracking_uri="file:" + os.path.abspath(os.path.join(out, "mlruns")))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run_a"
    assert client.get_experiment(run.info.experiment_id).name == "proj"

    def history(key):
        return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))]

    assert history("loss") == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert history("val/loss") == [(2, 0.5)]
    assert history("time/gen_s_") == [(1, 1.5), (2, 1.5), (3, 1.5)]  # sanitized to MLflow's charset
    assert set(run.data.metrics) == {"loss", "val/loss", "time/gen_s_"}  # no NaN, None or str
    assert run.data.params == {
        "trainer.lr": "0.001",
        "trainer.loggers": '["mlflow"]',
        "trainer.run_name": "null",
        "odd_key": "v" * 6000,
        **{f"many.{k}": str(v) for k, v in many.items()},
    }
    with open(client.download_artifacts(run_id, "samples/step_000002.json", str(tmp_path))) as f:
        samples = json.load(f)
    assert samples == {"step": 2, "rows": [{"prompt": "a", "response": "b", "reward": 1.0}]}

    # resume after step 2: the same run continues (params are kept, a new key is added)
    config2 = {**config, "trainer": {**config["trainer"], "lr": 5.0, "resume": True}}
    with build_loggers(["mlflow"], output_dir=out, project="proj", config=config2, total_steps=3, start_step=2) as run_log:
        assert run_log.loggers[0].run_id == run_id
        assert client.get_run(run_id).info.status == "RUNNING"
        run_log.log(3, {"loss": 9.0, **{f"layer/{i}": float(i) for i in range(1100)}})  # > one 1000-metric batch
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert all(run.data.metrics[f"layer/{i}"] == float(i) for i in range(1100))
    assert history("loss") == [(1, 0.25), (2, 0.5), (3, 0.75), (3, 9.0)]  # MLflow keeps both points of a replayed step
    assert run.data.metrics["loss"] == 9.0
    assert run.data.params["trainer.lr"] == "0.001" and run.data.params["trainer.resume"] == "true"
    assert len(client.search_runs([run.info.experiment_id])) == 1

    # a fresh run in the same directory is a new MLflow run
    with build_loggers(["mlflow"], output_dir=out, project="proj", total_steps=3) as run_log:
        assert run_log.loggers[0].run_id != run_id


# ---------------------------------------------------------------------------------- wandb
def _wandb_records(path: str):
    """The records of a W&B ``.wandb`` run file (a LevelDB-style log of ``wandb_internal_pb2.Record``:
    a 7-byte header, then 32 KiB blocks of chunks with a 7-byte header: crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # block trailer: zero padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a whole record
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def _wandb_run(run_dir: str) -> tuple[str, dict, dict[int, dict]]:
    """(run id, config, {step: logged values}) of one offline run directory."""
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    # run.finish() returns before W&B's service process has written the offline file (seen: a
    # bare 7-byte header right after finish), so wait for the run's closing "exit" record.
    deadline = time.monotonic() + 20
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    run_id, config, history = None, {}, {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update if item.key != "_wandb"}
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return run_id, config, history


def test_wandb_offline_run_history_config_samples_and_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    for key in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT", "WANDB_NAME"):
        monkeypatch.delenv(key, raising=False)
    out = str(tmp_path / "run_w")
    config = {"trainer": {"lr": 0.001, "loggers": ["wandb"]}}
    with build_loggers(["wandb"], output_dir=out, config=config, total_steps=3) as run_log:
        run_log.log(1, {"loss": 0.5, "ok": True, "val/loss": None, "n": float("nan"), "s": "x"})
        run_log.log(2, {"loss": 0.25, "val/loss": 0.125})
        run_log.log_samples(2, [{"prompt": "a", "response": "b", "reward": 1.0}])
    with open(os.path.join(out, "wandb_run_id")) as f:
        run_id = f.read().strip()
    (run_dir,) = glob.glob(os.path.join(out, "wandb", f"offline-run-*-{run_id}"))
    got_id, got_config, history = _wandb_run(run_dir)
    assert got_id == run_id and got_config == config
    assert history[1] == {"loss": 0.5, "ok": 1.0}
    assert history[2]["loss"] == 0.25 and history[2]["val/loss"] == 0.125
    assert history[2]["samples/_type"] == "table-file" and history[2]["samples/nrows"] == 1
    (table,) = glob.glob(os.path.join(run_dir, "files", "media", "table", "samples_2_*.table.json"))
    with open(table) as f:
        assert json.load(f) == {"columns": ["step", "prompt", "response", "reward"], "data": [[2, "a", "b", 1.0]]}

    # resume after step 2: a new offline directory of the same run
    with build_loggers(["wandb"], output_dir=out, total_steps=3, start_step=2) as run_log:
        run_log.log(3, {"loss": 0.125})
    run_dirs = sorted(glob.glob(os.path.join(out, "wandb", f"offline-run-*-{run_id}")))
    assert len(run_dirs) == 2 and len(glob.glob(os.path.join(out, "wandb", "offline-run-*"))) == 2
    (resumed,) = [d for d in run_dirs if d != run_dir]
    got_id, _, history = _wandb_run(resumed)
    assert got_id == run_id and history == {3: {"loss": 0.125}}


# ---------------------------------------------------------------------------------- checks
def test_logger_problems_name_the_value_and_the_fix(tmp_path):
    assert logger_problems(list(LOGGERS)) == []
    assert logger_problems(["console", "tensorbord"]) == [
        "loggers = ['console', 'tensorbord']: unknown 'tensorbord'; fix: use any of console, jsonl, tensorboard, wandb, mlflow"
    ]
    assert logger_problems(["jsonl", "wandb", "jsonl"]) == [
        "loggers = ['jsonl', 'wandb', 'jsonl']: 'jsonl' listed more than once; fix: list each logger once"
    ]
    with pytest.raises(ValueError, match="unknown 'csv'"):
        build_loggers(["csv"], output_dir=str(tmp_path / "run"), total_steps=1)
    assert not (tmp_path / "run").exists()


def test_missing_packages_name_the_package_and_build_creates_nothing(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "mlflow") else real(name, *a))
    names = ["console", "jsonl", "tensorboard", "wandb", "mlflow"]
    assert missing_packages(names) == [
        "trainer.loggers has 'wandb' but the wandb package is not installed; fix: pip install wandb (or the enginekit[wandb] extra), "
        "or drop it from trainer.loggers",
        "trainer.loggers has 'mlflow' but the mlflow package is not installed; fix: pip install mlflow-skinny (or mlflow, or the "
        "enginekit[mlflow] extra), or drop it from trainer.loggers",
    ]
    assert missing_packages(["console", "jsonl", "tensorboard"]) == []
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="the wandb package is not installed"):
        build_loggers(names, output_dir=str(out), total_steps=1, rank0=False)  # every rank raises
    with pytest.raises(ValueError, match="the wandb package is not installed"):
        build_loggers(names, output_dir=str(out), total_steps=1)
    assert not out.exists()


def test_other_ranks_write_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    calls = []
    monkeypatch.setattr(loggers, "WandbLogger", lambda *a, **k: calls.append(a))
    run_log = build_loggers(list(LOGGERS), output_dir=str(tmp_path / "run"), total_steps=2, rank0=False, write=calls.append)
    run_log.log(1, {"loss": 1.0})
    run_log.message("hello")
    run_log.log_samples(1, [{"prompt": "a", "response": "b", "reward": 1.0}])
    run_log.close()
    assert calls == [] and os.listdir(tmp_path) == []


def test_a_missing_logger_package_is_refused_at_config_load(monkeypatch):
    """The example SFT configs log to tensorboard, which `make run`'s minimal venv lacks: the
    run must stop at config load naming the package, not after the model and data have loaded
    (issue 53, item 24)."""
    from engine_api.typed_config import load_typed
    from recipes.sft import SFTConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ValueError, match=r"trainer.loggers has 'tensorboard' but the tensorboard package is not installed; fix:"):
        load_typed(SFTConfig, str(Path(__file__).resolve().parents[2] / "configs/examples/qwen2.5-0.5b-sft.yaml"), [])
