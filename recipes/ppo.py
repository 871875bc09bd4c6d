"""PPO (critic + GAE) and GRPO (group-normalised rewards, no critic), driven only through the
roles (``roles/``) and so through ``BaseEngine``: on the built-in digit-sorting task by default,
or on the user's model directory, prompt files and reward function (``posttrain.text_data``,
``posttrain.rewards``); multi-turn with ``env.function`` (``posttrain.agents``).

Run: ``python -m recipes.ppo --config configs/ppo_tiny.yaml [key=value ...]`` (or
``configs/grpo_tiny.yaml``); ``engine.strategy=megatron`` switches backend; under
``torchrun --nproc-per-node N`` every role runs on every rank; ``trainer.launcher=ray`` places
them on Ray pools.

One step (``posttrain.async_rl.Pipeline``, synchronous at ``async.max_staleness=0``): the
step's prompts (a pure function of ``data.seed`` and the step) -> the producer (single-turn
sampling or multi-turn trajectories, ``posttrain.async_rl.producer``) samples ``algo.n_samples``
responses per prompt and scores them -> reference, old and value log-probs -> GAE (PPO) or
group-normalised advantages (GRPO) -> actor and critic updates (:func:`train_on_batch`). Every
``trainer.val_every`` steps, and at the end, ``val/reward`` (``posttrain.evaluation``). Rank 0
writes one JSON line per step and, at the end, a PNG of the reward curve.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Union

import torch.distributed as dist

from engine_api import EngineConfig, ckpt_layout
from engine_api.batch import attach
from engine_api.dist import is_initialized
from engine_api.moe import ROUTING_FIELD
from engine_api.typed_config import load_typed
from posttrain.agents import EnvConfig
from posttrain.agents.config import multi_turn_problems
from posttrain.agents.loop import load_env_code
from posttrain.agents.producer import build_producer, producer_sections
from posttrain.async_rl import AsyncConfig, Pipeline, Schedule, ScoredBatch
from posttrain.async_rl.dynamic import DynamicSampling
from posttrain.cli import parse_recipe_args, run_setup
from posttrain.data_order import check_order
from posttrain.dist import init_distributed, rank
from posttrain.distill import DistillConfig, distill_advantages, distill_problems, topk_batch, vocabulary_problems
from posttrain.evaluation import validate
from posttrain.gateway.config import AgentConfig, gateway_problems
from posttrain.placement.rl_host import place_roles
from posttrain.plots import plot_run
from posttrain.preemption import Preempted, PreemptionGuard, stop_while_starting
from posttrain.reward_shaping import shape_overlong
from posttrain.rewards import RewardConfig
from posttrain.rl_setup import (  # noqa: F401 (build_rollout_role, rl_roles and rl_placement_problems re-exported)
    build_rollout_role,
    fit_rollout_to_machine,
    resume_roles,
    rl_placement_problems,
    rl_roles,
    rollout_model_problems,
    save_roles,
    saved_at,
)
from posttrain.tasks import build_task
from posttrain.text_data import DataConfig
from posttrain.tiny_model import is_built_model
from posttrain.trainer_utils import SkipGuard, demo_setting_warnings, guard_fresh_run, quiet_console, run_cli, warn
from recipes.common import TinyModelConfig, TrainerConfig, data_model_problems, open_loggers, progress_bar, with_model_path
from roles.actor import ActorConfig, objective_warnings, routing_for_update
from roles.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, estimate_advantages
from roles.algos import group_reward_stats, no_signal_warning, rollout_parity
from roles.critic import CriticConfig
from roles.legacy_flag import FLAG_VALUES, legacy_problems, use_legacy
from roles.reward_model import reward_metrics, scalar_head_problems, with_model_rewards
from roles.rollout import RolloutConfig

DEFAULT_CONFIG = "configs/ppo_tiny.yaml"


@dataclass(frozen=True)
class AlgoConfig:
    """The RL algorithm.

    Attributes:
        advantage: the advantage estimator, a name of
            ``roles.advantages.ADVANTAGE_ESTIMATORS``: ``gae`` (PPO with a critic), ``grpo``,
            ``rloo``, ``reinforce_pp``, ``reinforce_pp_baseline`` (no critic).
        n_samples: responses per prompt (the group of ``grpo``, ``rloo`` and
            ``reinforce_pp_baseline``, which need >= 2).
        norm_by_std: ``grpo`` divides by the group's std (false: Dr. GRPO's centring only).
        dynamic_sampling: DAPO's dynamic sampling: train only on groups whose rewards differ,
            drawing more prompts until the batch is full (``posttrain.async_rl.dynamic``).
        dynamic_sampling_max_draws: batches a step may sample under dynamic sampling, its own
            included; past it the run stops naming the counts (verl's ``max_num_gen_batches``).
        gamma, lam: the discount (GAE, REINFORCE++) and GAE's lambda (the reward comes at the
            last response token).
        critic_lr: learning rate of the critic engine (it shares the other engine keys).
    """

    advantage: str = "gae"
    n_samples: int = 4
    norm_by_std: bool = True
    dynamic_sampling: bool = False
    dynamic_sampling_max_draws: int = 10
    gamma: float = 1.0
    lam: float = 1.0
    critic_lr: float = 3e-3

    def _problems(self) -> list[str]:
        out = []
        estimator = ADVANTAGE_ESTIMATORS.get(self.advantage)
        if estimator is None:
            out.append(f"advantage = {self.advantage!r}: unknown; fix: use one of {', '.join(ADVANTAGE_ESTIMATORS)}")
        if self.n_samples < 1 or (estimator is not None and estimator.groups and self.n_samples < 2):
            out.append(
                f"n_samples = {self.n_samples}: {self.advantage} needs groups of >= 2 (others >= 1); fix: e.g. 8, or algo.advantage "
                "gae / reinforce_pp"
            )
        if self.dynamic_sampling and self.n_samples < 2:
            out.append(f"dynamic_sampling with n_samples = {self.n_samples}: a group of one has no reward spread; fix: n_samples >= 2")
        if not 1 <= self.dynamic_sampling_max_draws <= 1000:
            out.append(f"dynamic_sampling_max_draws = {self.dynamic_sampling_max_draws}: fix: 1 to 1000 (verl's default: 10)")
        if not 0 < self.gamma <= 1 or not 0 <= self.lam <= 1:
            out.append(f"gamma = {self.gamma}, lam = {self.lam}: fix: 0 < gamma <= 1 and 0 <= lam <= 1")
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
            unless ``env.function`` is set. Its token rules also bind ``agent`` sessions.
        agent: an external agent behind the OpenAI-compatible gateway (``posttrain.gateway``);
            off unless ``agent.function`` is set.
        distill: on-policy distillation from a teacher model (``posttrain.distill``); off
            unless ``distill.teacher_path`` is set.
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
    agent: AgentConfig = field(default_factory=AgentConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def _problems(self) -> list[str]:
        out = data_model_problems(self)
        if self.data.from_files and self.reward.function is None and not (self.env.enabled or self.agent.enabled):
            out.append(
                "reward.function = None: prompts from data.train_files need a reward function (or an environment or agent that "
                "gives rewards); fix: reward.function=file.py:fn, env.function or agent.function"
            )
        out += multi_turn_problems(self.env, self.data.from_files, self.trainer.use_legacy_worker_impl, self.rollout.max_model_len)
        out += gateway_problems(self)
        if not self.data.from_files and self.reward.function is not None:
            out.append(
                f"reward.function = {self.reward.function!r}: the built-in sorting task (no data.train_files) has no text to score; "
                "fix: give data.train_files, or drop reward.function"
            )
        if self.rollout.stop_strings and not self.data.from_files:
            out.append("rollout.stop_strings: the sorting task has no tokenizer to decode them; fix: give data.train_files, or drop them")
        if self.rollout.lora_sync == "adapter" and not self.engine.model.lora.enabled:
            out.append("rollout.lora_sync = 'adapter': the actor trains no adapters (engine.model.lora.rank = 0); fix: lora_sync=auto")
        overlong = self.reward.overlong
        multi_turn = self.env.enabled or self.agent.enabled
        if overlong.enabled and overlong.max_len is None and multi_turn:
            out.append(
                "reward.overlong.max_len = null with a multi-turn run: rollout.max_new_tokens bounds one turn, not a trajectory; "
                "fix: set reward.overlong.max_len (e.g. the assistant tokens a trajectory may sample)"
            )
        elif overlong.enabled and overlong.max_len is None:
            limit = self.data.max_response_length or self.rollout.max_new_tokens
            if not overlong.buffer < limit:
                out.append(
                    f"reward.overlong.buffer = {overlong.buffer} with a response limit of {limit} tokens (data.max_response_length, "
                    "else rollout.max_new_tokens): the buffer must be shorter than the limit; fix: a smaller buffer"
                )
        if self.trainer.launcher == "ray":
            out += rl_placement_problems(self)
        # Legacy workers + an engine config they cannot run (e.g. megatron) fails at load time.
        if self.trainer.use_legacy_worker_impl in FLAG_VALUES:  # else reported by trainer._problems
            out += legacy_problems(self.trainer.use_legacy_worker_impl, self.engine)
            if self.distill.enabled and use_legacy(self.trainer.use_legacy_worker_impl):
                out.append(
                    "distill.teacher_path with the legacy workers: they have no teacher role; fix: trainer.use_legacy_worker_impl=auto"
                )
            if self.actor.router_replay != "off" and use_legacy(self.trainer.use_legacy_worker_impl):
                out.append(
                    f"actor.router_replay = {self.actor.router_replay!r}: the legacy workers do not route by a recorded routing; "
                    "fix: trainer.use_legacy_worker_impl=auto, or actor.router_replay=off"
                )
        return out


def filling(cfg: PPOConfig, reward_model=None) -> dict[str, Any]:
    """The pipeline's reward shaping and dynamic sampling under ``cfg`` (none when off). The
    shaping: the overlong penalty on the function's scores, then ``reward_model``'s scores
    combined in (``reward.model``), so dynamic sampling filters by the reward that is trained."""
    out: dict[str, Any] = {}
    overlong = cfg.reward.overlong
    shapes = []
    if overlong.enabled:
        max_len = overlong.max_len if overlong.max_len is not None else cfg.rollout.max_new_tokens
        shapes.append(functools.partial(shape_overlong, config=overlong, max_len=max_len))
    if reward_model is not None:
        shapes.append(functools.partial(with_model_rewards, reward=cfg.reward, model=reward_model))
    if shapes:
        out["shape"] = shapes[0] if len(shapes) == 1 else functools.partial(_in_turn, shapes)
        out["shape_runs_model"] = reward_model is not None
    if cfg.algo.dynamic_sampling:
        out["dynamic"] = DynamicSampling(cfg.data.batch_size, cfg.algo.n_samples, cfg.algo.dynamic_sampling_max_draws)
    return out


def _in_turn(shapes, scored):
    for shape in shapes:
        scored = shape(scored)
    return scored


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``--config`` + overrides, train, return the summary.

    Raises:
        SystemExit: ``128 + signal`` after a SIGTERM / SIGINT stopped the run at a step
            boundary and its checkpoints were saved (``posttrain.preemption``).
    """
    config_path, overrides = parse_recipe_args(
        argv, prog="python -m recipes.ppo", description=__doc__.split("\n\n")[0], config_cls=PPOConfig, default_config=DEFAULT_CONFIG
    )
    run_setup(config_path, overrides)  # e.g. a demo's model and data, built on first use
    cfg = load_typed(PPOConfig, config_path, overrides)
    started = init_distributed(cfg.engine.dist_timeout_s) if cfg.trainer.launcher == "torchrun" else False
    # Before with_model_path fills in the built tiny model: only the user's own model is warned about.
    lora = cfg.engine.model.lora.enabled
    own_model = cfg.engine.model.path is not None and not is_built_model(cfg.engine.model.path)  # a built model is not pretrained
    warn(demo_setting_warnings("rl", own_model, cfg.engine.optim.lr, lora, cfg.actor.entropy_coef), rank() == 0)
    warn(objective_warnings(cfg.actor, cfg.engine.loss_agg_mode), rank() == 0)
    cfg = fit_rollout_to_machine(cfg, rank() == 0)
    try:
        try:
            t = cfg.trainer
            guard_fresh_run(t.output_dir, t.resume, t.overwrite, rank() == 0)  # before the tiny model is built there
            return run(with_model_path(cfg))
        except Preempted as exc:  # agreed by every rank at the same step boundary
            if not is_initialized() or dist.get_rank() == 0:
                print(str(exc), flush=True)
            raise SystemExit(exc.exit_code) from None
    finally:
        if started and is_initialized():
            dist.barrier()
            dist.destroy_process_group()


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
    if cfg.distill.enabled:  # the teacher's files against the student's (a built tiny model: its directory)
        refused += distill_problems(cfg.distill, cfg.engine.model.path, t.output_dir)
    if cfg.reward.model is not None:  # a scalar-head model of the policy's vocabulary
        refused += scalar_head_problems(cfg.reward.model) or vocabulary_problems(
            cfg.engine.model.path, cfg.reward.model, "reward.model", "reward model"
        )
    if refused:
        raise ValueError("; ".join(refused))
    if cfg.env.enabled:
        load_env_code(cfg.env)  # a misspelt environment or tool fails now, not after the data load
    guard_fresh_run(t.output_dir, t.resume, t.overwrite, rank0)
    source = build_task(cfg.data, cfg.engine.model.path, cfg.reward)  # before the roles: bad data or a bad reward function fails fast
    producer = build_producer(source, **producer_sections(cfg))  # likewise a bad environment, tool or agent
    ckpt_dir = os.path.join(t.output_dir, "checkpoints")
    if t.resume and ckpt_layout.latest_checkpoint(os.path.join(ckpt_dir, "actor")) is not None:
        check_order(ckpt_dir, source.data_order(), rank0)  # a step is a position in the data order: refused before any engine
    with stop_while_starting("building the engines"):
        placed = place_roles(cfg, source)
    actor, critic, reference, rollout, teacher = placed.actor, placed.critic, placed.reference, placed.rollout, placed.teacher
    reward_model = placed.reward_model
    metrics_path = os.path.join(t.output_dir, t.metrics_file)
    if rank0:
        os.makedirs(t.output_dir, exist_ok=True)
    rewards = []
    guard = SkipGuard(t.max_consecutive_skips)
    bar = None
    val_reward = None
    no_signal_warned = False
    title = f"{'PPO (GAE)' if critic is not None else 'GRPO'} on {'your data' if cfg.data.from_files else 'digit sorting'}"
    began = False  # a refused resume writes nothing, not even the plots
    roles = {"actor": actor, **({"critic": critic} if critic is not None else {})}
    try:
        start = resume_roles(roles, ckpt_dir, rank0) if t.resume else 0
        schedule = Schedule(cfg.data.batch_size, cfg.algo.n_samples, cfg.rollout.seed, t.total_steps, t.output_dir)
        score = lambda batch: actor.compute_log_probs(batch)["log_probs"]  # noqa: E731 (the version-parity probe)
        pipeline = Pipeline(cfg.async_, schedule, producer, rollout, source, rank0, score=score, **filling(cfg, reward_model))
        pipeline.resume(ckpt_dir, start)
        began = True
        bar = progress_bar(t, start, rank0, "rl")
        with open_loggers(cfg, t, start, rank0, bar) as run_log, PreemptionGuard() as preemption:
            for step in range(start, t.total_steps):
                samples = t.log_samples if t.log_samples_every and (step + 1) % t.log_samples_every == 0 else 0
                roles_ = {"actor": actor, "critic": critic, "reference": reference, "rollout": rollout, "teacher": teacher}
                train = functools.partial(train_on_batch, cfg, step, **roles_)
                m = pipeline.step(step, functools.partial(train, samples=samples))
                flat = m["frac_reward_zero_std"] == 1.0 and not cfg.distill.enabled  # a teacher still moves the policy
                if ADVANTAGE_ESTIMATORS[cfg.algo.advantage].groups and flat and not no_signal_warned:
                    no_signal_warned = True  # once per run: a sparse reward can stay flat for many steps
                    warn([no_signal_warning(step + 1, cfg.algo.n_samples, cfg.actor.entropy_coef, cfg.actor.kl_coef)], rank0)
                if samples:
                    run_log.log_samples(step + 1, m.pop("samples"))
                rewards.append(m["reward"])
                if (t.val_every and (step + 1) % t.val_every == 0) or step + 1 == t.total_steps:
                    score = validate(source, producer, rollout, cfg.data.batch_size * cfg.algo.n_samples, cfg.rollout.seed)
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
                    save_roles(roles, ckpt_dir, step + 1, pipeline, source)
                signum = preemption.stop_requested()
                if signum is not None:
                    if not saved:
                        save_roles(roles, ckpt_dir, step + 1, pipeline, source)
                    raise Preempted(signum, step + 1, saved_at(ckpt_dir, roles, step + 1))
        hf_dir = None
        if t.save_hf:  # a signal during the export: it finishes, then the run stops with its state saved
            with PreemptionGuard() as late:
                hf_dir = placed.save_hf(os.path.join(t.output_dir, "hf"), t.save_hf_format)
                signum = late.stop_requested()
            if signum is not None:
                if not ((t.checkpoint_every and t.total_steps % t.checkpoint_every == 0) or start >= t.total_steps):
                    save_roles(roles, ckpt_dir, t.total_steps, pipeline, source)
                raise Preempted(signum, t.total_steps, saved_at(ckpt_dir, roles, t.total_steps))
    finally:
        if bar is not None:
            bar.close()
        placed.close()
        producer.close()  # e.g. the tool worker processes of multi-turn runs
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


