"""The conformance checks of LoRA and of several runs on one engine: adapters trained exactly as
peft + torch AdamW train them, the base model with the adapters off, peft's merge as the
export; and ``run_state`` / ``load_run_state`` letting two runs take turns on one engine, each
bit for bit as alone (with LoRA where the backend supports it, else on the full weights)."""

from __future__ import annotations

import torch

from engine_api.conformance import fixtures as fx
from engine_api.conformance.checks import CheckFailed, Env, Skipped, _local, check, max_diff, new_engine, same, weights, window
from engine_api.conformance.update_checks import target_steps


@check("lora")
def lora(env: Env) -> str:
    """model.lora: refused unless the backend declares supports_lora; else two steps (per-step AdamW settings, the second in two calls) train the adapters as peft + torch AdamW do, adapters off == HF, on == peft, merged export == peft's merge."""
    from engine_api import build_engine, load_config
    from engine_api.registry import get_engine_class

    settings = ["model.lora.rank=4", "model.lora.alpha=8"]
    if not get_engine_class(env.strategy).supports_lora:
        config = load_config(None, [*fx.engine_overrides(env.strategy, env.model_dir), *env.overrides, *settings])
        try:
            build_engine(config)
        except ValueError as exc:
            if "model.lora.rank" in str(exc):
                return "refused at build_engine (the backend does not declare supports_lora)"
            raise
        raise CheckFailed("build_engine accepted model.lora.rank=4 on a backend that does not declare supports_lora")
    import peft

    engine = new_engine(env, *settings, "max_token_len_per_micro_batch=16", mode="sum")
    base = fx.hf_model(env.model_dir)
    untouched = weights(engine)
    trained = _lora_steps(env, engine)  # lora_B leaves its zero init: adapters on and off differ
    adapters = _adapters(engine)
    merged = weights(engine)
    off = _local(engine, seed=1, disable_adapters=True)
    on = _local(engine, seed=1)
    with engine.eval_mode():
        out_off, out_on = engine.infer_batch(off), engine.infer_batch(on)
    wrapped = peft.get_peft_model(fx.hf_model(env.model_dir), peft.LoraConfig(r=4, lora_alpha=8, target_modules=fx.peft_targets(adapters)))
    if peft.set_peft_model_state_dict(wrapped, adapters).unexpected_keys:
        raise CheckFailed("export_adapter_weights names are not peft's adapter names")
    wrapped.eval()
    if out_on is not None:
        d_off = max_diff(out_off["log_probs"], fx.hf_token_outputs(base, off)[0])
        d_on = max_diff(out_on["log_probs"], fx.hf_token_outputs(wrapped, on)[0])
        if d_off > 1e-5 or d_on > 1e-5:
            raise CheckFailed(f"log-probs: adapters off vs HF base {d_off:.2e}, adapters on vs peft {d_on:.2e} (> 1e-5)")
    want = wrapped.merge_and_unload().state_dict()
    if set(merged) != set(want):
        raise CheckFailed(f"merged export names differ from HF's: {sorted(set(merged) ^ set(want))[:4]}")
    err = fx.rel(merged, want)
    if err > 1e-6:
        raise CheckFailed(f"merged export differs from peft's merge_and_unload by {err:.2e} relative")
    if not any(not torch.equal(merged[k], untouched[k]) for k in want):
        raise CheckFailed("the step changed nothing")
    return f"{len(adapters)} adapter tensors; {trained}; merged export rel {err:.1e}"


@check("run_swap")
def run_swap(env: Env) -> str:
    """run_state / load_run_state: two runs taking turns on one engine (with LoRA when the backend supports it: the second's adapters drawn for another seed by reset_adapters), one swapped out with gradients pending, each give bit for bit the losses, grad norms and weights of a fresh engine serving that run alone; a state of another layout is refused, changing nothing."""
    from engine_api.registry import get_engine_class

    settings = ("model.lora.rank=4", "model.lora.alpha=8") if get_engine_class(env.strategy).supports_lora else ()

    def read(engine) -> dict[str, torch.Tensor]:
        return _adapters(engine) if settings else weights(engine)

    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return float(x) if isinstance(x, torch.Tensor) else x

    def pending(engine, batch) -> float:
        with engine.train_mode():
            return float(engine.forward_backward_step(batch)[1])

    def finish(engine) -> float:
        with engine.train_mode():
            norm = engine.optimizer_step()
            engine.optimizer_zero_grad()
        return norm

    shared = new_engine(env, *settings, mode="sum")
    a, b = _local(shared, seed=1), _local(shared, seed=2)
    fresh = shared.run_state()
    # Run A: a step, then a forward_backward whose gradients are pending when B takes over.
    got_a = [window(shared, a), pending(shared, a)]
    state_a = shared.run_state()
    shared.load_run_state(fresh)
    if settings:  # run B starts from the adapters an engine built with seed 7 draws
        shared.reset_adapters(7)
    got_b = [window(shared, b), window(shared, b)]
    state_b = shared.run_state()
    shared.load_run_state(state_a)
    got_a += [finish(shared), window(shared, a)]
    weights_a = read(shared)
    shared.load_run_state(state_b)
    got_b.append(window(shared, b))
    weights_b = read(shared)
    for name, got, want_weights, calls in (
        ("run A", got_a, weights_a, lambda e: [window(e, a), pending(e, a), finish(e), window(e, a)]),
        ("run B", got_b, weights_b, lambda e: [window(e, b), window(e, b), window(e, b)]),
    ):
        alone = new_engine(env, *settings, *(("seed=7",) if settings and name == "run B" else ()), mode="sum")
        want = calls(alone)
        got, want = plain(got), plain(want)
        if got != want:
            raise CheckFailed(f"{name} interleaved with the other on one engine: {got} != alone: {want}")
        same(f"{name}'s weights after its calls (interleaved vs alone)", {"w": want_weights}, {"w": read(alone)})
        del alone
    other = new_engine(env, "model.lora.rank=2", "model.lora.alpha=8", mode="sum") if settings else None
    if other is not None:
        before = read(other)
        try:
            other.load_run_state(state_a)
        except ValueError:
            same("a refused load_run_state", {"w": read(other)}, {"w": before})
        else:
            raise CheckFailed("load_run_state took a rank-4 run's state into a rank-2 engine")
    what = "adapters; the second drawn for seed 7 by reset_adapters" if settings else "full weights"
    return f"2 runs interleaved == each alone, bit for bit ({what}); another layout refused"


def _lora_steps(env: Env, engine) -> str:
    """:func:`~engine_api.conformance.update_checks.target_steps` on a LoRA engine (rank 4, alpha 8) against peft + torch AdamW from
    the engine's initial adapters: the second step is the first in which ``lora_A`` gets a
    gradient (``lora_B`` starts at zero). A layout that refuses ``target_ids`` takes one step of
    the kit's loss instead, with no reference (said so)."""
    before = _adapters(engine)
    try:
        worst = target_steps(
            env,
            engine,
            lambda seeds: fx.reference_target_steps(env.model_dir, seeds, lora=(before, 4, 8.0)),
            lambda: _adapters(engine),
            "adapters",
        )
    except Skipped as why:
        engine.set_loss_fn(fx.loss_fn)
        window(engine, _local(engine))
        return f"one step of the kit's loss ({why})"
    return f"2 steps == peft + AdamW (worst {worst:.1e})"


def _adapters(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().cpu() for k, v in engine.export_adapter_weights()}
