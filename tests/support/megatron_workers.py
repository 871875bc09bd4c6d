"""Work the megatron tests run in spawned processes.

megatron's parallel state and the CPU compat layer are process-global, so megatron never runs
in the pytest process: each worker below runs in fresh ranks (tests.support.launch) and returns
plain tensors/numbers that the tests compare with references computed in the parent.
"""

from __future__ import annotations

import os

import torch

from tests.support import hf_utils
from tests.support.hf_utils import engine_for, full_params, make_test_batch

MODES, VARIANTS = hf_utils.MODES, hf_utils.VARIANTS
LAYOUTS = {
    "tp2": ["megatron.tensor_model_parallel_size=2"],
    "pp2": ["megatron.pipeline_model_parallel_size=2"],
    "dp2": [],
    "dp2-distopt": ["megatron.use_distributed_optimizer=true"],
}

# Where megatron-core 0.16 hard-codes CUDA on the paths the engine uses (file, function), as the
# compat layer records them; checked by test_megatron.py and, plus the MoE path's own sites, by
# test_megatron_moe.py. A new entry means a megatron-core upgrade added one: review it, then
# extend the list.
KNOWN_CUDA_SITES = {
    ("clip_grads.py", "get_grad_norm_fp32"),
    ("clip_grads.py", "clip_grad_by_total_norm_fp32"),
    ("optimizer.py", "__init__"),
    ("param_and_grad_buffer.py", "__init__"),
    ("random.py", "add"),
    ("random.py", "fork"),
    ("random.py", "model_parallel_cuda_manual_seed"),
    ("random.py", "get_states"),
    ("random.py", "set_states"),
    ("rotary_pos_embedding.py", "get_emb"),
    ("schedules.py", "forward_backward_no_pipelining"),
    ("schedules.py", "forward_backward_pipelining_without_interleaving"),
    ("utils.py", "get_default_causal_mask"),
    ("utils.py", "get_tensor"),
    ("utils.py", "local_multi_tensor_l2_norm"),
    ("utils.py", "local_multi_tensor_scale"),
    ("p2p_communication.py", "_communicate"),
    ("p2p_communication.py", "_communicate_shapes"),
    ("distrib_optimizer.py", "__init__"),
    ("mappings.py", "_gather_along_first_dim"),
    # dist_checkpointing save: staging tensors for the writer and the final all-reduce of results.
    ("filesystem_async.py", "preload_tensors"),
    ("state_dict_saver.py", "save_state_dict_async_finalize"),
}