def train_on_batch(
    cfg: PPOConfig,
    step: int,
    scored: ScoredBatch,
    timings: dict[str, float],
    *,
    actor,
    critic,
    reference,
    rollout,
    samples: int = 0,
    teacher=None,
) -> dict[str, Any]:
    """The training half of a step: prepare the producer's scored batch (old, reference and
    value log-probs; the ``algo.advantage`` estimator's advantages over its trajectories) and update, return the
    step's metrics; ``timings`` holds the sampling's seconds (``rollout_s``) and gets the rest.
    GRPO groups are over trajectories (``n_samples`` of one prompt); a trajectory split into
    several rows gives each of them its advantage (PPO: its reward at each row's last sampled
    token). ``samples`` > 0 adds ``"samples"``: that many trajectories' text rows. With a
    ``teacher`` (on-policy distillation, ``posttrain.distill``) the advantages get the per-token
    reverse KL to it, and the old-policy log-probs always come from their own forward. With a
    ``reward.model`` the scores arrive combined (``filling``) and the metrics of both parts are
    added (``roles.reward_model.reward_metrics``)."""
    n = cfg.algo.n_samples
    batch, scores, row_traj = scored.batch, scored.scores, scored.traj_of_row
    learned = reward_metrics(scored.parts["function"], scored.parts["model"]) if "model" in scored.parts else {}
    lengths = batch["input_ids"].offsets().diff()
    timings["reward_s"] = scored.reward_s
    t0 = time.perf_counter()
    # One update epoch over one mini-batch of a dense, dropout-free policy: the old-policy
    # log-probs are the update's own forward's (Actor.reuses_update_log_probs), one forward saved.
    reuse = actor.reuses_update_log_probs(len(lengths)) and teacher is None
    routing_metrics: dict[str, float] = {}
    if not reuse:
        old = actor.compute_log_probs(batch, calculate_entropy=True)
        attach(batch, old_log_probs=old["log_probs"].values())
        routing, routing_metrics = routing_for_update(cfg.actor, batch, old)  # MoE: what the update replays or is measured against
        if routing is not None:
            batch.set(ROUTING_FIELD, routing)
    if reference is not None:
        attach(batch, ref_log_probs=reference.compute_log_probs(batch)["log_probs"].values())
    mask = batch["loss_mask"].values()
    values = None if critic is None else critic.compute_values(batch)["values"].values() * mask
    inputs = AdvantageInputs(scores, scored.group_ids(n), row_traj, mask, batch["input_ids"].offsets(), values)
    settings = {"gamma": cfg.algo.gamma, "lam": cfg.algo.lam, "norm_by_std": cfg.algo.norm_by_std}
    adv, returns = estimate_advantages(cfg.algo.advantage, inputs, settings)
    distilled: dict[str, float] = {}
    actor_batch = batch
    if teacher is not None:
        taught = teacher.compute_log_probs(batch, topk=cfg.distill.topk)
        adv, distilled = distill_advantages(batch["old_log_probs"].values(), taught["log_probs"].values(), mask, adv, cfg.distill)
        if cfg.distill.topk:  # the student scores the teacher's candidates in its update (the critic never sees them)
            actor_batch = topk_batch(batch, taught, cfg.distill.topk_coef)
    if critic is not None:
        attach(batch, values=values, returns=returns)
    attach(batch, advantages=adv)
    if actor_batch is not batch:
        attach(actor_batch, advantages=adv)
    timings["prepare_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if reuse:
        actor_m, old = actor.update_on_policy(batch)
    else:
        actor_m = actor.update(actor_batch)
    critic_m = critic.update(batch) if critic is not None else []
    timings["update_s"] = time.perf_counter() - t0
    trainer_lp, rollout_lp = old["log_probs"].values(), batch["rollout_log_probs"].values()
    parity = rollout_parity(trainer_lp, rollout_lp, mask)
    for turn in scored.turn_indices():  # per turn index too: a shifted or re-encoded turn shows here
        per_turn = rollout_parity(trainer_lp, rollout_lp, mask * (scored.turns == turn))
        parity[f"rollout/logprob_abs_diff_max/turn_{turn}"] = per_turn["rollout/logprob_abs_diff_max"]
    parity.update(scored.metrics)
    parity.update(routing_metrics)
    parity["rollout/weight_version_lag"] = float(step + 1 - int(batch["rollout_weight_version"].min()))
    parity.update(rollout.last_sync)
    tokens = int(mask.sum())
    out = {
        "step": step + 1,
        "reward": float(scores.mean()),
        **group_reward_stats(scores, scored.group_ids(n)),
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
    out.update(distilled)
    out.update(learned)
    if "distill/topk_forward_kl" in actor_m[0]:
        out["distill/topk_forward_kl"] = _mean([m["distill/topk_forward_kl"] for m in actor_m])
    out.update({k: v for k, v in actor_m[0].items() if k.startswith("rollout_correction/")})
    out.update({k: _mean([m.get(k) for m in actor_m]) for k in actor_m[0] if k.startswith("moe/")})
    if "kl" in actor_m[0]:
        out["kl"] = _mean([m["kl"] for m in actor_m])
    if samples:
        out["samples"] = scored.sample_rows(samples, n)
    if critic_m:
        out["critic_loss"] = _mean([m["loss"] for m in critic_m])
        out["critic_grad_norm"] = _mean([m["grad_norm"] for m in critic_m])
        out["critic_skipped"] = _mean([m.get("step_skipped", 0.0) for m in critic_m])
    return out


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return float(sum(xs) / len(xs)) if xs else float("nan")


if __name__ == "__main__":
    quiet_console()
    run_cli(main)
