"""The rollout conformance kit's checks (``engine_api.conformance.rollout_runner`` runs them): each
takes the shared :class:`~engine_api.conformance.rollout_kit.Kit` and returns a one-line detail,
or raises ``CheckFailed`` / ``Skipped``. Registered in run order with ``@rollout_check``."""

from __future__ import annotations

import dataclasses
import math

import torch

from engine_api.conformance.checks import CheckFailed, Skipped
from engine_api.conformance.rollout_kit import (
    CHUNK_MB,
    SEEDS,
    SELF_TOL,
    TOL,
    TOP1_TOL,
    TRAINER,
    VOCAB,
    Kit,
    expect_refusal,
    first_line,
    make_prompts,
    model_eos,
    rollout_check,
    sample_ids,
    still_serving,
    text,
    worst_gap,
)
from engine_api.rollout import SamplingParams, chunk_pairs


@rollout_check("logprobs")
def check_logprobs(kit: Kit) -> str:
    """Returned log-probs equal log_softmax(HF logits / T) at the sampled tokens (T 0.7 and 1.0); int64 ids, float32 log-probs of equal length."""
    parts = []
    for t in (0.7, 1.0):
        params = SamplingParams(n=2, temperature=t, max_tokens=10)
        out = kit.generate(kit.prompts, params, SEEDS)
        short = [(i, j, len(s.token_ids)) for i, g in enumerate(out) for j, s in enumerate(g) if len(s.token_ids) != params.max_tokens]
        if short:
            raise CheckFailed(
                f"T={t}: without stop ids every response has max_tokens = {params.max_tokens} tokens; (prompt, sample, length): {short[:3]}"
            )
        if any(s.finish_reason != "length" for g in out for s in g):
            raise CheckFailed(f"T={t}: a response cut at max_tokens must have finish_reason 'length'")
        worst = kit.compare(kit.prompts, out, t)
        if worst.diff > TOL:
            raise CheckFailed(f"T={t}: log-probs differ from HF log_softmax(logits / {t}) by {worst.diff:.2e} (> {TOL:g}) at {worst.where}")
        parts.append(f"T={t} max|diff| {worst} over {worst.tokens} tokens")
    return ", ".join(parts)


