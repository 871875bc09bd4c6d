"""An RL run's roles and how they are built and placed: what the RL recipe (``recipes.ppo``,
every role in this process) and its Ray workers (``posttrain.placement.rl_host``) share.

* which roles a run has (:func:`rl_roles`) and whether its placement can hold them;
* the rollout engine's settings, the rollout role (:func:`build_rollout_role`) and what the
  rollout backend refuses about the user's model from its files, before any engine;
* :func:`fit_rollout_to_machine`: the backend's own needs on this machine applied to the config
  (``BaseRollout.fit_to_machine``: vLLM on a CPU samples in float32 with heads of >= 32);
* :func:`resume_roles`: the newest step every role checkpointed completely and that verifies.

``posttrain.placement.rl_host.place_roles`` places the roles (this process, or Ray).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from engine_api import ckpt_layout
from engine_api.rollout import RolloutEngineConfig
from engine_api.rollout_registry import build_rollout, get_rollout_class
from posttrain.data_order import save_order
from posttrain.dist import rank
from posttrain.placement import placement_problems
from posttrain.trainer_utils import load_newest_valid, warn
from roles.advantages import needs_critic
from roles.rollout import Rollout


def rl_roles(cfg) -> tuple[str, ...]:
    """The roles of an RL run, the actor first."""
    teacher = ("teacher",) if cfg.distill.enabled else ()
    return (
        "actor",
        *(("reference",) if cfg.actor.kl_coef else ()),
        *(("critic",) if needs_critic(cfg.algo.advantage) else ()),
        *teacher,
        *(("reward_model",) if cfg.reward.model is not None else ()),
        "rollout",
    )


def rl_placement_problems(cfg) -> list[str]:
    """``trainer.placement`` checked against this run's roles (before Ray starts)."""
    shared = {"reference": "actor"} if cfg.engine.model.lora.enabled else {}
    return placement_problems(cfg.trainer.placement, rl_roles(cfg), shared)


def rollout_engine_config(cfg, tokenizer: bool) -> RolloutEngineConfig:
    """The rollout engine's settings of an RL config (``tokenizer``: the data has one, so the
    engine decodes stop strings with the model directory's)."""
    r, lora = cfg.rollout, cfg.engine.model.lora
    return RolloutEngineConfig(
        model_path=cfg.engine.model.path,
        tokenizer_path=cfg.engine.model.path if tokenizer else None,
        seed=r.seed,
        max_model_len=r.max_model_len,
        dtype=r.dtype,
        lora_rank=lora.rank if lora.enabled and r.lora_sync != "merged" else 0,
        options=dict(r.options),
        return_routing=cfg.actor.router_replay == "r3",  # the routing the trainer replays
    )


def _budget_problem(cfg, limit: int | None) -> str | None:
    r = cfg.rollout
    env = getattr(cfg, "env", None)
    if env is not None and env.enabled and limit is not None and env.max_tokens > limit:
        return (
            f"env.max_tokens = {env.max_tokens} > the rollout engine's max_model_len {limit}: a trajectory could outgrow the "
            "engine mid-run; fix: lower env.max_tokens, or raise rollout.max_model_len (within the model's context)"
        )
    if cfg.data.from_files and limit is not None and cfg.data.max_prompt_length + r.max_new_tokens > limit:
        return (
            f"data.max_prompt_length = {cfg.data.max_prompt_length} + a response of {r.max_new_tokens} tokens > the rollout engine's "
            f"max_model_len {limit}; fix: lower data.max_prompt_length (data.overlong decides what happens to longer prompts) or "
            "data.max_response_length, or raise rollout.max_model_len"
        )
    return None


def rollout_model_problems(cfg) -> list[str]:
    """What the rollout backend refuses about the user's model (``engine.model.path``), from its
    files alone: the backend's own ``model_problems`` and the prompt + response budget against
    the ``max_model_len`` it will have. Checked at load, before the data and any engine (the
    built tiny model is fitted to the backend instead: ``recipes.ppo``)."""
    if cfg.engine.model.path is None:
        return []
    cls = get_rollout_class(cfg.rollout.backend)
    config = rollout_engine_config(cfg, tokenizer=False)
    limit = cls.expected_max_model_len(config)
    budget = _budget_problem(cfg, limit)
    if budget is None and limit is None:
        budget = _positions_problem(cfg)
    return [*cls.model_problems(config), *([budget] if budget else [])]