def reset_parallel_state() -> None:
    """Tear megatron's global parallel state down so the next engine can use another layout."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def infer(model_dir, *overrides, batch=None, **meta):
    engine = engine_for(model_dir, *overrides, strategy="megatron")
    batch = make_test_batch(**meta) if batch is None else batch
    with engine.eval_mode():
        return engine.unshard_data(engine.infer_batch(engine.shard_data(batch)))


def one_step(model_dir, mode, extra, calls=1, batch_fn=make_test_batch):
    """``hf_utils.one_step`` on the megatron engine."""
    return hf_utils.one_step(model_dir, mode, extra, calls, strategy="megatron", batch_fn=batch_fn)


def single_process(rank, world, models, value_dir, ckpt_dir):
    """Everything the single-process megatron tests need."""
    from backends.megatron import cpu_compat

    # Only this task's call sites: a long-lived world keeps the counter across tasks, and an
    # earlier test's path (e.g. activation recompute's RNG forks) is not this test's subject.
    cpu_compat.SITES.clear()
    out = {}
    for family, path in models.items():
        for packed in (True, False):
            preds = infer(path, f"use_remove_padding={packed}", "micro_batch_size=2", calculate_entropy=True)
            out[("log_probs", family, packed)] = preds["log_probs"]
            out[("entropy", family, packed)] = preds["entropy"]
        out[("export", family)] = full_params(engine_for(path, strategy="megatron"))
        out[("hot", family)] = infer(path, temperature=2.0)["log_probs"]
    out["values"] = infer(value_dir, "model.head=value", "seed=7")["values"]
    out["value_resume"] = _value_head_resume(value_dir, os.path.join(ckpt_dir, "value"))
    # Micro-batching / split-call invariance, resume, the non-finite skip and bad batches are
    # the conformance kit's (tests/conformance/test_kit.py); here: the cross-backend step.
    for mode in MODES:
        out[("step", mode, "all")] = one_step(models["llama"], mode, [], 1)
    out["offload"] = _offload_round_trips(models["llama"])
    out["bad_batch"] = _bad_batch(models["llama"])
    out["frozen"] = _frozen(models["llama"])
    out["pad_step"] = one_step(models["llama_pad"], "token-mean", [], batch_fn=hf_utils.make_pad_batch)
    out["sites"] = dict(cpu_compat.SITES)
    out["compat_active"] = cpu_compat.is_active()
    return out


def _value_head_resume(model_dir, ckpt_dir):
    """A critic (``model.head=value``): one step, a checkpoint, a fresh engine loading it. Its
    values and exported weights (HF's ``score`` included) after the load, and the trained one's."""
    from engine_api import agg_loss

    def value_loss(mb, out, norm):
        return agg_loss((out["values"].values() - 1.0) ** 2, mb["loss_mask"], norm), {}

    def values(engine):
        with engine.eval_mode():
            return engine.infer_batch(make_test_batch())["values"]

    trained = engine_for(model_dir, "model.head=value", "seed=7", strategy="megatron")
    trained.set_loss_fn(value_loss)
    with trained.train_mode():
        trained.train_batch(make_test_batch(seed=1))
    trained.save_checkpoint(ckpt_dir, global_step=1)
    fresh = engine_for(model_dir, "model.head=value", "seed=7", strategy="megatron")
    before = values(fresh)
    step = fresh.load_checkpoint(ckpt_dir)
    return {"step": step, "trained": values(trained), "before": before, "loaded": values(fresh),
            "trained_export": full_params(trained), "loaded_export": full_params(fresh)}  # fmt: skip


def _offload_round_trips(model_dir):
    """Offload on: after eval_mode exits no param / grad / optimizer storage holds memory; two
    train/eval rounds give bit-identical params to a run without offload."""
    results, freed = [], None
    for offload in (False, True):
        flags = [f"offload.param={offload}", f"offload.optimizer={offload}"]
        engine = engine_for(model_dir, *flags, strategy="megatron")
        for seed in range(2):
            with engine.train_mode():
                engine.train_batch(make_test_batch(seed=seed))
            with engine.eval_mode():
                engine.infer_batch(make_test_batch())
        if offload:
            tensors = [*engine._model_tensors(), *engine._optimizer_tensors()]
            freed = {
                "all_freed": all(t.untyped_storage().nbytes() == 0 for t in tensors),
                "host_bytes": engine._offloaders["model"].offloaded_bytes + engine._offloaders["optimizer"].offloaded_bytes,
                "placement": {k: str(v) for k, v in engine.placement.items()},
            }
        results.append(full_params(engine))
    same = all(torch.equal(results[0][k], results[1][k]) for k in results[0])
    return {**freed, "same_training": same}


def _frozen(model_dir):
    engine = engine_for(model_dir, "frozen=true", strategy="megatron")
    with engine.eval_mode():
        log_probs = engine.infer_batch(make_test_batch())["log_probs"]
    try:
        engine.optimizer_step()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    grad_numel = sum(b.grad_data.numel() for chunk in engine.model for b in chunk.buffers)
    return {"log_probs": log_probs, "error": error, "optimizer": engine.optimizer, "grad_numel": grad_numel}


def _bad_batch(model_dir):
    from engine_api import make_batch

    engine = engine_for(model_dir, strategy="megatron")
    before = full_params(engine)
    try:
        with engine.train_mode():
            engine.train_batch(make_batch([torch.tensor([1, 2, 64])]))
        error = None
    except ValueError as exc:
        error = str(exc)
    after = full_params(engine)
    return {"error": error, "unchanged": all(torch.equal(after[k], v) for k, v in before.items()), "global_step": engine.global_step}


def two_process_layouts(rank, world, models, ckpt_dir):
    """TP=2, PP=2, DP=2 (plain and distributed optimizer) on 2 ranks."""
    out = {}
    for layout, extra in LAYOUTS.items():
        for family, path in ((f, p) for f, p in models.items() if f != "llama4"):
            out[("log_probs", layout, family)] = infer(path, "micro_batch_size=2", *extra)["log_probs"]
            reset_parallel_state()
        for mode in MODES:
            # Variants within a layout are the conformance kit's; here: the cross-backend step.
            variant = "all" if layout in ("tp2", "pp2") else "mbs=1"
            out[("step", layout, mode, variant)] = one_step(models["llama"], mode, [*extra, *VARIANTS[variant][0]], 1)
            reset_parallel_state()
    # Interleaved 1F1B: 2 stages x 2 virtual chunks of a 4-layer model. 6 micro-batches exercise
    # the steady state's two-way exchange (where batched p2p crossed activations and gradients);
    # the interleaved schedule needs the micro-batch count to be a multiple of the stage count.
    out[("log_probs", "vpp")] = infer(models["llama4"], "micro_batch_size=1", *VPP)["log_probs"]
    reset_parallel_state()
    for mode in MODES:
        for variant in ("mbs=1", "mbs=3"):
            out[("step", "vpp", mode, variant)] = one_step(models["llama4"], mode, [*VPP, f"micro_batch_size={variant[-1]}"])
            reset_parallel_state()
    return out


VPP = ["megatron.pipeline_model_parallel_size=2", "megatron.virtual_pipeline_model_parallel_size=2"]


def four_process_layout(rank, world, model_dir):
    """TP=2 x DP=2 with the distributed optimizer on 4 ranks."""
    layout = ["megatron.tensor_model_parallel_size=2", "megatron.use_distributed_optimizer=true"]
    out = {"log_probs": infer(model_dir, "micro_batch_size=1", *layout)["log_probs"]}
    for mode in MODES:
        out[("step", mode)] = one_step(model_dir, mode, [*layout, "micro_batch_size=1"])
        out[("split", mode)] = one_step(model_dir, mode, [*layout, "deferred_normalization=true"], calls=3)
    return out