@rollout_check("prompt_logprobs")
def check_prompt_logprobs(kit: Kit) -> str:
    """prompt_log_probs scores every prompt token after the first, equal to HF log_softmax(logits) at it; skipped for a backend that offers no prompt scoring."""
    try:
        got = kit.engine.prompt_log_probs(kit.prompts)
    except NotImplementedError as exc:
        raise Skipped(f"the backend scores no prompts ({first_line(exc)})") from None
    kit._load(kit.expected)  # the HF reference holds the weights the engine serves
    worst = 0.0
    with torch.no_grad():
        for i, (prompt, lp) in enumerate(zip(kit.prompts, got, strict=True)):
            ids = torch.as_tensor(prompt).reshape(1, -1)
            want = torch.log_softmax(kit.hf(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            if lp.shape != want.shape:
                raise CheckFailed(f"prompt {i}: {tuple(lp.shape)} log-probs for a {ids.shape[1]}-token prompt (want {tuple(want.shape)})")
            worst = max(worst, float((lp - want).abs().max()) if want.numel() else 0.0)
    if worst > TOL:
        raise CheckFailed(f"prompt log-probs differ from HF log_softmax(logits) by {worst:.2e} (> {TOL:g})")
    return f"{len(got)} prompts, max|diff| {worst:.1e}"


@rollout_check("temperature")
def check_temperature(kit: Kit) -> str:
    """Sampling at T=0.7 and T=1.5 with the same seeds gives the log-probs of each T's reference (not those of T=1)."""
    parts = []
    for t in (0.7, 1.5):
        out = kit.generate(kit.prompts, SamplingParams(temperature=t, max_tokens=10), SEEDS)
        own, plain = kit.compare(kit.prompts, out, t), kit.compare(kit.prompts, out, 1.0)
        if own.diff > TOL:
            hint = f"; they are log_softmax(logits) at T=1 (|diff| {plain}): the temperature is ignored" if plain.diff <= TOL else ""
            raise CheckFailed(
                f"T={t}: log-probs differ from HF log_softmax(logits / {t}) by {own.diff:.2e} (> {TOL:g}) at {own.where}{hint}"
            )
        if plain.diff <= 100 * TOL:
            raise CheckFailed(f"T={t}: the kit cannot tell this temperature from 1 (reference gap {plain}); the fixture model is too flat")
        parts.append(f"T={t} max|diff| {own} (T=1 would be off by {plain})")
    return ", ".join(parts)


@rollout_check("top_k")
def check_top_k(kit: Kit) -> str:
    """top_k=1 at T=1 samples the HF argmax and reports log-prob 0 (processed log-probs renormalise over the kept set)."""
    out = kit.generate(kit.prompts, SamplingParams(n=2, top_k=1, max_tokens=8), SEEDS)
    worst_lp, worst_gap_ = 0.0, 0.0
    for i, group in enumerate(out):
        for j, s in enumerate(group):
            logits = kit.logits(kit.prompts[i], s)
            picked = logits.gather(-1, s.token_ids[:, None])[:, 0]
            gap = logits.max(-1).values - picked  # 0 where the token is the argmax (ties: within noise)
            k = int(gap.argmax())
            if float(gap[k]) > TOP1_TOL:
                raise CheckFailed(
                    f"prompt {i} sample {j} position {k}: top_k=1 sampled token {int(s.token_ids[k])}, the HF argmax is "
                    f"{int(logits[k].argmax())} (logit gap {float(gap[k]):.2e})"
                )
            lp = float(s.log_probs.abs().max())
            if lp > TOP1_TOL:
                raise CheckFailed(
                    f"prompt {i} sample {j}: log-probs {s.log_probs.tolist()} under top_k=1 must be 0 (the kept set is one token); "
                    "the contract reports processed (renormalised) log-probs"
                )
            worst_lp, worst_gap_ = max(worst_lp, lp), max(worst_gap_, float(gap[k]))
    return f"every token the argmax (logit gap <= {worst_gap_:.1e}), |log-prob| <= {worst_lp:.1e}"


@rollout_check("truncation")
def check_truncation(kit: Kit) -> str:
    """With top_k and/or top_p the log-probs are those of the kept set renormalised (processed log-probs), and every sampled token is in it."""
    parts = []
    for top_k, top_p, t in ((8, 1.0, 1.0), (-1, 0.6, 0.8), (12, 0.7, 1.2)):
        out = kit.generate(kit.prompts, SamplingParams(n=2, temperature=t, top_k=top_k, top_p=top_p, max_tokens=8), SEEDS)
        worst, skipped = 0.0, 0
        for i, group in enumerate(out):
            for j, s in enumerate(group):
                want, clear = processed_log_probs(kit.logits(kit.prompts[i], s) / t, top_k, top_p)
                want = want.gather(-1, s.token_ids[:, None])[:, 0]
                for k in range(len(want)):
                    if not clear[k]:
                        skipped += 1  # the kept set's edge is within float noise: either answer is right
                        continue
                    at = f"top_k={top_k} top_p={top_p} T={t}: prompt {i} sample {j} position {k} (token {int(s.token_ids[k])})"
                    if not math.isfinite(float(want[k])):
                        raise CheckFailed(f"{at}: sampled outside the kept set")
                    gap = abs(float(s.log_probs[k]) - float(want[k]))
                    if gap > TOL:
                        plain = float(torch.log_softmax(kit.logits(kit.prompts[i], s)[k] / t, -1)[s.token_ids[k]])
                        raise CheckFailed(
                            f"{at}: log-prob {float(s.log_probs[k]):.6f}, the kept set renormalised gives {float(want[k]):.6f} "
                            f"(|diff| {gap:.1e} > {TOL:g}; the whole-vocabulary log-prob would be {plain:.6f})"
                        )
                    worst = max(worst, gap)
        parts.append(f"top_k={top_k} top_p={top_p} max|diff| {worst:.1e}" + (f" ({skipped} edge tokens skipped)" if skipped else ""))
    return ", ".join(parts)


def processed_log_probs(scaled: torch.Tensor, top_k: int, top_p: float, edge: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax`` of ``scaled`` logits [R, V] over the ``top_k`` largest, then over the
    smallest most-likely prefix holding ``top_p`` of their mass (a token is kept while the mass
    before it is < top_p), renormalised; -inf outside. Also [R] bool: False where the set's edge
    is within ``edge`` (a tie at the k-th logit, or a prefix mass that close to top_p)."""
    z, clear = scaled.double(), torch.ones(len(scaled), dtype=torch.bool)
    if top_k != -1 and top_k < z.shape[-1]:
        top = z.topk(top_k + 1, dim=-1).values
        clear &= (top[:, -2] - top[:, -1]) > edge
        z = z.masked_fill(z < top[:, -2:-1], float("-inf"))
    if top_p < 1.0:
        p, order = torch.softmax(z, -1).sort(dim=-1, descending=True)
        before = p.cumsum(-1) - p
        clear &= ((before - top_p).abs() > edge).all(-1)
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= top_p)
        z = z.masked_fill(drop, float("-inf"))
    return torch.log_softmax(z, -1), clear


@rollout_check("seed_determinism")
def check_seed_determinism(kit: Kit) -> str:
    """Same seeds give the same samples, other seeds other samples; a prompt's samples do not depend on the other prompts; n=3 gives 3 different samples."""
    prompts, seeds = kit.prompts, list(SEEDS)
    params = SamplingParams(n=2, max_tokens=8)
    a, b = kit.generate(prompts, params, seeds), kit.generate(prompts, params, seeds)
    if sample_ids(a) != sample_ids(b):
        i = next(i for i in range(len(a)) if sample_ids(a)[i] != sample_ids(b)[i])
        raise CheckFailed(f"two calls with the same seeds differ at prompt {i}: {sample_ids(a)[i]} vs {sample_ids(b)[i]}")
    same = worst_gap(a, [[s.log_probs.double() for s in g] for g in b])
    if same.diff > SELF_TOL:
        raise CheckFailed(f"two calls with the same seeds: log-probs differ by {same.diff:.2e} (> {SELF_TOL:g})")
    other = kit.generate(prompts, params, [s + 1000 for s in seeds])
    if sample_ids(other) == sample_ids(a):
        raise CheckFailed("other seeds gave exactly the same samples for every prompt: the seeds are ignored")
    # Each prompt alone, and the call reversed: the same samples as in the full call.
    for i, p in enumerate(prompts):
        alone = kit.generate([p], params, [seeds[i]])
        if sample_ids(alone)[0] != sample_ids(a)[i]:
            raise CheckFailed(
                f"prompt {i} generated alone (seed {seeds[i]}) gives {sample_ids(alone)[0]}, within the full call {sample_ids(a)[i]}: "
                "a prompt's samples depend on the other prompts of the call"
            )
    rev = kit.generate(prompts[::-1], params, seeds[::-1])[::-1]
    if sample_ids(rev) != sample_ids(a):
        i = next(i for i in range(len(a)) if sample_ids(rev)[i] != sample_ids(a)[i])
        raise CheckFailed(
            f"prompt {i}: the call in reverse order gives {sample_ids(rev)[i]}, in order {sample_ids(a)[i]}: samples depend on the order"
        )
    three = kit.generate(prompts, dataclasses.replace(params, n=3), seeds)
    for i, group in enumerate(sample_ids(three)):
        if group[0] == group[1] == group[2]:
            raise CheckFailed(f"prompt {i}: the n=3 samples are identical ({group[0]}): every sample must draw from its own seed")
    return f"repeatable (log-probs within {same}), seed-sensitive, independent of the other prompts and their order; n=3 distinct"


@rollout_check("stops")
def check_stops(kit: Kit) -> str:
    """With stop_token_ids, a response ends right after the first stop token ('stop'); one without it has max_tokens tokens ('length')."""
    prompts, seeds = make_prompts((2, 3, 5, 5, 8, 9, 11, 14), seed=1), list(range(100, 108))
    params = SamplingParams(n=2, max_tokens=12)
    free = sample_ids(kit.generate(prompts, params, seeds))
    responses = [r for g in free for r in g]
    counts = torch.zeros(VOCAB)
    for r in responses:
        counts[sorted(set(r))] += 1
    stop = int((counts - len(responses) / 2).abs().argmin())  # in about half of the responses
    out = kit.generate(prompts, dataclasses.replace(params, stop_token_ids=(stop,)), seeds)
    n_stop = n_len = 0
    for i, group in enumerate(out):
        for j, s in enumerate(group):
            ids = s.token_ids.tolist()
            at = f"prompt {i} sample {j} ({ids}, {s.finish_reason!r})"
            if stop in ids:
                if ids.index(stop) != len(ids) - 1 or s.finish_reason != "stop":
                    raise CheckFailed(f"stop token {stop}: {at} must end right after its first {stop} with finish_reason 'stop'")
                n_stop += 1
            else:
                if len(ids) != params.max_tokens or s.finish_reason != "length":
                    raise CheckFailed(
                        f"stop token {stop}: {at} has no {stop}, so it must run to max_tokens {params.max_tokens} with 'length'"
                    )
                n_len += 1
    if n_stop == 0 or n_len == 0:
        raise CheckFailed(
            f"stop token {stop} (in {int(counts[stop])} of {len(responses)} unconstrained responses): {n_stop} responses stopped, "
            f"{n_len} ran to the length cap; both kinds are needed (did stop_token_ids change the samples?)"
        )
    return f"stop token {stop}: {n_stop} responses stopped at it, {n_len} ran to max_tokens"


@rollout_check("eos")
def check_eos(kit: Kit) -> str:
    """The model's own EOS (eos_token_id of config.json / generation_config.json) ends no response: only stop_token_ids and stop strings do."""
    eos = model_eos(kit.model_dir)
    prompts, seeds = make_prompts((2, 3, 5, 5, 8, 9, 11, 14), seed=3), list(range(200, 208))
    params = SamplingParams(n=2, max_tokens=12)
    out = kit.generate(prompts, params, seeds)
    passed = 0
    for i, group in enumerate(out):
        for j, s in enumerate(group):
            ids = s.token_ids.tolist()
            if len(ids) < params.max_tokens or s.finish_reason != "length":
                why = (
                    f"it ends at the model's EOS {eos}, which is not a stop id (an engine left to stop at its EOS, e.g. vLLM "
                    "without ignore_eos=True)"
                    if ids and ids[-1] == eos
                    else "without stop ids every response runs to max_tokens"
                )
                raise CheckFailed(f"prompt {i} sample {j}: {len(ids)} tokens {ids}, finish_reason {s.finish_reason!r}: {why}")
            passed += eos in ids[:-1]
    if passed == 0:
        raise CheckFailed(f"the model's EOS {eos} was sampled in no response: the check cannot see an engine stopping at it (kit problem)")
    return f"EOS {eos} sampled inside {passed} responses, each ran on to max_tokens {params.max_tokens}"


@rollout_check("stop_strings")
def check_stop_strings(kit: Kit) -> str:
    """With stop strings (tokenizer_path set), a response ends right after the token that completes the first one ('stop', the string kept); the same seeds without it give the same tokens up to there."""
    prompts, seeds = make_prompts((2, 3, 5, 5, 8, 9, 11, 14), seed=4), list(range(300, 308))
    params = SamplingParams(n=2, max_tokens=16)
    free = [r for g in sample_ids(kit.generate(prompts, params, seeds)) for r in g]
    texts = [text(r) for r in free]
    counts: dict[str, int] = {}
    for t in texts:  # two-character strings: each spans two tokens
        for pair in {t[k : k + 2] for k in range(len(t) - 1)}:
            counts[pair] = counts.get(pair, 0) + 1
    stop = max(sorted(counts), key=lambda p: (counts[p] < len(texts), counts[p]))  # in the most, not all, responses
    out = [s for g in kit.generate(prompts, dataclasses.replace(params, stop=(stop,)), seeds) for s in g]
    n_stop = 0
    for k, (ids, s) in enumerate(zip(free, out, strict=True)):
        cut = next((m for m in range(1, len(ids) + 1) if stop in text(ids[:m])), None)
        want = (ids[:cut], "stop") if cut is not None else (ids, "length")
        got = (s.token_ids.tolist(), s.finish_reason)
        if got != want:
            hint = "; the stop string was ignored" if cut is not None and got == (ids, "length") else ""
            raise CheckFailed(
                f"stop string {stop!r}: prompt {k // params.n} sample {k % params.n} is {got[0]} ({text(got[0])!r}, {got[1]!r}), "
                f"expected {want[0]} ({text(want[0])!r}, {want[1]!r}): the free-running sample cut after the token completing "
                f"{stop!r}{hint}"
            )
        n_stop += cut is not None
    if n_stop == 0 or n_stop == len(free):
        raise CheckFailed(f"stop string {stop!r}: {n_stop} of {len(free)} responses contain it; both kinds are needed (kit problem)")
    return f"stop string {stop!r}: {n_stop} responses cut after it, {len(free) - n_stop} ran to max_tokens"


@rollout_check("global_rng")
def check_global_rng(kit: Kit) -> str:
    """generate, prompt scoring and a weight sync leave the trainer's global RNGs (python random, numpy, torch CPU and CUDA) as they were: no reseeding, no draws."""
    import random

    import numpy as np

    def states():
        out = {
            "python random": random.getstate(),
            "numpy": np.random.get_state()[1].tobytes() + repr(np.random.get_state()[2:]).encode(),
            "torch (CPU)": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            out["torch (CUDA)"] = torch.stack([s for s in torch.cuda.get_rng_state_all()])
        return out

    def same(a, b) -> bool:
        return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b

    e = kit.engine
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    before = states()
    calls = [
        ("generate", lambda: kit.generate(kit.prompts, SamplingParams(n=2, temperature=0.9, top_k=20, max_tokens=6), SEEDS)),
        ("prompt_log_probs", lambda: e.prompt_log_probs(kit.prompts)),
        (f"sync_weights(version={kit.version})", lambda: e.sync_weights(kit.params(), version=kit.version, chunk_mb=CHUNK_MB)),
    ]
    done = []
    for what, call in calls:
        try:
            call()
        except NotImplementedError:
            continue
        done.append(what)
        after = states()
        moved = [name for name in before if not same(before[name], after[name])]
        if moved:
            raise CheckFailed(
                f"{what} changed the global RNG state of {', '.join(moved)}: a backend draws from its own seeded generators and "
                "leaves the trainer's streams alone (reseeding them makes every later draw of the trainer repeat)"
            )
    still_serving(kit, "the calls above")
    return f"{', '.join(done)}: python, numpy and torch RNG states unchanged"


@rollout_check("bad_params")
def check_bad_params(kit: Kit) -> str:
    """Bad sampling settings, an empty prompt, wrong seed count, and prompt + max_tokens > max_model_len raise ValueError naming the problem; the engine is unchanged."""
    e, p = kit.engine, kit.prompts[2]
    base = SamplingParams(max_tokens=4)
    cases = [
        ("temperature", dataclasses.replace(base, temperature=0.0)),
        ("temperature", dataclasses.replace(base, temperature=-1.0)),
        ("temperature", dataclasses.replace(base, temperature=float("nan"))),
        ("top_p", dataclasses.replace(base, top_p=0.0)),
        ("top_p", dataclasses.replace(base, top_p=1.5)),
        ("top_k", dataclasses.replace(base, top_k=0)),
        ("max_tokens", dataclasses.replace(base, max_tokens=0)),
        ("n", dataclasses.replace(base, n=0)),
    ]
    for name, params in cases:
        value = getattr(params, name)
        expect_refusal(f"{name} = {value!r}", ValueError, lambda params=params: e.generate([p], params, [0]), name)
    expect_refusal("an empty prompt", ValueError, lambda: e.generate([torch.zeros(0, dtype=torch.long)], base, [0]))
    expect_refusal("2 seeds for 1 prompt", ValueError, lambda: e.generate([p], base, [0, 1]))
    limit = e.max_model_len
    note = "max_model_len unknown (None): length refusal not checked"
    if limit is not None:
        over = make_prompts((limit - base.max_tokens + 1,), seed=2)[0]
        expect_refusal(
            f"a prompt of {len(over)} tokens + max_tokens {base.max_tokens} > max_model_len {limit}",
            ValueError,
            lambda: e.generate([over], base, [0]),
        )
        fits = over[1:]
        out = kit.generate([fits], base, [0])
        worst = kit.compare([fits], out, 1.0)
        if worst.diff > TOL:
            raise CheckFailed(
                f"a prompt that fills max_model_len {limit} exactly: log-probs off the reference by {worst.diff:.2e} at {worst.where}"
            )
        note = f"a prompt filling max_model_len {limit} exactly is served (max|diff| {worst}), one token more refused"
    worst = still_serving(kit, "the refused calls")
    return f"{len(cases) + 2} bad calls refused; {note}; afterwards unchanged (max|diff| {worst})"


# ----------------------------------------------------------------------------- weight updates
def _verify_update(kit: Kit, target, version: int, what: str, before, named):
    """After an update to ``target`` as ``version``: the engine's version and its log-probs
    against the reference of ``target``; returns the worst gap and the samples."""
    kit.expect(target, version)
    if kit.engine.weight_version != version:
        raise CheckFailed(f"after {what} weight_version is {kit.engine.weight_version}")
    out = kit.generate(kit.prompts, SamplingParams(max_tokens=10), SEEDS)
    worst = kit.compare(kit.prompts, out, 1.0)
    if worst.diff > TOL:
        raise kit.sync_failure(what, kit.prompts, out, 1.0, worst, before, named)
    return worst, out


@rollout_check("sync_exact")
def check_sync_exact(kit: Kit) -> str:
    """After sync_weights of every tensor perturbed (in several chunks) the log-probs equal the perturbed HF model's; samples carry the new version."""
    e, before, version = kit.engine, kit.expected, kit.version + 1
    named = kit.perturbed(seed=1)
    chunks = sum(1 for _ in chunk_pairs(named, CHUNK_MB))
    target = kit.with_update(named)
    e.sync_weights(named, version=version, chunk_mb=CHUNK_MB)
    worst, out = _verify_update(kit, target, version, f"sync_weights(version={version}, {chunks} chunks)", before, named)
    moved = kit.compare(kit.prompts, out, 1.0, before)
    if moved.diff <= 100 * TOL:
        raise CheckFailed(f"the perturbation moves log-probs by only {moved}: the check cannot see an update (kit problem)")
    return (
        f"{len(named)} tensors in {chunks} chunks: max|diff| {worst} (the old weights would be off by {moved}); version {version} stamped"
    )


@rollout_check("sync_twice")
def check_sync_twice(kit: Kit) -> str:
    """A second update (phase by phase, one tensor per chunk, the tied head included) replaces the first: log-probs equal the second reference, version stamped."""
    e, before, version = kit.engine, kit.expected, kit.version + 1
    named = kit.perturbed(seed=2)
    optional = [n for n in e.optional_weights() if n in before]
    names = dict(named)
    for n in optional:  # the tied head, as an export carries it: equal to its embedding
        tied = next((k for k in names if k.endswith("embed_tokens.weight")), None)
        if tied is not None and before[n].shape == names[tied].shape:
            named.append((n, names[tied]))
    target = kit.with_update(named)
    e.begin_weight_update(version)
    for chunk in chunk_pairs(named, None):
        e.update_weights(chunk)
    e.finish_weight_update()
    worst, _ = _verify_update(kit, target, version, f"the update to version {version}", before, named)
    extra = f" (with the optional {optional})" if optional else ""
    return f"{len(named)} tensors one per chunk{extra}: max|diff| {worst}; version {version} stamped"


@rollout_check("sync_after_step")
def check_sync_after_step(kit: Kit) -> str:
    """A real training engine's export_weights(bucket_mb=...) after one optimizer step, synced: log-probs equal the stepped HF model."""
    if kit.trainer is None:
        raise Skipped(f"no training engine: {kit.trainer_error or 'not built'}")
    e, trainer, before, version = kit.engine, kit.trainer, kit.expected, kit.version + 1
    sent: list[tuple[str, torch.Tensor]] = []

    def export():  # records what was sent, as it was when it was sent
        stream = trainer.export_weights(bucket_mb=CHUNK_MB)
        for name, tensor in stream:
            sent.append((name, tensor.detach().cpu().clone()))
            yield name, tensor

    try:
        e.sync_weights(export(), version=version, chunk_mb=CHUNK_MB)
    finally:
        kit.trainer = None  # used once; its memory goes
    target = kit.with_update(sent, base=kit.base)
    kit.expect(target, version)
    if e.weight_version != version:
        raise CheckFailed(f"after sync_weights(version={version}) weight_version is {e.weight_version}")
    out = kit.generate(kit.prompts, SamplingParams(max_tokens=10), SEEDS)
    worst = kit.compare(kit.prompts, out, 1.0)
    if worst.diff > TOL:
        raise kit.sync_failure(f"sync of {TRAINER}'s export (version {version})", kit.prompts, out, 1.0, worst, before, sent)
    moved = kit.compare(kit.prompts, out, 1.0, kit.base)
    if moved.diff <= 100 * TOL:
        raise CheckFailed(f"the training step moved log-probs by only {moved} from the initial model: nothing to see (kit problem)")
    return f"{len(sent)} exported tensors after one {TRAINER} step: max|diff| {worst} (the initial model would be off by {moved})"


@rollout_check("versions")
def check_versions(kit: Kit) -> str:
    """Samples carry the engine's weight_version; re-sending a version is allowed, a lower one refused (ValueError), generate during an open update refused (RuntimeError)."""
    e = kit.engine
    if kit.version == 0:  # a version to go below: re-send the current weights as version 1
        e.sync_weights(kit.params(), version=1, chunk_mb=CHUNK_MB)
        kit.expect(kit.expected, 1)
    v = kit.version
    if e.weight_version != v:
        raise CheckFailed(f"weight_version is {e.weight_version}, the last applied update was version {v}")
    try:
        e.sync_weights(kit.params(), version=v, chunk_mb=CHUNK_MB)
    except Exception as exc:  # noqa: BLE001
        raise CheckFailed(
            f"re-sending the current weights under the current version {v} raised {type(exc).__name__}: {first_line(exc)}"
        ) from None
    stamped = {s.weight_version for g in kit.generate(kit.prompts, SamplingParams(n=2, max_tokens=3), SEEDS) for s in g}
    if stamped != {v}:
        raise CheckFailed(f"samples carry versions {sorted(stamped)}, the engine's weight_version is {v}")
    expect_refusal(f"begin_weight_update({v - 1}) below the current version {v}", ValueError, lambda: e.begin_weight_update(v - 1))
    still_serving(kit, f"the refused begin_weight_update({v - 1})")
    e.begin_weight_update(v + 1)
    try:
        expect_refusal("generate while an update is open", RuntimeError, lambda: e.generate(kit.prompts[:1], SamplingParams(), [0]))
        expect_refusal("a second begin_weight_update while one is open", RuntimeError, lambda: e.begin_weight_update(v + 1))
        if e.weight_version != v:
            raise CheckFailed(f"an open (unfinished) update changed weight_version to {e.weight_version}")
    finally:
        e.abort_weight_update()
    worst = still_serving(kit, f"an aborted update to version {v + 1}")
    return f"every sample stamped {v}; same version re-sent, lower refused, generate and begin refused while open; abort keeps {v} (max|diff| {worst})"


@rollout_check("partial_resume")
def check_partial_resume(kit: Kit) -> str:
    """Partial rollouts: samples paused at 4 tokens under version A and continued (kept=...) after an update to B keep their tokens and log-probs unchanged, report each new token's log-prob under B (prompt + kept + new recomputed, no cache of A), and say so in token_versions (A then B); bad kept entries are refused."""
    e, before, a = kit.engine, kit.expected, kit.version
    kept = [g[0] for g in kit.generate(kit.prompts, SamplingParams(max_tokens=4), SEEDS)]
    if any(len(k.token_ids) != 4 or k.finish_reason != "length" for k in kept):
        raise CheckFailed("without stop ids a first part of max_tokens = 4 must end with 4 tokens and finish_reason 'length'")
    named = kit.perturbed(seed=5)
    target, b = kit.with_update(named), a + 1
    e.sync_weights(named, version=b, chunk_mb=CHUNK_MB)
    kit.expect(target, b)
    try:
        out = e.generate(kit.prompts, SamplingParams(max_tokens=6), list(SEEDS), kept=kept)
    except Exception as exc:  # noqa: BLE001
        raise CheckFailed(f"generate(kept=...) raised {type(exc).__name__}: {first_line(exc)}") from None
    if len(out) != len(kept) or any(len(g) != 1 for g in out):
        raise CheckFailed(f"generate(kept=...) returned {len(out)} groups for {len(kept)} prompts (one sample each expected)")
    whole = [g[0] for g in out]
    for i, (k, s) in enumerate(zip(kept, whole, strict=True)):
        n = len(s.token_ids)
        if n < 5 or n > 10 or not torch.equal(s.token_ids[:4].cpu(), k.token_ids.cpu()):
            raise CheckFailed(
                f"prompt {i}: the continued sample must start with the 4 kept tokens {k.token_ids.tolist()} and add 1-6 new ones; got "
                f"{s.token_ids.tolist()} (the kept tokens were dropped or re-sampled)"
            )
        if not torch.equal(s.log_probs[:4].cpu().float(), k.log_probs.cpu().float()):
            raise CheckFailed(
                f"prompt {i}: the kept tokens' log-probs changed from {k.log_probs.tolist()} to {s.log_probs[:4].tolist()}: they must "
                f"stay those of version {a}, which sampled them (re-scored under the new weights?)"
            )
        versions = s.token_versions.tolist() if s.token_versions is not None else [s.weight_version] * n
        if versions != [a] * 4 + [b] * (n - 4) or s.weight_version != b:
            raise CheckFailed(
                f"prompt {i}: token_versions {versions} / weight_version {s.weight_version}; expected {a} for the 4 kept tokens, "
                f"{b} for the {n - 4} new ones, weight_version {b}"
            )
    new = [[dataclasses.replace(s, token_ids=s.token_ids[4:], log_probs=s.log_probs[4:])] for s in whole]
    extended = [torch.cat([p, k.token_ids.cpu()]) for p, k in zip(kit.prompts, kept, strict=True)]
    worst = kit.compare(extended, new, 1.0)
    if worst.diff > TOL:
        stale = kit.compare(extended, new, 1.0, before)
        why = (
            f"they equal version {a}'s (|diff| {stale}): the continuation sampled with the weights before the update"
            if stale.diff <= TOL
            else f"version {a}'s are off by {stale} too: the new tokens mix the versions (e.g. the kept tokens' cache of version {a} "
            "reused under the new weights)"
        )
        raise CheckFailed(
            f"the new tokens' log-probs differ from version {b}'s (prompt + kept tokens recomputed) by {worst.diff:.2e} (> {TOL:g}) at "
            f"{worst.where}; {why}"
        )
    moved = kit.compare(extended, new, 1.0, before)
    if moved.diff <= 100 * TOL:
        raise CheckFailed(
            f"the update moves the new tokens' log-probs by only {moved}: the check cannot tell the versions apart (kit problem)"
        )
    every = SamplingParams(max_tokens=2, stop_token_ids=tuple(range(VOCAB)))  # any first token stops
    finished = kit.generate(kit.prompts[:1], every, SEEDS[:1])[0][0]
    cases = [
        ("a finished sample (finish_reason 'stop')", kit.prompts[:1], SamplingParams(), [finished], "kept[0]"),
        ("n = 2", kit.prompts[:1], SamplingParams(n=2), kept[:1], "n"),
        ("one kept entry for two prompts", kit.prompts[:2], SamplingParams(), kept[:1], "kept"),
    ]
    for what, prompts, params, bad, name in cases:
        seeds = list(SEEDS[: len(prompts)])
        expect_refusal(
            f"generate(kept=...) with {what}", ValueError, lambda p=prompts, q=params, k=bad, s=seeds: e.generate(p, q, s, kept=k), name
        )
    still_serving(kit, "the refused continuations")
    return (
        f"{len(kept)} samples paused at 4 tokens under version {a}, continued under {b}: kept tokens and log-probs unchanged, new "
        f"tokens' max|diff| {worst} vs version {b} (version {a} would be off by {moved}), versions per token; {len(cases)} bad kept refused"
    )


def _unloadable_versions(tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A weight as a sender may get it wrong: same name and shape, but nothing a model can load."""
    nan = tensor.detach().clone()
    nan.view(-1)[nan.numel() // 2] = float("nan")
    return [
        ("a meta tensor", torch.empty_like(tensor, device="meta")),
        ("a sparse tensor", tensor.detach().to_sparse()),
        ("an int64 tensor", tensor.detach().long()),
        ("a bool tensor", tensor.detach() > 0),
        ("a NaN value", nan),
    ]


@rollout_check("refuse_bad_sync")
def check_refuse_bad_sync(kit: Kit) -> str:
    """An update with an unknown name, a wrong shape, or a tensor no model can load (meta, sparse, int64, bool, NaN: never cast or half-applied) raises ValueError naming the tensor, one missing a tensor raises at finish; each leaves the weights and version as they were, and a clean update after them applies."""
    e, version = kit.engine, kit.version + 1
    named = kit.perturbed(seed=3)
    head, (victim, tensor), tail = named[:3], named[len(named) // 2], named[3:]
    bad_name = "model.layers.0.self_attn.no_such_proj.weight"
    good = named[len(named) // 2 + 1]  # a valid tensor in the same chunk, before the bad one
    cases = [
        ("an unknown name", bad_name, [(bad_name, tensor)]),
        ("a wrong shape", victim, [(victim, tensor.reshape(-1)[:-1].clone())]),
    ] + [(what, victim, [good, (victim, bad)]) for what, bad in _unloadable_versions(tensor)]
    for what, name, bad in cases:
        e.begin_weight_update(version)
        e.update_weights(head)  # staged before the bad chunk: must not be applied either
        expect_refusal(f"update_weights with {what} ({name})", ValueError, lambda bad=bad: e.update_weights(bad), name)
        still_serving(kit, f"the refused chunk with {what}")  # and no update left open
    shapes = e.weight_shapes()
    optional = e.optional_weights()
    missing = next(n for n, _ in reversed(named) if n in shapes and n not in optional)
    e.begin_weight_update(version)
    try:
        e.update_weights(head)
        for chunk in chunk_pairs([(n, t) for n, t in tail if n != missing], CHUNK_MB):
            e.update_weights(chunk)
        expect_refusal(f"finish_weight_update without {missing}", ValueError, e.finish_weight_update)
    finally:
        e.abort_weight_update()
    worst = still_serving(kit, f"the refused update without {missing}")
    # The refusals left nothing behind: a clean update applies and advances the version.
    before = kit.expected
    e.sync_weights(named, version=version, chunk_mb=CHUNK_MB)
    after, _ = _verify_update(
        kit, kit.with_update(named), version, f"a clean sync_weights(version={version}) after the refusals", before, named
    )
    return (
        f"{len(cases)} bad chunks ({', '.join(w for w, _, _ in cases)}) and missing {missing!r} refused; weights and version kept "
        f"(max|diff| {worst}); a clean update after them applied (max|diff| {after})"
    )


# ----------------------------------------------------------------------------- the run
