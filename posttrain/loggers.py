"""One small logging interface for the training recipes (SFT and RL): a per-step console line,
the JSON-lines metrics file, TensorBoard, Weights & Biases and MLflow behind one object.

::

    run_log = build_loggers(["console", "jsonl", "tensorboard"], output_dir="outputs/x", total_steps=160, rank0=rank0)
    with run_log:
        for step in range(start + 1, total + 1):
            run_log.log(step, metrics)  # once per step, 1-based
        run_log.message("validation: ...")  # console only
        run_log.log_samples(step, [{"prompt": ..., "response": ..., "reward": ...}])

Every rank calls :func:`build_loggers`; the names are checked and the chosen libraries looked up
on every rank (so a bad config fails everywhere alike, before anything is created), and ranks
other than 0 get a :class:`RunLog` that does nothing.

Assumptions and choices, per logger:

* Scalars. The console prints every chosen key (``None`` as ``n/a``, NaN as ``nan``); the other
  loggers log only finite numbers (bools as 0 / 1) and skip ``None``, NaN, inf and strings, which
  their libraries reject or plot as gaps that hide the rest. A ``step`` key inside ``metrics`` is
  dropped: the step argument is the x axis.
* Resume (``start_step > 0``, the step of the checkpoint the run continues from). The steps after
  ``start_step`` are replayed, so each logger makes sure they are not counted twice where its
  storage allows it: ``jsonl`` keeps the lines with ``step <= start_step`` and appends
  (``posttrain.trainer_utils.truncate_metrics``); ``tensorboard`` opens its writer with
  ``purge_step = start_step + 1``, so TensorBoard hides the old events of the replayed steps;
  ``wandb`` and ``mlflow`` continue the run whose id is stored in ``<output_dir>/wandb_run_id`` /
  ``<output_dir>/mlflow_run_id``. A W&B server ignores (with a warning) a ``log`` whose step is
  below the step the run already reached, so the replayed steps keep their first values there
  (W&B's "rewind", ``resume_from``, is not used: it is a server-side feature); MLflow cannot delete metric
  points, so its history holds both values for the replayed steps (the newest timestamp is the
  resumed one). A fresh run (``start_step == 0``) always starts a new W&B / MLflow run and
  overwrites the stored id: reusing it would log steps 1.. again into a run already past them.
* ``console``: a line every ``console_every`` steps and at the last step, with the keys of
  :data:`CONSOLE_KEYS` that the step has, tokens/s, the elapsed time and an ETA from the mean time
  per step since this process started (``step - start_step`` steps). ``write`` receives whole
  lines (``tqdm.write`` when a progress bar is shown).
* ``jsonl``: ``<output_dir>/<metrics_file>``, one ``{"step": step, **metrics}`` line per step,
  flushed per line (NaN written as ``NaN``, which Python's ``json`` reads back);
  ``<output_dir>/<samples_file>`` one ``{"step": step, **row}`` line per sample.
* ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` under ``<output_dir>/tensorboard``;
  ``add_scalar`` per metric, the config once as text (YAML in a fenced code block, at the first
  step this process logs, ``start_step``), samples as a markdown table under ``samples``.
* ``wandb``: ``wandb.init(project, name, dir=output_dir, config, id, resume="allow",
  reinit="create_new")``: ``create_new`` so an unrelated active run in the process is neither
  returned nor finished. The mode comes from the environment as W&B documents it: set
  ``WANDB_MODE=offline`` (what the tests do; ``wandb sync`` uploads later) or ``disabled``, or log
  in / set ``WANDB_API_KEY`` for online runs; ``WANDB_SILENT=true`` quiets its console lines.
  Samples are a ``wandb.Table`` under ``samples``. ``run.finish()`` may return before W&B's
  service process has written the whole offline ``run-<id>.wandb`` file (it completes it on its
  own, before the process exits); readers right after ``close`` wait for its ``exit`` record.
* ``mlflow`` (``MlflowClient`` with an explicit run id, not the fluent API's global active run):
  the tracking URI is ``MLFLOW_TRACKING_URI`` if set, else the local file store
  ``file:<abs output_dir>/mlruns``. MLflow >= 3.7 refuses file stores unless
  ``MLFLOW_ALLOW_FILE_STORE=true`` (its database default needs SQLAlchemy, which
  ``mlflow-skinny`` lacks), so that variable is set (``setdefault``: an explicit ``false`` wins)
  when the file store is used; no warning is emitted then. Experiment = ``project``; params = the
  config flattened to dotted keys, values as strings cut to MLflow's 6000 characters (params are
  immutable in MLflow, so a resumed run logs only keys it does not have yet); metric and param
  names are sanitized to MLflow's charset (alphanumerics ``_ - . /`` space; others become ``_``);
  samples are a JSON artifact ``samples/step_000012.json``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
import os
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from posttrain.trainer_utils import truncate_metrics

__all__ = [
    "CONSOLE_KEYS",
    "LOGGERS",
    "ConsoleLogger",
    "JsonlLogger",
    "Logger",
    "MlflowLogger",
    "RunLog",
    "TensorBoardLogger",
    "WandbLogger",
    "build_loggers",
    "logger_problems",
    "missing_packages",
]

LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
# logger -> (module it imports, how to install it)
_PACKAGES = {
    "tensorboard": ("tensorboard", "pip install tensorboard (or the enginekit[tensorboard] extra)"),
    "wandb": ("wandb", "pip install wandb (or the enginekit[wandb] extra)"),
    "mlflow": ("mlflow", "pip install mlflow-skinny (or mlflow, or the enginekit[mlflow] extra)"),
}
# The console line's keys, in this order, each only when the step has it; "val/*" stands for the
# step's validation keys in their own order, "grad_norm" for actor_grad_norm when it is absent.
CONSOLE_KEYS = ("loss", "actor_loss", "critic_loss", "reward", "val/*", "kl", "response_len", "grad_norm")
_SAMPLE_CHARS = 200
_MLFLOW_KEY_LEN, _MLFLOW_PARAM_LEN = 250, 6000  # mlflow.utils.validation's limits

Metrics = Mapping[str, Any]  # values: float | int | bool | None | str


# ---------------------------------------------------------------------------------- checks
def logger_problems(names: Sequence[str]) -> list[str]:
    """What is wrong with the logger list ``names`` (unknown or repeated names), one message
    each naming the value and the fix; empty when it is fine."""
    out = []
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        out.append(f"loggers = {list(names)}: unknown {', '.join(map(repr, unknown))}; fix: use any of {', '.join(LOGGERS)}")
    repeated = sorted({n for n in names if list(names).count(n) > 1})
    if repeated:
        out.append(f"loggers = {list(names)}: {', '.join(map(repr, repeated))} listed more than once; fix: list each logger once")
    return out


def missing_packages(names: Iterable[str]) -> list[str]:
    """One message per chosen logger whose library is not importable, naming the package to
    install (looked up with ``importlib.util.find_spec``: nothing is imported)."""
    out = []
    for name in names:
        if name in _PACKAGES and importlib.util.find_spec(_PACKAGES[name][0]) is None:
            module, how = _PACKAGES[name]
            out.append(
                f"trainer.loggers has {name!r} but the {module} package is not installed; fix: {how}, or drop it from trainer.loggers"
            )
    return out


# ---------------------------------------------------------------------------------- helpers
def _scalars(metrics: Metrics) -> dict[str, float]:
    """The finite numeric values of ``metrics`` (bools as 0 / 1), without ``step``."""
    out = {}
    for key, value in metrics.items():
        if key == "step" or value is None or isinstance(value, str) or not isinstance(value, numbers.Real):
            continue
        value = float(value)
        if math.isfinite(value):
            out[key] = value
    return out


def _fmt(value: Any) -> str:
    """A metric for the console: 4 significant digits, ``n/a`` for None; never raises."""
    if value is None:
        return "n/a"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    return f"{float(value):.4g}"  # nan / inf print as such


def _hms(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _clip(text: Any, limit: int = _SAMPLE_CHARS) -> str:
    text = str(text).replace("\n", "\\n")  # one console line per field
    return text if len(text) <= limit else text[:limit] + "…"


def _columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The union of the rows' keys, first-seen order."""
    return list(dict.fromkeys(key for row in rows for key in row))