def _positions_problem(cfg) -> str | None:
    """A trajectory budget (``env.max_tokens``) past the model's own context, for a rollout
    backend that states no limit of its own (``hf`` runs past ``max_position_embeddings``
    without an error, RoPE extrapolating into positions the model never learned): refused from
    ``config.json`` (a model with RoPE scaling states its longer context otherwise: not refused)."""
    import json
    import os

    env = getattr(cfg, "env", None)
    if env is None or not env.enabled:
        return None
    try:
        with open(os.path.join(cfg.engine.model.path, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return None  # the engine's own load names an unreadable model directory
    positions = hf.get("max_position_embeddings")
    if hf.get("rope_scaling") or isinstance(positions, bool) or not isinstance(positions, int) or env.max_tokens <= positions:
        return None
    return (
        f"env.max_tokens = {env.max_tokens} > the model's max_position_embeddings {positions} ({cfg.engine.model.path}/config.json): "
        "a trajectory could run past the context the model was trained on; fix: lower env.max_tokens to at most "
        f"{positions}, or use a model with a longer context"
    )


def build_rollout_role(cfg, actor, source) -> Rollout:
    """This rank's rollout engine (``rollout.backend``) wrapped in the ``Rollout`` role, synced
    from ``actor``; refuses a prompt + response budget the engine cannot hold before any step."""
    r, lora = cfg.rollout, cfg.engine.model.lora
    engine = build_rollout(r.backend, rollout_engine_config(cfg, tokenizer=source.tokenizer is not None))
    budget = _budget_problem(cfg, engine.max_model_len)  # the built engine's own limit: the authority
    if budget is not None:
        engine.shutdown()
        raise ValueError(budget)
    lora_settings = {"r": lora.rank, "lora_alpha": lora.alpha} if lora.enabled else None
    return Rollout(actor, engine, r, stop_token_ids=source.stop_ids or (), stop=r.stop_strings, lora=lora_settings)


def fit_rollout_to_machine(cfg, rank0: bool):
    """``cfg`` with what its rollout backend needs on this machine (``BaseRollout.fit_to_machine``):
    the rollout's dtype (e.g. vLLM without CUDA: float32, with a one-line warning naming the key)
    and the built tiny model's head width (no ``engine.model.path``, no ``tiny_model.head_dim``).
    A Ray run keeps its dtype (its workers may have GPUs the driver does not see); every other
    setting is left alone. Works for any RL config (``rollout``, ``tiny_model``, ``engine``,
    ``trainer``)."""
    r, tm = cfg.rollout, cfg.tiny_model
    dtype, head, why = get_rollout_class(r.backend).fit_to_machine(r.dtype, torch.cuda.is_available())
    if dtype != r.dtype and cfg.trainer.launcher != "ray":
        warn([why], rank0)
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(r, dtype=dtype))
    if head and cfg.engine.model.path is None and tm.head_dim is None and tm.hidden_size // tm.num_heads < head:
        cfg = dataclasses.replace(cfg, tiny_model=dataclasses.replace(tm, head_dim=head))
    return cfg


def resume_roles(roles: dict[str, Any], ckpt_dir: str, rank0: bool) -> int:
    """Load the newest step that every role (``{"actor": ..., "critic": ...}``, each checkpointed
    under ``ckpt_dir/<name>``) checkpointed completely and that verifies for every role; 0 when
    the actor has no checkpoint (a fresh run). A save killed between the actor's and the critic's
    checkpoint leaves the actor a step ahead (the common step is loaded); a step that fails
    verification is skipped loudly (``posttrain.trainer_utils.load_newest_valid``).

    Raises:
        ValueError: the actor has checkpoints but no step is complete for every role of this
            run (a role's checkpoints are gone, or the run now has a critic the checkpoints
            never had): before anything is written.
    """
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


def save_roles(roles: dict, ckpt_dir: str, step: int, pipeline, source) -> None:
    """The data order and the asynchronous state first, then the roles: a complete role
    checkpoint has both (``posttrain.data_order``, ``posttrain.async_rl.state``)."""
    if rank() == 0:
        save_order(ckpt_dir, source.data_order())
    pipeline.save(ckpt_dir, step)
    for name, role in roles.items():
        role.save_checkpoint(os.path.join(ckpt_dir, name), global_step=step)
    pipeline.after_save(ckpt_dir, step, set(ckpt_layout.complete_steps(os.path.join(ckpt_dir, "actor"))))


def saved_at(ckpt_dir: str, roles: dict, step: int) -> str:
    """Where a stopped run's checkpoints of ``step`` are, for the message: the actor's, and the
    critic's only when there is one (GRPO has none)."""
    names = "{" + ",".join(roles) + "}" if len(roles) > 1 else next(iter(roles))
    return os.path.join(ckpt_dir, names, f"{ckpt_layout.PREFIX}{step}")
