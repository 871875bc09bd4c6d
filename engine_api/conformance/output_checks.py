"""The conformance checks of what an engine computes and hands out, against an independent HF
forward of the same weights: log-probs (packed and padded), temperature and entropy, the value
head, the exported weights by their HF names, the model's dropout in train mode only, and
``unshard_data`` giving the ranks' rows back in the global batch's order."""

from __future__ import annotations

import torch

from engine_api.conformance import fixtures as fx
from engine_api.conformance.checks import CheckFailed, Env, _local, check, dropout_model, max_diff, new_engine, weights


@check("hf_logprobs")
def hf_logprobs(env: Env) -> str:
    """Log-probs equal a per-sequence HF forward (packed + dynamic batching, padded + fixed micro-batches)."""
    hf = fx.hf_model(env.model_dir)
    worst = {}
    for name, extra in {
        "packed": ["max_token_len_per_micro_batch=16"],
        "padded": ["use_remove_padding=false", "micro_batch_size=3"],
    }.items():
        engine = new_engine(env, *extra)
        local = _local(engine)
        with engine.eval_mode():
            out = engine.infer_batch(local)
        if out is None:
            continue  # not an output rank (see BaseEngine.is_output_rank)
        want, _ = fx.hf_token_outputs(hf, local)
        worst[name] = max_diff(out["log_probs"], want)
        if worst[name] > 1e-5:
            raise CheckFailed(f"{name}: log-probs differ from HF by {worst[name]:.2e} (> 1e-5)")
    return ", ".join(f"{k} max|diff| {v:.1e}" for k, v in worst.items())


@check("temperature_entropy")
def temperature_entropy(env: Env) -> str:
    """Metadata temperature divides the logits, and calculate_entropy returns the entropy of those logits."""
    hf = fx.hf_model(env.model_dir)
    engine = new_engine(env)
    local = _local(engine, temperature=0.7, calculate_entropy=True)
    with engine.eval_mode():
        out = engine.infer_batch(local)
    if out is None:
        return "not an output rank"
    if "entropy" not in out.keys():
        raise CheckFailed("calculate_entropy=True returned no 'entropy'")
    want_lp, want_ent = fx.hf_token_outputs(hf, local, temperature=0.7)
    d_lp, d_ent = max_diff(out["log_probs"], want_lp), max_diff(out["entropy"], want_ent)
    if d_lp > 1e-5:
        raise CheckFailed(f"log-probs at temperature 0.7 differ from HF log_softmax(logits / 0.7) by {d_lp:.2e} (> 1e-5)")
    if d_ent > 1e-5:
        raise CheckFailed(f"entropy at temperature 0.7 differs from HF by {d_ent:.2e} (> 1e-5)")
    return f"log-probs max|diff| {d_lp:.1e}, entropy {d_ent:.1e}"


@check("value_head")
def value_head(env: Env) -> str:
    """model.head=value gives per-token values equal to HF token classification (head seeded by
    engine.seed); with model.value_bias=false the head has no bias (HF sequence classification's:
    no ``score.bias`` among the exported weights) and the same values (HF's bias starts at 0)."""
    engine = new_engine(env, "model.head=value", skip_on="head")
    local = _local(engine)
    with engine.eval_mode():
        out = engine.infer_batch(local)
    if out is not None:
        want = fx.hf_values(fx.hf_model(env.model_dir, "value", seed=engine.config.seed), local)
        d = max_diff(out["values"], want)
        if d > 1e-5:
            raise CheckFailed(f"values differ from HF token classification by {d:.2e} (> 1e-5)")
    del engine
    bias_free = new_engine(env, "model.head=value", "model.value_bias=false")
    names = set(weights(bias_free))
    if "score.bias" in names or "score.weight" not in names:
        raise CheckFailed(
            f"model.value_bias=false: the exported value head is {sorted(n for n in names if n.startswith('score'))}, not "
            "['score.weight'] (a bias the loss cannot train would make an exported reward model score otherwise); fix: build "
            "the head without a bias"
        )
    with bias_free.eval_mode():
        free = bias_free.infer_batch(_local(bias_free))
    if out is None:
        return "not an output rank"
    d_free = max_diff(free["values"], want)
    if d_free > 1e-5:
        raise CheckFailed(f"model.value_bias=false: values differ from HF (bias 0) by {d_free:.2e} (> 1e-5)")
    return f"max|diff| {d:.1e}; bias-free head {d_free:.1e}"


