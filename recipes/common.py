"""Recipe wiring that SFT and RL (``recipes.sft``, ``recipes.ppo``) share: the ``trainer``
config section, the ``tiny_model`` one (``posttrain.tiny_model.TinyModelConfig``, re-exported
here), the checks across sections, and building the tiny model when ``engine.model.path`` is
null. Everything reusable is in the ``posttrain`` library.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field

import torch.distributed as dist

from engine_api.dist import is_initialized, launcher_world
from posttrain import sort_task as task
from posttrain.dist import rank
from posttrain.loggers import RunLog, build_loggers, logger_problems, missing_packages
from posttrain.placement import LAUNCHERS, PlacementConfig
from posttrain.placement.cluster import ray_missing
from posttrain.tiny_model import MAX_POSITIONS, TinyModelConfig, build_tiny_model

__all__ = ["SAMPLES_FILE", "TinyModelConfig", "TrainerConfig", "data_model_problems", "open_loggers", "progress_bar", "with_model_path"]

# Logged generations (trainer.log_samples_every), one JSON line each, under trainer.output_dir.
SAMPLES_FILE = "samples.jsonl"


# ---------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class TrainerConfig:
    """The training loop.

    Attributes:
        total_steps: optimizer steps of the run.
        log_every: print a console line every this many steps (and at the last step), with or
            without the progress bar.
        output_dir: run directory: metrics, the built tiny model, checkpoints.
        metrics_file: JSON-lines file name under ``output_dir`` (one line per step).
        checkpoint_every: save a checkpoint every this many steps and at the end (0: never).
        resume: continue from the newest checkpoint under ``<output_dir>/checkpoints`` that
            verifies (one that fails verification is skipped with a loud message; none
            verifying is an error). The metrics file is cut back to the resumed step and the
            replayed steps appended, so it stays one line per step; the data of each step is
            the same as in an uninterrupted run. false: a fresh run, refused in an
            ``output_dir`` that holds another run's checkpoints (``overwrite``).
        overwrite: with ``resume: false`` in an ``output_dir`` that holds checkpoints, delete
            them and start over (false: refuse, naming the ways out; a fresh run never writes
            over another run's checkpoints, metrics and data order).
        progress_bar: show a tqdm bar on rank 0 when stderr is a terminal (a bar redrawn in a
            log file is noise: redirected, the console lines alone are written).
        max_consecutive_skips: stop with an error after this many consecutive steps whose
            optimizer step was skipped (non-finite loss or gradients); 0: never stop.
        val_every: score the validation data every this many steps (0: only at the end).
        save_hf: at the end, write the trained model as an HF directory (weights, config,
            tokenizer, generation config) to ``<output_dir>/hf`` (``posttrain.export.save_hf``).
        save_hf_format: ``merged`` (full weights; with LoRA the adapters merged in) or
            ``adapter`` (a peft adapter directory; needs ``engine.model.lora.rank > 0``).
        loggers: where the metrics go, any of ``console`` (the per-step line), ``jsonl``
            (``metrics_file``), ``tensorboard``, ``wandb``, ``mlflow`` (optional extras;
            ``posttrain.loggers``). The metrics file is written even when ``jsonl`` is not
            listed: the plots and the end-of-run summary read it.
        project: the W&B project / MLflow experiment name.
        run_name: the run's name in W&B / MLflow; null: the basename of ``output_dir``.
        log_samples_every: log ``log_samples`` generations (prompt, response, reward) to the
            loggers and ``<output_dir>/samples.jsonl`` every this many steps (0: never).
        log_samples: how many generations to log each time.
        launcher: ``torchrun`` (this process is one rank; ``torchrun --nproc-per-node N`` for
            more, every role colocated on every rank) or ``ray`` (this process drives worker
            groups placed on a Ray cluster by ``placement``; ``docs/launching.md``).
        ray_address: with ``launcher=ray``: null starts a local Ray instance for the run;
            ``auto`` or ``HOST:PORT`` joins a running cluster (``ray start --head`` on one node,
            ``ray start --address=HOST:PORT`` on the others).
        placement: with ``launcher=ray``: the resource pools and the pool of each role
            (``posttrain.placement.PlacementConfig``).
        setup: ``package.module:function`` called with no arguments before the rest of the
            config is checked, once per machine (ranks take turns under a file lock), e.g. to
            build a demo's model and data files when they are missing
            (``posttrain.agents.demo:build_default_assets``); null: none. The user's own code,
            named in the config, never anything read from a checkpoint.
    """

    total_steps: int = 800
    log_every: int = 1
    output_dir: str = "outputs/sft_tiny"
    metrics_file: str = "metrics.jsonl"
    checkpoint_every: int = 0
    resume: bool = False
    overwrite: bool = False
    progress_bar: bool = True
    max_consecutive_skips: int = 3
    val_every: int = 0
    save_hf: bool = False
    save_hf_format: str = "merged"
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"], metadata={"scalar_as_list": True})
    project: str = "enginekit"
    run_name: str | None = None
    log_samples_every: int = 0
    log_samples: int = 4
    launcher: str = "torchrun"
    ray_address: str | None = None
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    setup: str | None = None

    def _problems(self) -> list[str]:
        # A chosen logger whose package is missing is refused here, at config load, not after
        # the model and data have loaded (the example configs log to tensorboard, which the
        # demos' minimal install does not have).
        out = logger_problems(self.loggers) or missing_packages(self.loggers)
        if self.launcher not in LAUNCHERS:
            out.append(f"launcher = {self.launcher!r}: unknown; fix: use one of {', '.join(LAUNCHERS)}")
        elif self.launcher == "ray" and ray_missing():
            out.append(ray_missing())
        elif self.launcher == "ray" and launcher_world() is not None:
            out.append(
                "launcher = 'ray' under torchrun ($WORLD_SIZE is set): with Ray the recipe is one driver process that starts "
                "the ranks itself; fix: run it with plain python (trainer.placement.pools sets the ranks), or launcher=torchrun"
            )
        if self.log_samples_every < 0 or self.log_samples < 1:
            out.append(
                f"log_samples_every = {self.log_samples_every}, log_samples = {self.log_samples}: need log_samples_every >= 0 "
                "(0: off) and log_samples >= 1; fix: e.g. log_samples_every=10 log_samples=4"
            )
        if self.total_steps < 1:
            out.append(f"total_steps = {self.total_steps}: must be positive; fix: e.g. 800")
        if self.log_every < 1:
            out.append(f"log_every = {self.log_every}: must be positive; fix: e.g. 100")
        if self.max_consecutive_skips < 0:
            out.append(f"max_consecutive_skips = {self.max_consecutive_skips}: negative; fix: use 0 (never stop) or a positive count")
        if self.save_hf_format not in ("merged", "adapter"):
            out.append(f"save_hf_format = {self.save_hf_format!r}: unknown; fix: use merged or adapter")
        if self.val_every < 0:
            out.append(f"val_every = {self.val_every}: negative; fix: use 0 (only at the end) or a step interval")
        if self.checkpoint_every < 0:
            out.append(f"checkpoint_every = {self.checkpoint_every}: negative; fix: use 0 (off) or a step interval")
        if not self.output_dir:
            out.append(f"output_dir = {self.output_dir!r}: empty; fix: name a directory, e.g. outputs/sft_tiny")
        if not self.metrics_file or os.sep in self.metrics_file:
            out.append(f"metrics_file = {self.metrics_file!r}: must be a plain file name; fix: e.g. metrics.jsonl")
        return out


def data_model_problems(cfg) -> list[str]:
    """Data files need a model directory with a tokenizer (the built tiny model has none); an
    adapter export needs LoRA."""
    out = []
    if cfg.trainer.save_hf_format == "adapter" and not cfg.engine.model.lora.enabled:
        out.append(
            "trainer.save_hf_format = 'adapter': the engine has no LoRA adapters (engine.model.lora.rank = 0); fix: "
            "save_hf_format=merged, or train with engine.model.lora.rank > 0"
        )
    if cfg.data.from_files and cfg.engine.model.path is None:
        return out + [
            "engine.model.path = None: data.train_files are tokenized with the model directory's own tokenizer, and the built "
            "tiny model has none; fix: engine.model.path=DIR (an HF model directory with its tokenizer)"
        ]
    return out


# ---------------------------------------------------------------------------------- setup
def with_model_path(cfg):
    """``cfg`` unchanged when ``engine.model.path`` is set; otherwise build the tiny model
    into ``<output_dir>/tiny_model`` (rank 0 writes, the others wait) and point at it.

    Works for any recipe config with ``engine``, ``tiny_model``, ``data`` (a
    ``posttrain.sort_task.DataConfig``) and ``trainer`` fields (SFT and PPO).
    """
    if cfg.engine.model.path is not None:
        return cfg
    path = os.path.join(cfg.trainer.output_dir, "tiny_model")
    if rank() == 0:
        # The section declares the model; the sorting task its vocabulary, special ids and
        # longest sequence.
        build_tiny_model(
            path,
            **dataclasses.asdict(cfg.tiny_model),
            vocab_size=task.VOCAB_SIZE,
            max_position_embeddings=max(MAX_POSITIONS, task.max_seq_len(cfg.data)),
            bos_token_id=task.BOS,
            eos_token_id=task.EOS,
            pad_token_id=task.PAD,
        )
    if is_initialized():
        # Every rank loads the files rank 0 just wrote: nobody may read before they exist.
        dist.barrier()
    model = dataclasses.replace(cfg.engine.model, path=path)
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, model=model))


# ---------------------------------------------------------------------------------- console
def progress_bar(tc: TrainerConfig, start: int, rank0: bool, desc: str):
    """The tqdm bar of a run (rank 0 with ``trainer.progress_bar`` and stderr a terminal;
    disabled otherwise, its calls then do nothing). On stderr, so stdout holds only the log lines."""
    from tqdm.auto import tqdm

    shown = rank0 and tc.progress_bar and sys.stderr.isatty()
    return tqdm(total=tc.total_steps, initial=start, desc=desc, disable=not shown, dynamic_ncols=True, file=sys.stderr)


def open_loggers(cfg, tc: TrainerConfig, start: int, rank0: bool, bar) -> RunLog:
    """The run's loggers (``trainer.loggers``, plus ``jsonl`` always: the plots and the summary
    read the metrics file); console lines go through the bar when it is shown, so they do not
    tear it. Nothing is logged on ranks other than 0."""
    names = list(dict.fromkeys([*tc.loggers, "jsonl"]))
    return build_loggers(
        names,
        output_dir=tc.output_dir,
        metrics_file=tc.metrics_file,
        samples_file=SAMPLES_FILE,
        project=tc.project,
        run_name=tc.run_name,
        config=dataclasses.asdict(cfg),  # the hyperparameters W&B / MLflow / TensorBoard record
        total_steps=tc.total_steps,
        start_step=start,
        console_every=tc.log_every,
        rank0=rank0,
        write=bar.write if not bar.disable else None,
    )


class EngineWorker:
    """The checkpoint and export calls of one rank's side of a supervised-style recipe (SFT's
    worker, DPO's and the reward model's): a subclass sets ``self.cfg`` (the recipe's config)
    and ``self.engine`` (the trained engine)."""

    cfg = None
    engine = None

    def save_checkpoint(self, ckpt_dir: str, step: int) -> None:
        self.engine.save_checkpoint(ckpt_dir, global_step=step)

    def load_checkpoint(self, path: str) -> int:
        return int(self.engine.load_checkpoint(path, del_local_after_load=False))

    def save_hf(self, out_dir: str, fmt: str) -> str:
        """The trained model as an HF directory (``posttrain.export.save_hf``). Collective."""
        from posttrain.export import save_hf

        return save_hf(self.engine, self.cfg.engine, out_dir, fmt)


def place_worker(cfg, worker_cls: type, data):
    """A supervised-style recipe's ranks (SFT, DPO, a reward model): this process
    (``trainer.launcher=torchrun``: ``worker_cls(cfg, data)``), or Ray workers driven from here
    (``ray``: :func:`place_on_ray`, each loading its own data) behind the same methods."""
    if cfg.trainer.launcher == "ray":
        return place_on_ray(cfg, worker_cls)
    return worker_cls(cfg, data)


def place_on_ray(cfg, worker_cls: type):
    """Start (or join) Ray, reserve the pool of a one-role recipe (SFT, DPO, a reward model:
    ``actor``, every engine of the recipe in one worker per rank) and build ``worker_cls(cfg)``
    on every rank; the recipe's process runs the loop and sends each step's global batch through
    Ray's object store (every rank takes its data-parallel shard, as under torchrun). Returns the
    worker's stand-in (``posttrain.placement.remote.RemoteRole``: each method call runs on every
    rank, rank 0's result comes back), whose ``close`` tears the cluster down.

    Raises:
        ValueError: a placement the recipe cannot use, or a cluster that cannot hold it (before
            any model is built).
    """
    from posttrain.placement.cluster import RayCluster
    from posttrain.placement.config import placement_problems
    from posttrain.placement.remote import RemoteRole

    class RayWorker(RemoteRole):
        def close(self) -> None:
            self._cluster.close()

    t = cfg.trainer
    problems = placement_problems(t.placement, ("actor",))
    if problems:
        raise ValueError("; ".join(problems))
    pool = t.placement.assignment(("actor",))["actor"]
    cluster = RayCluster(t.placement, {pool: ("actor",)}, t.ray_address, cfg.engine.dist_timeout_s).__enter__()
    try:
        group = cluster.spawn(pool)
        cluster.build(group, worker_cls, cfg)
        cluster.record(t.output_dir)
        return RayWorker(cluster, group, worker_cls)
    except BaseException:
        cluster.close(graceful=False)
        raise


def recipe_main(argv, module: str, doc: str, config_cls: type, default_config: str, run_fn):
    """The command line of a supervised-style recipe (SFT, DPO, reward model): ``--config`` and
    overrides, the config's ``trainer.setup``, the process group under ``trainer.launcher:
    torchrun`` (or plain python), ``run_fn(cfg)``; its summary.

    Raises:
        SystemExit: ``128 + signal`` after a SIGTERM / SIGINT stopped the run at a step boundary
            and its checkpoint was saved (``posttrain.preemption``).
    """
    import torch.distributed as dist

    from engine_api.typed_config import load_typed
    from posttrain.cli import parse_recipe_args, run_setup
    from posttrain.dist import init_distributed, rank
    from posttrain.preemption import Preempted

    config_path, overrides = parse_recipe_args(
        argv, prog=f"python -m {module}", description=doc.split("\n\n")[0], config_cls=config_cls, default_config=default_config
    )
    run_setup(config_path, overrides)  # e.g. a demo's starting model, built on first use
    cfg = load_typed(config_cls, config_path, overrides)
    started = init_distributed(cfg.engine.dist_timeout_s) if cfg.trainer.launcher == "torchrun" else False
    try:
        try:
            summary = run_fn(cfg)
        except Preempted as exc:  # every rank stops at the same step (agreed), so the teardown below is safe
            if rank() == 0:
                print(str(exc), flush=True)
            if started:
                dist.barrier()
            raise SystemExit(exc.exit_code) from None
        if started:
            # Tear down only when every rank is done: a gloo rank that closes its connections
            # while a peer is still inside a collective makes that peer abort. (Not on an
            # error: a failed rank must not wait for peers that may never arrive.)
            dist.barrier()
        return summary
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()