def _new_id() -> str:
    return secrets.token_hex(6)  # [0-9a-f]: valid as a W&B run id


def _run_id(output_dir: str, file_name: str, start_step: int) -> tuple[str | None, str]:
    """(the stored run id when resuming and one is stored, else None; the file that stores it)."""
    path = os.path.join(output_dir, file_name)
    if start_step > 0 and os.path.exists(path):
        with open(path) as f:
            return f.read().strip() or None, path
    return None, path


def _store_id(path: str, run_id: str) -> None:
    with open(f"{path}.tmp", "w") as f:
        f.write(run_id + "\n")
    os.replace(f"{path}.tmp", path)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _mlflow_key(key: str) -> str:
    """``key`` in MLflow's name rules: alphanumerics ``_ - . /`` and space (no colon: Windows
    refuses it), no empty, ``.`` or ``..`` path segment, at most 250 characters."""
    key = re.sub(r"[^\w.\- /]", "_", key)
    parts = [p if p not in (".", "..") else p.replace(".", "_") for p in key.split("/") if p]
    return "/".join(parts)[:_MLFLOW_KEY_LEN] or "_"


def _config_text(config: Mapping[str, Any]) -> str:
    try:
        import yaml

        body, lang = yaml.safe_dump(dict(config), sort_keys=False), "yaml"
    except Exception:  # noqa: BLE001 - not plain YAML data (or no PyYAML): JSON with str() for the rest
        body, lang = json.dumps(config, indent=2, default=str), "json"
    return f"```{lang}\n{body}```"


