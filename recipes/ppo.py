"""PPO (critic + GAE) and GRPO (group-normalised rewards, no critic), driven only through the
roles (``roles/``) and therefore through ``BaseEngine``: on the built-in digit-sorting task by
default, or on the user's model directory, prompt files and reward function.

Run: ``python -m recipes.ppo --config configs/ppo_tiny.yaml [key=value ...]`` (or
``configs/grpo_tiny.yaml``); ``engine.strategy=megatron`` switches backend; under
``torchrun --nproc-per-node N`` all roles run colocated on every rank. Own data:
``engine.model.path=DIR data.train_files=[p.parquet] reward.function=rw.py:score``
(``posttrain.text_data``, ``posttrain.rewards``).

One step: the prompts of the step (a pure function of ``data.seed`` and the step,
``posttrain.tasks``) -> ``Rollout`` (weights synced from the actor) samples ``algo.n_samples``
responses per prompt, each ending at an EOS id, a stop string or the length limit -> rewards
(the sorting task's partial credit, or ``reward.function`` on the decoded text) -> reference
log-probs (when ``actor.kl_coef > 0``) -> old log-probs (actor) -> values and GAE (PPO) or
group-normalised advantages (GRPO) -> actor and critic updates. Every ``trainer.val_every``
steps (and at the end, when there are validation prompts) one response per validation prompt
is sampled with the rollout settings and a fixed seed and its mean reward logged as
``val/reward``. Rank 0 writes one JSON line per step and, at the end, a PNG of the reward curve.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Union

import torch
import torch.distributed as dist

from engine_api import EngineConfig, ckpt_layout
from engine_api.batch import unpack
from engine_api.dist import is_initialized
from engine_api.moe import ROUTING_FIELD
from engine_api.typed_config import load_typed
from posttrain.agents import AgentBatch, AgentLoop, EnvConfig
from posttrain.agents.loop import load_env_code
from posttrain.async_rl import AsyncConfig, Pipeline
from posttrain.cli import parse_recipe_args
from posttrain.data_order import check_order, save_order
from posttrain.dist import init_distributed, rank
from posttrain.export import save_hf
from posttrain.plots import plot_run
from posttrain.preemption import Preempted, PreemptionGuard, stop_while_starting
from posttrain.rewards import RewardConfig
from posttrain.tasks import build_task
from posttrain.text_data import DataConfig
from posttrain.tiny_model import is_built_model
from posttrain.trainer_utils import SkipGuard, demo_setting_warnings, guard_fresh_run, load_newest_valid, quiet_console, run_cli, warn
from recipes.common import TinyModelConfig, TrainerConfig, data_model_problems, open_loggers, progress_bar, with_model_path
from recipes.rl_roles import build_rollout_role, rl_placement_problems, rl_roles, rollout_model_problems  # noqa: F401 (re-exported)
from roles.actor import ActorConfig, routing_for_update
from roles.algos import gae, group_reward_stats, grpo_advantages
from roles.critic import CriticConfig
from roles.factory import build_roles
from roles.legacy_flag import FLAG_VALUES, legacy_problems, use_legacy
from roles.rollout import Rollout, RolloutConfig, step_seeds

DEFAULT_CONFIG = "configs/ppo_tiny.yaml"
ADVANTAGES = ("gae", "grpo")
# Validation rollouts draw from seeds this far above the training ones, which they never reach.
_VAL_SEED_OFFSET = 10**9


@dataclass(frozen=True)
class AlgoConfig:
    """The RL algorithm.

    Attributes:
        advantage: ``gae`` (PPO with a critic) or ``grpo`` (no critic).
        n_samples: responses per prompt (the GRPO group size).
        gamma, lam: GAE discount and lambda (the reward comes at the last response token).
        critic_lr: learning rate of the critic engine (it shares the other engine keys).
    """

    advantage: str = "gae"
    n_samples: int = 4
    gamma: float = 1.0
    lam: float = 1.0
    critic_lr: float = 3e-3

    def _problems(self) -> list[str]:
        out = []
        if self.advantage not in ADVANTAGES:
            out.append(f"advantage = {self.advantage!r}: unknown; fix: use one of {', '.join(ADVANTAGES)}")
        if self.n_samples < 1 or (self.advantage == "grpo" and self.n_samples < 2):
            out.append(f"n_samples = {self.n_samples}: GRPO needs groups of >= 2 (others >= 1); fix: e.g. 8")
        return out


@dataclass(frozen=True)
class RLTrainerConfig(TrainerConfig):
    """The RL loop: ``TrainerConfig`` plus the role implementation switch.

    Attributes:
        use_legacy_worker_impl: ``auto`` / ``disable`` / false: the engine roles (any backend);
            ``enable`` / true: the deprecated legacy FSDP workers (``roles/legacy``), the
            parity baseline. Only ``roles.build_roles`` reads it.
    """

    total_steps: int = 160
    output_dir: str = "outputs/ppo_tiny"
    use_legacy_worker_impl: Union[str, bool] = "auto"  # noqa: UP007 (OmegaConf needs typing.Union)

    def _problems(self) -> list[str]:
        out = super()._problems()
        if self.use_legacy_worker_impl not in FLAG_VALUES:
            out.append(
                f"use_legacy_worker_impl = {self.use_legacy_worker_impl!r}: unknown; fix: use one of auto, enable, disable, true, false"
            )
        return out


@dataclass(frozen=True)
class RLRolloutConfig(RolloutConfig):
    """``roles.rollout.RolloutConfig`` plus what the recipe's text sampler honours.

    Attributes:
        stop_strings: a response also ends after the token that completes one of these in its
            decoded text (kept in the response); needs data files (the tokenizer).
    """

    stop_strings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PPOConfig:
    """Everything ``recipes.ppo`` reads; ``configs/ppo_tiny.yaml`` documents each key.

    ``data.batch_size`` is the number of prompts per step; each gets ``algo.n_samples`` responses.

    Attributes:
        engine: the actor's engine; the critic's and the reference's are derived from it.
        tiny_model: the model built when ``engine.model.path`` is null.
        data: the sorting task's prompts, or the user's prompt files (``posttrain.text_data.DataConfig``).
        reward: the reward function (``posttrain.rewards``).
        algo: the RL algorithm (PPO or GRPO).
        actor: the policy update.
        critic: the value update (PPO only).
        rollout: sampling and the rollout engine.
        trainer: the loop.
        async_: the asynchronous mode (config key ``async``): how far the rollout may run
            ahead of training (``posttrain.async_rl``).
        env: multi-turn rollouts with an environment and tools (``posttrain.agents``); off
            unless ``env.function`` is set.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    tiny_model: TinyModelConfig = field(default_factory=TinyModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RLRolloutConfig = field(default_factory=RLRolloutConfig)
    trainer: RLTrainerConfig = field(default_factory=RLTrainerConfig)
    # The config key is ``async`` (a Python keyword, so the field is ``async_``).
    async_: AsyncConfig = field(default_factory=AsyncConfig, metadata={"key": "async"})
    env: EnvConfig = field(default_factory=EnvConfig)

    def _problems(self) -> list[str]:
        out = data_model_problems(self)
        if self.data.from_files and self.reward.function is None and not self.env.enabled:
            out.append(
                "reward.function = None: prompts from data.train_files need a reward function (or an environment that gives "
                "rewards); fix: reward.function=file.py:fn, or env.function"
            )
        out += agent_problems(self)
        if not self.data.from_files and self.reward.function is not None:
            out.append(
                f"reward.function = {self.reward.function!r}: the built-in sorting task (no data.train_files) has no text to score; "
                "fix: give data.train_files, or drop reward.function"
            )
        if self.rollout.stop_strings and not self.data.from_files:
            out.append("rollout.stop_strings: the sorting task has no tokenizer to decode them; fix: give data.train_files, or drop them")
        if self.rollout.lora_sync == "adapter" and not self.engine.model.lora.enabled:
            out.append("rollout.lora_sync = 'adapter': the actor trains no adapters (engine.model.lora.rank = 0); fix: lora_sync=auto")
        if self.trainer.launcher == "ray":
            out += rl_placement_problems(self)
        # Legacy workers + an engine config they cannot run (e.g. megatron) fails at load time.
        if self.trainer.use_legacy_worker_impl in FLAG_VALUES:  # else reported by trainer._problems
            out += legacy_problems(self.trainer.use_legacy_worker_impl, self.engine)
            if self.actor.router_replay != "off" and use_legacy(self.trainer.use_legacy_worker_impl):
                out.append(
                    f"actor.router_replay = {self.actor.router_replay!r}: the legacy workers do not route by a recorded routing; "
                    "fix: trainer.use_legacy_worker_impl=auto, or actor.router_replay=off"
                )
        return out


def agent_problems(cfg: PPOConfig) -> list[str]:
    """What multi-turn rollouts (``env.function``) cannot run with yet, each named."""
    if not cfg.env.enabled:
        return []
    out = []
    if not cfg.data.from_files:
        out.append(
            f"env.function = {cfg.env.function!r}: multi-turn rollouts need a tokenizer with a chat template (the sorting task has "
            "none); fix: give data.train_files and engine.model.path"
        )
    if cfg.trainer.use_legacy_worker_impl in FLAG_VALUES and use_legacy(cfg.trainer.use_legacy_worker_impl):
        out.append(
            "trainer.use_legacy_worker_impl: the legacy workers train single-turn batches only, not env.function's multi-turn "
            "trajectories; fix: trainer.use_legacy_worker_impl=auto"
        )
    if cfg.rollout.max_model_len is not None and cfg.rollout.max_model_len < cfg.env.max_tokens:
        out.append(
            f"env.max_tokens = {cfg.env.max_tokens} > rollout.max_model_len = {cfg.rollout.max_model_len}: a trajectory could "
            "outgrow the rollout engine; fix: lower env.max_tokens or raise rollout.max_model_len"
        )
    return out


def build_agent(cfg: PPOConfig, source) -> AgentLoop | None:
    """The run's multi-turn rollout (``env.function``), or None (single-turn)."""
    if not cfg.env.enabled:
        return None
    reward = None
    if cfg.reward.function is not None:
        reward = (source.reward_fn, cfg.reward.function, cfg.reward.batched, cfg.reward.timeout_s)
    return AgentLoop(cfg.env, source.tokenizer, cfg.data.chat_template_kwargs, source.stop_ids, cfg.rollout.temperature, reward)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``--config`` + overrides, train, return the summary.

    Raises:
        SystemExit: ``128 + signal`` after a SIGTERM / SIGINT stopped the run at a step
            boundary and its checkpoints were saved (``posttrain.preemption``).
    """
    config_path, overrides = parse_recipe_args(
        argv, prog="python -m recipes.ppo", description=__doc__.split("\n\n")[0], config_cls=PPOConfig, default_config=DEFAULT_CONFIG
    )
    cfg = load_typed(PPOConfig, config_path, overrides)
    started = init_distributed(cfg.engine.dist_timeout_s) if cfg.trainer.launcher == "torchrun" else False
    # Before with_model_path fills in the built tiny model: only the user's own model is warned about.
    lora = cfg.engine.model.lora.enabled
    own_model = cfg.engine.model.path is not None and not is_built_model(cfg.engine.model.path)  # a built model is not pretrained
    warn(demo_setting_warnings("rl", own_model, cfg.engine.optim.lr, lora, cfg.actor.entropy_coef), rank() == 0)
    cfg = _fit_rollout_to_cpu(cfg, rank() == 0)
    try:
        try:
            guard_fresh_run(
                cfg.trainer.output_dir, cfg.trainer.resume, cfg.trainer.overwrite, rank() == 0
            )  # before the tiny model is built there
            return run(with_model_path(_fit_tiny_model(cfg)))
        except Preempted as exc:  # agreed by every rank at the same step boundary
            if not is_initialized() or dist.get_rank() == 0:
                print(str(exc), flush=True)
            raise SystemExit(exc.exit_code) from None
    finally:
        if started and is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _fit_rollout_to_cpu(cfg: PPOConfig, rank0: bool) -> PPOConfig:
    """On a machine without CUDA (and not on Ray, whose workers may have GPUs), vLLM in bf16 / fp16
    spends many minutes compiling its CPU kernels before the first step (measured: no step in 20
    minutes with the GRPO example): its rollout runs in float32 instead, with a one-line warning
    naming the key. Every other setting is unchanged."""
    r = cfg.rollout
    if r.backend != "vllm" or r.dtype == "float32" or torch.cuda.is_available() or cfg.trainer.launcher == "ray":
        return cfg
    warn(
        [
            f"rollout.dtype = {r.dtype} with rollout.backend = vllm on a machine without CUDA: vLLM's CPU {r.dtype} kernels compile "
            "for many minutes before the first step; using float32 (set rollout.dtype=float32 to silence this, or rollout.backend=hf)"
        ],
        rank0,
    )
    return replace(cfg, rollout=replace(r, dtype="float32"))


def _fit_tiny_model(cfg: PPOConfig) -> PPOConfig:
    """With ``rollout.backend=vllm`` on a CPU, the built tiny model (no ``engine.model.path``,
    no ``tiny_model.head_dim``) gets ``head_dim`` 32: vLLM's CPU attention kernel refuses
    narrower heads. Any other setup is unchanged."""
    tm = cfg.tiny_model
    if cfg.rollout.backend != "vllm" or cfg.engine.model.path is not None or tm.head_dim is not None or torch.cuda.is_available():
        return cfg
    if tm.hidden_size // tm.num_heads >= 32:
        return cfg
    return replace(cfg, tiny_model=replace(tm, head_dim=32))


def run(cfg: PPOConfig) -> dict[str, Any]:
    """Build the roles and train; see the module docstring for one step.

    Raises:
        Preempted: a SIGTERM / SIGINT stopped the run at a step boundary (checkpoints saved).
    """
    t = cfg.trainer
    rank0 = (dist.get_rank() if is_initialized() else 0) == 0
    if cfg.data.max_response_length is not None:
        cfg = replace(cfg, rollout=replace(cfg.rollout, max_new_tokens=cfg.data.max_response_length))
    refused = rollout_model_problems(cfg)  # from the model's files: before the data and any engine
    if refused:
        raise ValueError("; ".join(refused))
    if cfg.env.enabled:
        load_env_code(cfg.env)  # a misspelt environment or tool fails now, not after the data load
    guard_fresh_run(t.output_dir, t.resume, t.overwrite, rank0)
    source = build_task(cfg)  # before the roles: bad data or a bad reward function fails fast
    agent = build_agent(cfg, source)  # likewise a bad environment or tool
    ckpt_dir = os.path.join(t.output_dir, "checkpoints")
    if t.resume and ckpt_layout.latest_checkpoint(os.path.join(ckpt_dir, "actor")) is not None:
        check_order(ckpt_dir, source.data_order(), rank0)  # a step is a position in the data order: refused before any engine
    with stop_while_starting("building the engines"):
        placed = place_roles(cfg, source)
    actor, critic, reference, rollout = placed.actor, placed.critic, placed.reference, placed.rollout
    metrics_path = os.path.join(t.output_dir, t.metrics_file)
    if rank0:
        os.makedirs(t.output_dir, exist_ok=True)
    rewards = []
    guard = SkipGuard(t.max_consecutive_skips)
    bar = None
    val_reward = None
    no_signal_warned = False
    what = "your data" if cfg.data.from_files else "digit sorting"
    title = f"{'PPO (GAE)' if critic is not None else 'GRPO'} on {what}"
    began = False  # a refused resume writes nothing, not even the plots
    try:
        start = _resume(actor, critic, ckpt_dir, rank0) if t.resume else 0
        pipeline = Pipeline(cfg, rollout, source, rank0, score=lambda batch: actor.compute_log_probs(batch)["log_probs"], agent=agent)
        pipeline.resume(ckpt_dir, start)
        began = True
        bar = progress_bar(t, start, rank0, "rl")
        with open_loggers(cfg, t, start, rank0, bar) as run_log, PreemptionGuard() as preemption:
            for step in range(start, t.total_steps):
                samples = t.log_samples if t.log_samples_every and (step + 1) % t.log_samples_every == 0 else 0
                train = functools.partial(train_on_batch, cfg, step, actor=actor, critic=critic, reference=reference, rollout=rollout)
                m = pipeline.step(step, functools.partial(train, source=source, samples=samples))
                if critic is None and m["frac_reward_zero_std"] == 1.0 and not no_signal_warned:
                    no_signal_warned = True  # once per run: a sparse reward can stay flat for many steps
                    warn([no_signal_warning(step + 1, cfg.algo.n_samples, cfg.actor.entropy_coef, cfg.actor.kl_coef)], rank0)
                if samples:
                    run_log.log_samples(step + 1, m.pop("samples"))
                rewards.append(m["reward"])
                if (t.val_every and (step + 1) % t.val_every == 0) or step + 1 == t.total_steps:
                    chunk = cfg.data.batch_size * cfg.algo.n_samples
                    score = validate(source, rollout, chunk, agent, cfg.rollout.max_new_tokens, cfg.rollout.seed)
                    if score is not None:  # None: no validation prompts
                        m["val/reward"] = val_reward = score
                        run_log.message(f"validation at step {step + 1}: mean reward {score:.4f}")
                run_log.log(step + 1, {k: v for k, v in m.items() if k != "step"})
                bar.set_postfix(reward=f"{m['reward']:.3f}", refresh=False)
                bar.update()
                # A step is lost when every optimizer step of a role was skipped (non-finite loss/grads).
                guard.update(step + 1, m["actor_skipped"] == 1.0 or m.get("critic_skipped", 0.0) == 1.0)
                saved = bool(t.checkpoint_every) and (step + 1) % t.checkpoint_every == 0
                if saved:
                    _save(actor, critic, ckpt_dir, step + 1, pipeline, source)
                signum = preemption.stop_requested()
                if signum is not None:
                    if not saved:
                        _save(actor, critic, ckpt_dir, step + 1, pipeline, source)
                    raise Preempted(signum, step + 1, _saved_at(ckpt_dir, critic, step + 1))
        hf_dir = None
        if t.save_hf:  # a signal during the export: it finishes, then the run stops with its state saved
            with PreemptionGuard() as late:
                hf_dir = placed.save_hf(os.path.join(t.output_dir, "hf"), t.save_hf_format)
                signum = late.stop_requested()
            if signum is not None:
                if not ((t.checkpoint_every and t.total_steps % t.checkpoint_every == 0) or start >= t.total_steps):
                    _save(actor, critic, ckpt_dir, t.total_steps, pipeline, source)
                raise Preempted(signum, t.total_steps, _saved_at(ckpt_dir, critic, t.total_steps))
    finally:
        if bar is not None:
            bar.close()
        placed.close()
        if agent is not None:
            agent.close()  # its tool worker processes
        if rank0 and began and os.path.exists(metrics_path):
            plot_run(metrics_path, t.output_dir, title)
    history = [json.loads(line)["reward"] for line in open(metrics_path)] if rank0 else rewards
    summary = {
        "steps": t.total_steps,
        "first_reward": _mean(history[:5]),
        "last_reward": _mean(history[-5:]),
        "val_reward": val_reward,
        "data": source.counts,
        "hf_dir": hf_dir,
    }
    if rank0:
        print(
            f"{cfg.algo.advantage} done: mean reward {summary['first_reward']:.3f} (first 5 steps) -> {summary['last_reward']:.3f} (last 5)"
        )
    return summary


@dataclass
class LocalRoles:
    """The roles in this process (``trainer.launcher=torchrun``: every role on every rank)."""

    actor: Any
    critic: Any
    reference: Any
    rollout: Rollout
    engine_config: EngineConfig

    def save_hf(self, out_dir: str, fmt: str) -> str:
        return save_hf(self.actor, self.engine_config, out_dir, fmt)

    def close(self) -> None:
        self.rollout.engine.shutdown()


def place_roles(cfg: PPOConfig, source):
    """The run's roles: built in this process (``trainer.launcher=torchrun``), or in worker
    groups on a Ray cluster driven from here (``ray``; ``recipes.ppo_ray``). Both have
    ``actor``, ``critic``, ``reference``, ``rollout``, ``save_hf`` and ``close``."""
    if cfg.trainer.launcher == "ray":
        from recipes.ppo_ray import place_on_ray

        return place_on_ray(cfg)
    roles = build_roles(cfg)
    return LocalRoles(roles.actor, roles.critic, roles.reference, build_rollout_role(cfg, roles.actor, source), cfg.engine)


def _save(actor, critic, ckpt_dir: str, step: int, pipeline: Pipeline, source) -> None:
    """The data order and the asynchronous state first, then the roles: a complete role
    checkpoint has both (``posttrain.data_order``, ``posttrain.async_rl.state``)."""
    if (dist.get_rank() if is_initialized() else 0) == 0:
        save_order(ckpt_dir, source.data_order())
    pipeline.save(ckpt_dir, step)
    actor.save_checkpoint(os.path.join(ckpt_dir, "actor"), global_step=step)
    if critic is not None:
        critic.save_checkpoint(os.path.join(ckpt_dir, "critic"), global_step=step)
    pipeline.after_save(ckpt_dir, step, set(ckpt_layout.complete_steps(os.path.join(ckpt_dir, "actor"))))


def validate(source, rollout: Rollout, chunk: int, agent: AgentLoop | None = None, max_new_tokens: int = 0, seed: int = 0) -> float | None:
    """Mean reward of one response (with ``agent``: one trajectory) per validation prompt,
    sampled with the rollout settings from fixed seeds (the same draws at every validation),
    ``chunk`` prompts per sampler call (a training step's number of responses); None without
    validation prompts. ``seed``: ``rollout.seed`` (the trajectories' seeds, as ``Rollout.seeds``
    derives them; the Ray stand-in of the rollout has no such method)."""
    val = source.val_prompts()
    if val is None:
        return None
    prompts, metas = val
    rollout.sync_weights()
    if agent is None:
        scores, _ = evaluate_prompts(source, rollout, prompts, metas, chunk)
    else:
        scores = [out.scores for out in evaluate_trajectories(agent, rollout, metas, chunk, max_new_tokens, seed)]
    rollout.release()
    return mean_reward(scores)


def evaluate_trajectories(agent: AgentLoop, rollout: Rollout, metas: list, chunk: int, max_new_tokens: int, seed: int) -> list[AgentBatch]:
    """The trajectories of one per prompt row of ``metas``, ``chunk`` rows per call, call ``k``
    seeded from the validation offset + ``k``: :func:`validate`'s draws for a multi-turn run,
    which ``recipes.evaluate`` repeats from a checkpoint. Collective over the rollout group."""
    return [
        agent.run(rollout, metas[b : b + chunk], step_seeds(seed, _VAL_SEED_OFFSET + k, len(metas[b : b + chunk])), max_new_tokens)
        for k, b in enumerate(range(0, len(metas), chunk))
    ]


def evaluate_prompts(source, rollout: Rollout, prompts: list, metas: list, chunk: int) -> tuple[list[torch.Tensor], list]:
    """The rewards and the sampled batches of one response per prompt, ``chunk`` prompts per
    sampler call, call ``k`` seeded with the validation offset + ``k``: :func:`validate`'s draws,
    which ``recipes.evaluate`` repeats from a checkpoint. One rewards tensor and one batch per
    call. Collective over the rollout group."""
    scores, batches = [], []
    for k, begin in enumerate(range(0, len(prompts), chunk)):
        batch = rollout.generate(prompts[begin : begin + chunk], seed_offset=_VAL_SEED_OFFSET + k)
        scores.append(source.score(_responses(batch), metas[begin : begin + chunk]))
        batches.append(batch)
    return scores, batches


def mean_reward(scores: list[torch.Tensor]) -> float:
    """The mean of :func:`evaluate_prompts`' rewards, summed call by call (``val/reward``)."""
    return sum(float(s.sum()) for s in scores) / sum(len(s) for s in scores)


def no_signal_warning(step: int, n_samples: int, entropy_coef: float = 0.0, kl_coef: float = 0.0) -> str:
    """The one-time warning of a GRPO step where every prompt group had identical rewards. What
    it says about the update is what is true: without an entropy bonus or a KL term the loss and
    the gradient are exactly 0; with either, they are all that moved the policy."""
    terms = [f"the entropy bonus (actor.entropy_coef = {entropy_coef:g})"] * (entropy_coef > 0) + [
        f"the KL penalty (actor.kl_coef = {kl_coef:g})"
    ] * (kl_coef > 0)
    update = (
        f"the policy-gradient term is exactly 0, and only {' and '.join(terms)} moved the policy"
        if terms
        else "the loss and the gradient are exactly 0 and the policy did not change"
    )
    return (
        f"GRPO step {step}: every prompt group's {n_samples} responses got the same reward (frac_reward_zero_std = 1), so "
        f"every advantage is exactly 0: {update}; if this persists (see frac_reward_zero_std in the metrics) the run cannot "
        "learn from the reward: use a denser reward (partial credit), more samples per prompt (algo.n_samples), or prompts "
        "the model can sometimes solve"
    )


def _responses(batch) -> list[torch.Tensor]:
    """Each sample's response token ids. Sliced from the jagged field's flat values: indexing
    a nested tensor row by row cost ~1 ms a row (measured: a third of a tiny GRPO step)."""
    ids = batch["input_ids"]
    values, offsets, plen = ids.values(), ids.offsets().tolist(), batch["prompt_len"].tolist()
    return [values[offsets[i] + int(plen[i]) : offsets[i + 1]] for i in range(len(plen))]


def rl_step(cfg: PPOConfig, step: int, actor, critic, reference, rollout, source=None, samples: int = 0) -> dict[str, Any]:
    """One RL step (see the module docstring) on any role implementation; returns its metrics.

    ``source``: the prompts and rewards (``posttrain.tasks.build_task(cfg)``; None builds it).
    ``samples`` > 0 adds ``"samples"``: the first that many generations of the step as
    ``{"prompt", "response", "reward"}`` text rows (one per prompt group first, so a GRPO
    group of identical prompts is not logged over and over)."""
    source = source if source is not None else build_task(cfg)
    t0 = time.perf_counter()
    prompts, metas = step_prompts(source, step, cfg.algo.n_samples)
    # Version = 1 + the actor updates so far: what the samples of this step must carry.
    rollout.sync_weights(version=step + 1)
    batch = rollout.generate(prompts, seed_offset=step)
    rollout.release()  # the engine's memory back to training (vLLM sleep on GPU; nothing on CPU)
    timings = {"rollout_s": time.perf_counter() - t0}
    return train_on_batch(
        cfg, step, batch, metas, timings, actor=actor, critic=critic, reference=reference, rollout=rollout, source=source, samples=samples
    )


def step_prompts(source, step: int, n: int) -> tuple[list[torch.Tensor], list]:
    """The prompts of training step ``step`` and their metadata, each repeated ``n`` times (one
    entry per response, a prompt's group together)."""
    prompts, metas = source.prompts_at(step)
    return [p for p in prompts for _ in range(n)], [meta for meta in metas for _ in range(n)]


def train_on_batch(
    cfg: PPOConfig,
    step: int,
    batch,
    metas: list,
    timings: dict[str, float],
    *,
    actor,
    critic,
    reference,
    rollout,
    source,
    samples: int = 0,
    agent: AgentBatch | None = None,
) -> dict[str, Any]:
    """The training half of :func:`rl_step`: score the sampled ``batch`` (prompts of ``step``,
    ``metas`` per response), prepare and update, return the step's metrics; ``timings`` holds
    the sampling's seconds (``rollout_s``) and gets the rest.

    ``agent``: the batch is multi-turn trajectories (``posttrain.agents``), already scored:
    GRPO groups are over trajectories, and a trajectory split into several rows gives each of
    them its advantage (PPO: its reward at each row's last sampled token)."""
    n = cfg.algo.n_samples
    lengths = batch["input_ids"].offsets().diff()
    t0 = time.perf_counter()
    if agent is None:
        scores = source.score(_responses(batch), metas)  # raises before any update when a reward fails
        row_traj = torch.arange(len(scores))
    else:
        scores, row_traj = agent.scores, agent.traj_of_row
    timings["reward_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    # One update epoch over one mini-batch of a dense, dropout-free policy: the old-policy
    # log-probs are the update's own forward's (Actor.reuses_update_log_probs), one forward saved.
    reuse = actor.reuses_update_log_probs(len(lengths))
    routing_metrics: dict[str, float] = {}
    if not reuse:
        old = actor.compute_log_probs(batch, calculate_entropy=True)
        batch.set("old_log_probs", unpack(old["log_probs"].values(), batch["input_ids"]))
        routing, routing_metrics = routing_for_update(cfg.actor, batch, old)  # MoE: what the update replays or is measured against
        if routing is not None:
            batch.set(ROUTING_FIELD, routing)
    if reference is not None:
        batch.set("ref_log_probs", unpack(reference.compute_log_probs(batch)["log_probs"].values(), batch["input_ids"]))
    mask = batch["loss_mask"].values()
    if critic is None:
        adv = torch.repeat_interleave(grpo_advantages(scores, torch.arange(len(scores)) // n)[row_traj], lengths) * mask
    else:
        values = critic.compute_values(batch)["values"].values() * mask
        adv, returns = _gae_per_sequence(scores[row_traj], values, mask, batch["input_ids"].offsets(), cfg.algo)
        batch.set("values", unpack(values, batch["input_ids"]))
        batch.set("returns", unpack(returns, batch["input_ids"]))
    batch.set("advantages", unpack(adv, batch["input_ids"]))
    timings["prepare_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if reuse:
        actor_m, old = actor.update_on_policy(batch)
    else:
        actor_m = actor.update(batch)
    critic_m = critic.update(batch) if critic is not None else []
    timings["update_s"] = time.perf_counter() - t0
    parity = rollout_parity(old["log_probs"].values(), batch["rollout_log_probs"].values(), mask)
    if agent is not None:  # per turn index too: a shifted or re-encoded turn shows here
        for turn in sorted(set(agent.turns[mask > 0].tolist())):
            per_turn = rollout_parity(old["log_probs"].values(), batch["rollout_log_probs"].values(), mask * (agent.turns == turn))
            parity[f"rollout/logprob_abs_diff_max/turn_{turn}"] = per_turn["rollout/logprob_abs_diff_max"]
        parity.update(agent.metrics)
    parity.update(routing_metrics)
    parity["rollout/weight_version_lag"] = float(step + 1 - int(batch["rollout_weight_version"].min()))
    parity.update(rollout.last_sync)
    tokens = int(mask.sum())
    out = {
        "step": step + 1,
        "reward": float(scores.mean()),
        **group_reward_stats(scores, torch.arange(len(scores)) // n),
        "entropy": float((old["entropy"].values() * mask).sum() / mask.sum()),
        "response_len": float(mask.sum() / len(scores)),  # sampled tokens per response (trajectory)
        "actor_loss": _mean([m["loss"] for m in actor_m]),
        "actor_grad_norm": _mean([m["grad_norm"] for m in actor_m]),
        "actor_skipped": _mean([m.get("step_skipped", 0.0) for m in actor_m]),
        "lr": actor_m[-1].get("lr"),
        "tokens_per_s": tokens / max(1e-9, sum(timings.values())),
        **timings,
    }
    out.update(parity)
    out.update({k: v for k, v in actor_m[0].items() if k.startswith("rollout_correction/")})
    out.update({k: _mean([m.get(k) for m in actor_m]) for k in actor_m[0] if k.startswith("moe/")})
    if "kl" in actor_m[0]:
        out["kl"] = _mean([m["kl"] for m in actor_m])
    if samples:
        out["samples"] = _sample_rows(batch, scores, source, samples, n) if agent is None else _trajectory_rows(agent, samples, n)
    if critic_m:
        out["critic_loss"] = _mean([m["loss"] for m in critic_m])
        out["critic_grad_norm"] = _mean([m["grad_norm"] for m in critic_m])
        out["critic_skipped"] = _mean([m.get("step_skipped", 0.0) for m in critic_m])
    return out


def _sample_rows(batch, scores: torch.Tensor, source, count: int, group: int) -> list[dict[str, Any]]:
    """Text rows of ``count`` generations: the first response of each prompt group, then the
    second of each, and so on."""
    total = len(scores)
    order = [g * group + k for k in range(group) for g in range(total // group)][:count]
    rows = []
    values, offsets, plen = batch["input_ids"].values(), batch["input_ids"].offsets().tolist(), batch["prompt_len"].tolist()
    for i in order:
        ids, cut = values[offsets[i] : offsets[i + 1]], int(plen[i])
        rows.append(
            {"prompt": source.decode(ids[:cut].tolist()), "response": source.decode(ids[cut:].tolist()), "reward": float(scores[i])}
        )
    return rows


def _trajectory_rows(agent: AgentBatch, count: int, group: int) -> list[dict[str, Any]]:
    """:func:`_sample_rows` of multi-turn trajectories (the conversation after the prompt)."""
    total = len(agent.texts)
    order = [g * group + k for k in range(group) for g in range(total // group)][:count]
    return [agent.texts[i] for i in order]


def rollout_parity(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout engine's sampling log-probs are from the trainer's recomputed ones
    over the response tokens (flat per-token values): mean and max of ``|trainer - rollout|``,
    and ``kl_k3`` = mean of ``exp(r) - 1 - r`` with ``r = trainer - rollout``, Schulman's k3
    estimate of KL(rollout || trainer) from the rollout's own samples."""
    keep = mask > 0
    r = (trainer - rollout)[keep].double()
    if r.numel() == 0:
        return {"rollout/logprob_abs_diff_mean": 0.0, "rollout/logprob_abs_diff_max": 0.0, "rollout/kl_k3": 0.0}
    return {
        "rollout/logprob_abs_diff_mean": float(r.abs().mean()),
        "rollout/logprob_abs_diff_max": float(r.abs().max()),
        "rollout/kl_k3": float((torch.expm1(r) - r).mean()),
    }


def _gae_per_sequence(scores, values, mask, offsets, algo: AlgoConfig):
    """GAE over each sequence's response tokens, the score as the reward of the last one."""
    adv = torch.zeros_like(values)
    returns = torch.zeros_like(values)
    for i in range(len(scores)):
        idx = mask[offsets[i] : offsets[i + 1]].nonzero().squeeze(-1) + offsets[i]
        rewards = torch.zeros(len(idx))
        rewards[-1] = scores[i]
        a, r = gae(rewards, values[idx], algo.gamma, algo.lam)
        adv[idx], returns[idx] = a, r
    return adv, returns


def _resume(actor, critic, ckpt_dir: str, rank0: bool) -> int:
    """Load the newest step that every role checkpointed completely and that verifies for
    every role; 0 when the actor has no checkpoint (a fresh run). A save killed between the
    actor's and the critic's checkpoint leaves the actor a step ahead (the common step is
    loaded); a step that fails verification is skipped loudly
    (``posttrain.trainer_utils.load_newest_valid``).

    Raises:
        ValueError: the actor has checkpoints but no step is complete for every role of this
            run (a role's checkpoints are gone, or the run now has a critic the checkpoints
            never had): before anything is written.
    """
    roles = {"actor": actor, **({"critic": critic} if critic is not None else {})}
    roots = {name: os.path.join(ckpt_dir, name) for name in roles}
    latest = ckpt_layout.latest_checkpoint(roots["actor"])
    if latest is None:
        return 0
    newest = int(os.path.basename(latest)[len(ckpt_layout.PREFIX) :])  # honour `latest` (rollbacks)
    have = {name: set(ckpt_layout.complete_steps(r)) for name, r in roots.items()}
    common = set.intersection(*have.values())
    steps = sorted((s for s in common if s <= newest), reverse=True)
    if not steps:
        # The actor has checkpoints but not every role of this run has one of the same step:
        # starting over would overwrite the actor's checkpoints and the metrics. Stop first.
        lacking = [name for name in roles if not have[name]]
        why = (
            f"the {' and '.join(lacking)} has no complete checkpoint in {', '.join(roots[n] for n in lacking)}"
            if lacking
            else "no step is checkpointed completely by every role (" + "; ".join(f"{n}: {sorted(have[n])}" for n in roles) + ")"
        )
        hint = (
            " (were these checkpoints written by a GRPO run, which has no critic? resume with the run's own algo.advantage)"
            if "critic" in lacking and not os.path.isdir(roots["critic"])
            else ""
        )
        raise ValueError(
            f"trainer.resume=true: the actor has checkpoints up to step {newest} in {roots['actor']}, but {why}{hint}; starting "
            "over would overwrite them, so nothing was written; fix: restore the missing checkpoints, resume with the settings "
            "of the run that wrote them, or start a fresh run in another trainer.output_dir"
        )

    def load_step(step: int) -> int:
        for name, role in roles.items():
            role.load_checkpoint(os.path.join(roots[name], f"{ckpt_layout.PREFIX}{step}"))
        return step

    def paths(step: int) -> str:
        return ", ".join(os.path.join(roots[name], f"{ckpt_layout.PREFIX}{step}") for name in roles)

    return load_newest_valid(steps, load_step, rank0, describe=paths)


def _saved_at(ckpt_dir: str, critic, step: int) -> str:
    """Where a stopped run's checkpoints of ``step`` are, for the message: the actor's, and the
    critic's only when there is one (GRPO has none)."""
    roles = "{actor,critic}" if critic is not None else "actor"
    return os.path.join(ckpt_dir, roles, f"{ckpt_layout.PREFIX}{step}")


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return float(sum(xs) / len(xs)) if xs else float("nan")


if __name__ == "__main__":
    quiet_console()
    run_cli(main)