@check("export_names")
def export_names(env: Env) -> str:
    """export_weights yields every HF tensor by its HF name, equal to the HF checkpoint before
    training; with ``bucket_mb`` (a transfer hint) the same tensors in the same order."""
    engine = new_engine(env)
    got = weights(engine)
    want = fx.hf_model(env.model_dir).state_dict()
    if set(got) != set(want):
        raise CheckFailed(f"names differ: missing {sorted(set(want) - set(got))[:5]}, extra {sorted(set(got) - set(want))[:5]}")
    bad = [k for k in want if got[k].shape != want[k].shape or not torch.equal(got[k].float(), want[k].float())]
    if bad:
        raise CheckFailed(f"{len(bad)} tensors differ from the HF checkpoint, e.g. {bad[:3]}")
    # A bucket far smaller than the model: several buckets, and tensors larger than one.
    bucketed = [(k, v.detach().clone().cpu()) for k, v in engine.export_weights(bucket_mb=0.01)]
    if [k for k, _ in bucketed] != list(got):
        raise CheckFailed("export_weights(bucket_mb=0.01) yields other names or another order than export_weights()")
    differ = [k for k, v in bucketed if v.dtype != got[k].dtype or v.shape != got[k].shape or not torch.equal(v, got[k])]
    if differ:
        raise CheckFailed(f"export_weights(bucket_mb=0.01) differs from export_weights() in {len(differ)} tensors, e.g. {differ[:3]}")
    return f"{len(got)} tensors, bit-exact; bucketed export identical"


@check("dropout")
def dropout(env: Env) -> str:
    """A model whose HF config sets attention_dropout applies it in train mode (two forwards of one batch differ) and not in eval mode (equals HF)."""
    engine = new_engine(env, f"model.path={dropout_model(env)}")
    local = _local(engine)
    with engine.train_mode():
        losses = []
        for _ in range(2):
            engine.optimizer_zero_grad()
            losses.append(engine.forward_backward_step(local)[1])
        engine.optimizer_zero_grad()  # abort: nothing is stepped
    if losses[0] == losses[1]:
        raise CheckFailed(
            f"attention_dropout={fx.DROPOUT} has no effect in train mode: two training forwards of one batch give loss {losses[0]!r} "
            "both times; fix: build the model with the HF config's dropout (the resume check relies on it to compare RNG state)"
        )
    with engine.eval_mode():
        out = engine.infer_batch(local)
    if out is not None:
        d = max_diff(out["log_probs"], fx.hf_token_outputs(fx.hf_model(dropout_model(env)), local)[0])
        if d > 1e-5:
            raise CheckFailed(f"eval-mode log-probs of the dropout model differ from HF by {d:.2e} (> 1e-5): dropout applied in eval mode?")
    return f"train losses {losses[0]:.6f} vs {losses[1]:.6f}; eval equals HF"


@check("unshard_order")
def unshard_order(env: Env) -> str:
    """unshard_data gives back the global batch's rows in their original order on every rank: the gathered log-probs equal HF's per sequence, row by row."""
    engine = new_engine(env)
    batch = fx.make_test_batch()
    with engine.eval_mode():
        out = engine.infer_batch(engine.shard_data(batch))
    gathered = engine.unshard_data(out) if out is not None else None
    if gathered is None:
        return "not an output rank"
    if gathered.batch_size[0] != batch.batch_size[0]:
        raise CheckFailed(f"unshard_data gave {gathered.batch_size[0]} rows for a batch of {batch.batch_size[0]}")
    lengths = [int(n) for n in gathered["log_probs"].offsets().diff()]
    if lengths != [int(n) for n in batch["input_ids"].offsets().diff()]:
        raise CheckFailed(
            f"unshard_data gave rows of lengths {lengths}, the batch's are {batch['input_ids'].offsets().diff().tolist()}: rows out of order"
        )
    want, _ = fx.hf_token_outputs(fx.hf_model(env.model_dir), batch)
    worst = max_diff(gathered["log_probs"], want)
    if worst > 1e-5:
        raise CheckFailed(f"the gathered log-probs differ from HF's for the same rows by {worst:.2e}: rows out of order or lost")
    return f"{batch.batch_size[0]} rows in order over {env.world} rank(s), max|diff| {worst:.1e}"