# ---------------------------------------------------------------------------------- loggers
class Logger:
    """One destination for metrics and samples; the methods are no-ops unless overridden."""

    def log_metrics(self, step: int, metrics: Metrics) -> None:
        """Record the metrics of step ``step`` (1-based), once per step."""

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Record generations of step ``step`` (dicts such as ``{"prompt", "response", "reward"}``)."""

    def message(self, text: str) -> None:
        """A free-form line (the console shows it; the others ignore it)."""

    def close(self) -> None:
        """Flush and release what the logger holds."""


class ConsoleLogger(Logger):
    """One line per step (every ``every`` steps and at ``total_steps``) through ``write``.

    ``clock`` (seconds, monotonic) is read when the logger is built and at each printed step.
    """

    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        every: int = 1,
        write: Callable[[str], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total_steps, self.start_step, self.every = total_steps, start_step, max(1, every)
        self.write = write or (lambda text: print(text, flush=True))
        self.clock, self.t0 = clock, clock()

    def line(self, step: int, metrics: Metrics) -> str:
        """The console line of ``step``."""
        keys = []
        for key in CONSOLE_KEYS:
            if key == "val/*":
                keys += [k for k in metrics if k.startswith("val/")]
            elif key == "grad_norm":
                keys += [k for k in ("grad_norm", "actor_grad_norm") if k in metrics][:1]
            elif key in metrics:
                keys.append(key)
        parts = [f"step {step}/{self.total_steps}"] + [f"{k} {_fmt(metrics[k])}" for k in keys]
        if "tokens_per_s" in metrics:
            tps = metrics["tokens_per_s"]
            ok = isinstance(tps, numbers.Real) and not isinstance(tps, bool) and math.isfinite(tps)
            parts.append(f"{tps:,.0f} tok/s" if ok else f"{_fmt(tps)} tok/s")
        elapsed, done = self.clock() - self.t0, step - self.start_step
        eta = _hms(elapsed / done * max(0, self.total_steps - step)) if done > 0 else "n/a"
        return " | ".join([*parts, f"elapsed {_hms(elapsed)}", f"eta {eta}"])

    def log_metrics(self, step: int, metrics: Metrics) -> None:
        if step % self.every == 0 or step >= self.total_steps:
            self.write(self.line(step, metrics))

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        lines = [f"samples at step {step}:"]
        for i, row in enumerate(rows, 1):
            rest = [f"{k} {_fmt(v) if not isinstance(v, str) else _clip(v, 60)}" for k, v in row.items() if k not in ("prompt", "response")]
            lines.append(f"  [{i}] " + (" | ".join(rest) or "-"))
            lines += [f"      {k}: {_clip(row[k])}" for k in ("prompt", "response") if k in row]
        self.write("\n".join(lines))

    def message(self, text: str) -> None:
        self.write(text)


class JsonlLogger(Logger):
    """``<output_dir>/<metrics_file>`` and ``<output_dir>/<samples_file>``, JSON lines."""

    def __init__(self, output_dir: str, metrics_file: str = "metrics.jsonl", samples_file: str = "samples.jsonl", start_step: int = 0):
        self.metrics_path = os.path.join(output_dir, metrics_file)
        self.samples_path = os.path.join(output_dir, samples_file)
        for path in (self.metrics_path, self.samples_path):
            truncate_metrics(path, start_step)  # fresh run: 0 empties it; resume: drops the steps to be replayed
        self._metrics = open(self.metrics_path, "a")  # held for the run, closed in close()
        self._samples = None

    def log_metrics(self, step: int, metrics: Metrics) -> None:
        self._metrics.write(json.dumps({"step": step, **{k: v for k, v in metrics.items() if k != "step"}}, default=str) + "\n")
        self._metrics.flush()

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        if self._samples is None:
            self._samples = open(self.samples_path, "a")  # closed in close()
        for row in rows:
            self._samples.write(json.dumps({"step": step, **{k: v for k, v in row.items() if k != "step"}}, default=str) + "\n")
        self._samples.flush()

    def close(self) -> None:
        for f in (self._metrics, self._samples):
            if f is not None:
                f.close()


class TensorBoardLogger(Logger):
    """Scalars, the config and samples in ``<output_dir>/tensorboard``."""

    def __init__(self, output_dir: str, config: Mapping[str, Any] | None = None, start_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides the events of the earlier process at steps >= it.
        self.writer = SummaryWriter(log_dir=os.path.join(output_dir, "tensorboard"), purge_step=start_step + 1 if start_step > 0 else None)
        if config:
            self.writer.add_text("config", _config_text(config), global_step=start_step)

    def log_metrics(self, step: int, metrics: Metrics) -> None:
        for key, value in _scalars(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        if not rows:
            return
        columns = _columns(rows)

        def cell(value: Any) -> str:
            return (_fmt(value) if not isinstance(value, str) else _clip(value, 500)).replace("|", "\\|")

        table = [f"| {' | '.join(columns)} |", "|" + " --- |" * len(columns)]
        table += [f"| {' | '.join(cell(row.get(c)) for c in columns)} |" for row in rows]
        self.writer.add_text("samples", "\n".join(table), global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger(Logger):
    """A W&B run (see the module docstring for the mode and resume)."""

    def __init__(self, output_dir: str, project: str, run_name: str, config: Mapping[str, Any] | None = None, start_step: int = 0) -> None:
        import wandb

        self._wandb = wandb
        run_id, path = _run_id(output_dir, "wandb_run_id", start_step)
        run_id = run_id or _new_id()
        self.run = wandb.init(
            project=project, name=run_name, dir=output_dir, config=dict(config or {}), id=run_id, resume="allow", reinit="create_new"
        )
        _store_id(path, self.run.id)

    def log_metrics(self, step: int, metrics: Metrics) -> None:
        self.run.log(_scalars(metrics), step=step)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        if not rows:
            return
        columns = _columns(rows)

        def cell(value: Any) -> Any:  # a Table column holds one type: numbers and text as they are, the rest as text
            return value if value is None or isinstance(value, (str, numbers.Real)) else str(value)

        table = self._wandb.Table(columns=["step", *columns], data=[[step, *(cell(row.get(c)) for c in columns)] for row in rows])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger(Logger):
    """An MLflow run through ``MlflowClient`` (see the module docstring for the store and resume)."""

    def __init__(self, output_dir: str, project: str, run_name: str, config: Mapping[str, Any] | None = None, start_step: int = 0) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or "file:" + os.path.abspath(os.path.join(output_dir, "mlruns"))
        if self.tracking_uri.startswith("file:") or "://" not in self.tracking_uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow >= 3.7 raises on file stores without it
        self.client = client = MlflowClient(tracking_uri=self.tracking_uri)
        run_id, path = _run_id(output_dir, "mlflow_run_id", start_step)
        logged: dict[str, str] = {}
        if run_id is not None:
            try:
                logged = client.get_run(run_id).data.params
                client.update_run(run_id, status="RUNNING")
            except MlflowException:
                run_id = None  # not in this store (another MLFLOW_TRACKING_URI): a new run
        if run_id is None:
            experiment = client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(project)
            run_id = client.create_run(experiment_id, run_name=run_name).info.run_id
        self.run_id = run_id
        _store_id(path, run_id)
        params = {}
        for key, value in _flatten(config or {}).items():
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            params.setdefault(_mlflow_key(key), text[:_MLFLOW_PARAM_LEN])
        params = [Param(k, v) for k, v in params.items() if k not in logged]  # params are immutable: keep the first values
        for i in range(0, len(params), 100):  # MLflow's batch limit for params
            client.log_batch(run_id, params=params[i : i + 100])

    def log_metrics(self, step: int, metrics: Metrics) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_mlflow_key(k), v, now, step) for k, v in _scalars(metrics).items()]
        for i in range(0, len(batch), 1000):  # MLflow's batch limit for metrics
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        rows = json.loads(json.dumps(list(rows), default=str))  # plain JSON data for the artifact
        self.client.log_dict(self.run_id, {"step": step, "rows": rows}, f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


# ---------------------------------------------------------------------------------- the run log
class RunLog:
    """The loggers of one run behind one call each; a context manager that closes them.

    An empty one (ranks other than 0) does nothing.
    """

    def __init__(self, loggers: Sequence[Logger] = ()) -> None:
        self.loggers = list(loggers)

    def log(self, step: int, metrics: Metrics) -> None:
        """Send the metrics of step ``step`` (1-based) to every logger; call once per step."""
        for logger in self.loggers:
            logger.log_metrics(step, metrics)

    def message(self, text: str) -> None:
        """A free-form console line (e.g. validation results); the other loggers ignore it."""
        for logger in self.loggers:
            logger.message(text)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Send generations of step ``step`` (dicts such as prompt, response, reward) to every logger."""
        for logger in self.loggers:
            logger.log_samples(step, rows)

    def close(self) -> None:
        """Close every logger (each once; the first error is raised after all were tried)."""
        loggers, self.loggers = self.loggers, []
        errors = []
        for logger in loggers:
            try:
                logger.close()
            except Exception as exc:  # noqa: BLE001 - close the others first, then raise
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def build_loggers(
    names: Sequence[str],
    output_dir: str,
    *,
    total_steps: int,
    metrics_file: str = "metrics.jsonl",
    samples_file: str = "samples.jsonl",
    project: str = "enginekit",
    run_name: str | None = None,
    config: Mapping[str, Any] | None = None,
    start_step: int = 0,
    console_every: int = 1,
    rank0: bool = True,
    write: Callable[[str], Any] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> RunLog:
    """The loggers ``names`` (any of :data:`LOGGERS`) of a run writing under ``output_dir``
    (created unless the console is the only logger), ``total_steps`` steps long.

    Call it on every rank; only ``rank0`` creates anything. ``run_name`` None: the basename of
    ``output_dir``. ``config``: the resolved config as plain nested dicts (W&B config, MLflow
    params, TensorBoard text). ``start_step`` > 0: the run resumes after that step (see the
    module docstring). ``console_every``: a console line every this many steps and at
    ``total_steps``. ``write``: the console's output function (default ``print(..., flush=True)``;
    ``tqdm.write`` under a progress bar). ``clock``: for tests.

    Raises:
        ValueError: unknown or repeated names, or a chosen logger's package is not installed
            (on every rank, before anything is created).
    """
    problems = logger_problems(names) or missing_packages(names)
    if problems:
        raise ValueError("\n".join(problems))
    if not rank0:
        return RunLog()
    run_name = run_name or os.path.basename(os.path.normpath(os.path.abspath(output_dir)))
    if set(names) - {"console"}:
        os.makedirs(output_dir, exist_ok=True)
    factories: dict[str, Callable[[], Logger]] = {
        "console": lambda: ConsoleLogger(total_steps, start_step, console_every, write, clock),
        "jsonl": lambda: JsonlLogger(output_dir, metrics_file, samples_file, start_step),
        "tensorboard": lambda: TensorBoardLogger(output_dir, config, start_step),
        "wandb": lambda: WandbLogger(output_dir, project, run_name, config, start_step),
        "mlflow": lambda: MlflowLogger(output_dir, project, run_name, config, start_step),
    }
    run_log = RunLog()
    try:
        for name in names:
            run_log.loggers.append(factories[name]())
    except BaseException:
        try:
            run_log.close()  # release what was created before the failure
        except Exception as exc:  # noqa: BLE001 - the creation error is the one to report
            print(f"posttrain.loggers: closing after a failed start also failed: {exc!r}", file=sys.stderr, flush=True)
        raise
    return run_log
