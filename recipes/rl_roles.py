"""What an RL run's roles are and how its rollout role is built: shared by the recipe
(``recipes.ppo``, every role in this process) and its Ray workers (``recipes.ppo_ray``)."""

from __future__ import annotations

from engine_api.rollout import RolloutEngineConfig
from engine_api.rollout_registry import build_rollout, get_rollout_class
from posttrain.placement import placement_problems
from roles.rollout import Rollout


def rl_roles(cfg) -> tuple[str, ...]:
    """The roles of an RL run, the actor first."""
    return ("actor", *(("reference",) if cfg.actor.kl_coef else ()), *(("critic",) if cfg.algo.advantage == "gae" else ()), "rollout")


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
