"""Many training runs on one engine (issue 55): the Tinker server's runs of one base model, LoRA
rank and targets share an engine (``tinker_server.shared_engine.SharedEngine``), each run's adapters,
gradients, AdamW state, step and RNG swapped in for its calls.

* Interleaved, three runs (two seeds, one of them other than the engine's; calls of different
  runs alternating, one run swapped out with gradients pending, two losses) give, call for call,
  bit for bit the losses, log-probs, grad norms, samples and final adapters of a dedicated
  engine serving each run alone (``engine.share=false``), on FSDP and on megatron.
* Run A's forward_backward + optim_step leaves run B's whole state (adapters, gradients, AdamW
  moments and step, engine step) and B's seeded samples bit-identical.
* A run saved, the server's factory closed and a new one built: each run resumes and steps
  exactly as it would have.
* Refusals: an engine past ``engine.max_engines`` (naming the rank and what is served), a
  closed run's calls, a run state of another layout; every other run untouched.

Each backend runs in a spawned process (megatron's CPU compat layer stays out of the test
process); the comparisons are made here.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.launch import run_distributed
from tests.support.tinker import ADAM, ALPHA, RANK, datums, plain
from tests.support.user_data import build_model_dir
from tinker_server.config import load_server_config
from tinker_server.contract import AdamIn, LoraIn, SampleParamsIn, UserError
from tinker_server.factory import EngineFactory

pytestmark = pytest.mark.slow

RUNS = {"a": LoraIn(rank=RANK, seed=1), "b": LoraIn(rank=RANK, seed=2), "c": LoraIn(rank=RANK, seed=1)}
# (run, call, datum seed or loss): runs alternate; "b" is swapped out with gradients pending twice.
CALLS = [
    ("a", "fb", 11, "cross_entropy"),
    ("b", "fb", 12, "importance_sampling"),
    ("a", "step", 0, ""),
    ("c", "fb", 13, "cross_entropy"),
    ("b", "fb", 14, "cross_entropy"),
    ("c", "step", 0, ""),
    ("b", "step", 0, ""),
    ("a", "fb", 15, "ppo"),
    ("c", "sample", 3, ""),
    ("a", "step", 0, ""),
    ("b", "sample", 4, ""),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    build_model_dir(models / "tiny", family="llama")
    return models


def _factory(models: str, strategy: str, *extra: str) -> EngineFactory:
    over = [f"server.model_root={models}", f"tinker.lora_alpha={ALPHA}", f"engine.strategy={strategy}", *extra]
    cfg = load_server_config("configs/tinker_tiny.yaml", over)
    return EngineFactory(cfg.server.model_root, {}, cfg.run_settings())


def _call(run, call: str, seed: int, loss: str):
    if call == "fb":
        out = run.forward_backward(plain(datums(seed, n=3, loss=loss)), loss, None, False)
        return out.metrics["loss:sum"], [o["logprobs"] for o in out.outputs]
    if call == "step":
        return run.optim_step(AdamIn(**ADAM))
    seqs = run.sampler(None).sample([1, 2, 3], 2, SampleParamsIn(max_tokens=4, seed=seed), False).sequences
    return [(s.tokens, s.logprobs) for s in seqs]


def _adapters(run) -> dict[str, torch.Tensor]:
    with run.shared.serving(run) as engine:
        return {k: v.detach().clone() for k, v in engine.export_adapter_weights()}


def _run_state(run):
    with run.shared.serving(run) as engine:
        return engine.run_state()


def interleaved_and_alone(rank, world, models, strategy) -> dict:
    """CALLS on one shared engine, then each run's calls alone on engines of their own."""
    shared = _factory(models, strategy)
    runs = {name: shared.create_run("tiny", lora) for name, lora in RUNS.items()}
    got = {name: [] for name in RUNS}
    for name, call, seed, loss in CALLS:
        got[name].append(_call(runs[name], call, seed, loss))
    out = {"engines": len(shared.engines), "got": got, "got_adapters": {n: _adapters(r) for n, r in runs.items()}}
    # Run A's step leaves run B untouched: its whole state and its samples.
    b = runs["b"]
    before, sample_before = _run_state(b), _call(b, "sample", 5, "")
    _call(runs["a"], "fb", 16, "cross_entropy")
    _call(runs["a"], "step", 0, "")
    after, sample_after = _run_state(b), _call(b, "sample", 5, "")
    out["b_state"] = (before, after)
    out["b_samples"] = (sample_before, sample_after)
    # Refusals leave the runs as they were.
    kept = _adapters(runs["c"])
    out["refusals"] = []
    for what in (
        lambda: shared.create_run("tiny", LoraIn(rank=RANK + 4, seed=0)),  # a second engine: allowed (max_engines 2)
        lambda: shared.create_run("tiny", LoraIn(rank=RANK + 2, seed=0)),  # a third: refused
    ):
        try:
            what()
        except UserError as exc:
            out["refusals"].append(str(exc))
    closed = runs["a"]
    closed.close()
    try:
        _call(closed, "step", 0, "")
    except UserError as exc:
        out["refusals"].append(str(exc))
    out["c_kept"] = (kept, _adapters(runs["c"]))
    shared.close()
    alone = _factory(models, strategy, "engine.share=false", "engine.max_engines=3")
    want = {}
    for name, lora in RUNS.items():
        run = alone.create_run("tiny", lora)
        want[name] = [_call(run, call, seed, loss) for n, call, seed, loss in CALLS if n == name]
        out.setdefault("want_adapters", {})[name] = _adapters(run)
        run.close()
    out["want"] = want
    alone.close()
    return out


def _same(got, want, what: str) -> None:
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), what
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), what
        for k in want:
            _same(got[k], want[k], f"{what}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(g, w, f"{what}[{i}]")
    else:
        assert got == want, (what, got, want)


@pytest.mark.parametrize("strategy", ["fsdp", "megatron"])
def test_runs_interleaved_on_one_engine_equal_each_run_alone(models, strategy):
    out = run_distributed(interleaved_and_alone, 1, str(models), strategy)[0]
    assert out["engines"] == 1  # three runs, two seeds: one engine
    for name in RUNS:
        _same(out["got"][name], out["want"][name], f"run {name}'s calls")
        _same(out["got_adapters"][name], out["want_adapters"][name], f"run {name}'s adapters")
    before, after = out["b_state"]
    _same(after.params, before.params, "run B's adapters")
    _same(after.grads, before.grads, "run B's gradients")
    _same(after.optim, before.optim, "run B's AdamW state")
    assert after.scalars["global_step"] == before.scalars["global_step"] == 1
    _same(out["b_samples"][1], out["b_samples"][0], "run B's seeded samples")
    [third, closed] = out["refusals"]
    assert "engine.max_engines = 2" in third and f"rank {RANK + 2}" in third and f"rank {RANK}" in third, third
    assert "unloaded" in closed, closed
    _same(out["c_kept"][1], out["c_kept"][0], "run C after the refusals")


def save_and_resume(rank, world, models, strategy, state_dir) -> dict:
    """Two runs step on a shared engine and save; a new factory (a restarted server) loads both
    into new runs sharing its engine, which step on, against the uninterrupted runs."""
    from pathlib import Path

    first = _factory(models, strategy)
    runs = [first.create_run("tiny", LoraIn(rank=RANK, seed=s)) for s in (1, 2)]
    for i, run in enumerate(runs):
        _call(run, "fb", 20 + i, "cross_entropy")
        _call(run, "step", 0, "")
        run.save_state(Path(state_dir) / f"run{i}", with_optimizer=True)
    for i, run in enumerate(runs):  # the uninterrupted continuation
        _call(run, "fb", 30 + i, "cross_entropy")
        _call(run, "step", 0, "")
    want = [_adapters(run) for run in runs]
    first.close()
    restarted = _factory(models, strategy)
    resumed = [restarted.create_run("tiny", LoraIn(rank=RANK, seed=0)) for _ in runs]
    for i, run in enumerate(resumed):
        run.load_state(Path(state_dir) / f"run{i}", with_optimizer=True)
    for i, run in enumerate(resumed):
        _call(run, "fb", 30 + i, "cross_entropy")
        _call(run, "step", 0, "")
    got = [_adapters(run) for run in resumed]
    engines = len(restarted.engines)
    restarted.close()
    return {"got": got, "want": want, "engines": engines}


def test_each_run_resumes_exactly_after_a_restart(models, tmp_path):
    out = run_distributed(save_and_resume, 1, str(models), "fsdp", str(tmp_path))[0]
    assert out["engines"] == 1
    for i, (got, want) in enumerate(zip(out["got"], out["want"], strict=True)):
        _same(got, want, f"run {i} resumed")


def test_a_run_past_the_host_memory_is_refused_and_the_others_go_on(models, monkeypatch):
    """Memory, not only a count, bounds the runs of an engine: a run whose state (about 4x its
    adapters) does not fit the host's available memory is refused naming both sizes; the run
    already served is untouched and goes on."""
    from tinker_server import shared_engine

    factory = _factory(str(models), "fsdp")
    first = factory.create_run("tiny", RUNS["a"])
    _call(first, "fb", 11, "cross_entropy")
    before = _adapters(first)
    monkeypatch.setattr(shared_engine, "available_host_bytes", lambda: 1024)
    with pytest.raises(UserError, match="MB of host memory") as err:
        factory.create_run("tiny", RUNS["b"])
    assert "0 MB available" in str(err.value) and "unload" in str(err.value)
    _same(_adapters(first), before, "the served run after the refusal")
    _call(first, "step", 0, "")  # its pending gradients were kept
    first.close()
    factory.close()


def test_a_backend_that_cannot_reseed_serves_other_seeds_on_engines_of_their_own(models):
    """A plug-in backend without ``_reset_adapters`` cannot draw another seed's adapters: a run of
    another seed gets an engine of its own (never the build seed's adapters), a run of the build
    seed still shares."""
    factory = _factory(str(models), "fsdp", "engine.max_engines=3")
    first = factory.create_run("tiny", RUNS["a"])
    factory.engines[0].can_reseed = False  # as for such a backend
    other_seed = factory.create_run("tiny", RUNS["b"])
    same_seed = factory.create_run("tiny", RUNS["c"])
    assert other_seed.shared is not first.shared and same_seed.shared is first.shared
    assert other_seed.shared.seed == RUNS["b"].seed
    for run in (first, other_seed, same_seed):
        run.close()
    factory.close()


# Each setting differs between the two runs and changes a step: the learning rate, the betas (from
# the second step on), eps (gradients of the adapters are of its order), weight decay (lora_A is
# not zero) and clipping (run a's bound is below its gradients' norm, run b clips nothing).
HPARAMS = {
    "a": dict(lr=0.02, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.05, clip_grad=0.05),
    "b": dict(lr=0.005, betas=(0.5, 0.8), eps=1e-6, weight_decay=0.3, clip_grad=None),
}


def _settings_once_then_steps(factory: EngineFactory, names: list[str]) -> dict:
    """Runs ``names`` on ``factory``: each sets its AdamW settings and clipping once, then they
    step in turn three times (forward_backward, then the engine's own optimizer_step: no
    set_optim_hparams before it, so a step uses what the swap put back)."""
    runs = {name: factory.create_run("tiny", RUNS[name]) for name in names}
    for name, run in runs.items():
        with run.shared.serving(run) as engine:
            engine.set_optim_hparams(**HPARAMS[name])
    norms: dict[str, list[float]] = {name: [] for name in names}
    for step in range(3):
        for name, run in runs.items():
            run.forward_backward(plain(datums(90 + 10 * step + len(norms[name]), n=3)), "cross_entropy", None, False)
            with run.shared.serving(run) as engine, engine.train_mode():
                norms[name].append(float(engine.optimizer_step()))
                engine.optimizer_zero_grad()
    out = {name: (norms[name], _adapters(run)) for name, run in runs.items()}
    for run in runs.values():
        run.close()
    return out


def test_a_swap_puts_back_each_runs_optimizer_settings_and_clipping(models):
    """Two runs on one shared engine with their own AdamW settings (lr, betas, eps, weight decay)
    and gradient clipping, each set once, stepping in turn: each run's grad norms and adapters
    equal the same run alone on an engine of its own, bit for bit. A swap that forgot any one of
    the settings would step a run with the other run's value (shown failing by injecting each)."""
    shared = _factory(str(models), "fsdp")
    got = _settings_once_then_steps(shared, ["a", "b"])
    assert len(shared.engines) == 1
    shared.close()
    assert min(got["a"][0]) > HPARAMS["a"]["clip_grad"]  # a's bound clips every step
    alone = _factory(str(models), "fsdp", "engine.share=false")  # an engine per run: nothing swapped
    want = _settings_once_then_steps(alone, ["a", "b"])
    assert len(alone.engines) == 2
    alone.close()
    for name in ("a", "b"):
        _same(got[name], want[name], f"run {name} interleaved vs alone")


def test_runs_take_turns_on_the_worker_so_none_is_starved():
    """The server's one worker thread serves the runs' queues round-robin (each run's calls in its
    seq order): a run with many calls queued does not hold back a call of another run that arrives
    after them; it runs second."""
    import threading

    from tinker_server.futures import OrderedWorker

    worker = OrderedWorker()
    gate, finished, ran = threading.Event(), threading.Event(), []
    try:
        for key in ("gate", "a", "b"):
            worker.open(key, ordered=True)
        worker.submit("gate", 0, gate.wait, lambda _m: None)  # holds the thread while the calls queue up
        for seq in range(6):
            worker.submit("a", seq, lambda seq=seq: ran.append(f"a{seq}"), lambda _m: None)
        worker.submit("b", 0, lambda: ran.append("b0"), lambda _m: None)
        worker.submit("a", 6, finished.set, lambda _m: None)  # a's last call: everything before it has run
        gate.set()
        assert finished.wait(30)
    finally:
        worker.stop()
    assert ran[:2] == ["a0", "b0"] and [r for r in ran if r.startswith("a")] == [f"a{i}" for i in range(6)], ran


def vllm_adapter_samplers(rank, world, models) -> dict:
    """Two runs' sampling snapshots as adapters on one vLLM engine (``rollout.lora_rank``), served
    alternately, against the same runs' merged weights synced into it."""
    import os

    from tinker_server.snapshots import snapshot

    factory = _factory(models, "fsdp", "rollout.backend=vllm", f"rollout.lora_rank={RANK}", "rollout.max_loras=2")
    # two runs of the projections, and one that also adapts lm_head (served merged)
    loras = [LoraIn(rank=RANK, seed=1, train_unembed=False), LoraIn(rank=RANK, seed=2, train_unembed=False), LoraIn(rank=RANK, seed=3)]
    runs = [factory.create_run("tiny", lora) for lora in loras]
    for i, run in enumerate(runs):
        _call(run, "fb", 40 + i, "cross_entropy")
        _call(run, "step", 0, "")
    unembed = runs.pop()
    got = {"unembed_kind": unembed.sampler(None).adapter is None}
    snaps = [run.sampler(None) for run in runs]
    merged = [snapshot(factory._pool("tiny"), "tiny", run.merged_weights(), None) for run in runs]
    params = SampleParamsIn(max_tokens=6, seed=3)

    def draw(snap):
        out = snap.sample([4, 5, 6], 2, params, True)
        return [(s.tokens, s.logprobs) for s in out.sequences], out.prompt_logprobs

    got |= {"adapter": [draw(s) for s in (*snaps, *snaps)], "merged": [draw(s) for s in merged]}
    got["kinds"] = [s.adapter is not None for s in snaps]
    got["written"] = len(os.listdir(factory._pool("tiny").engine._lora_dir))
    got["base_again"] = draw(factory.base_sampler("tiny"))  # an adapter snapshot, then the base
    got["base"] = draw(snapshot(factory._pool("tiny"), "tiny", {k: v.clone() for k, v in factory._pool("tiny").base.items()}, None))
    for run in (*runs, unembed):
        run.close()
    factory.close()
    return got


def test_vllm_serves_each_runs_sampler_as_an_adapter_on_one_engine(models, tmp_path):
    """``rollout.lora_rank``: each run's sampling snapshot is its adapter on the base weights
    (vLLM's LoRA, ``max_loras`` resident): the same tokens as the run's merged weights synced
    into the engine, log-probs (sampled and prompt) within vLLM's float noise (1e-4; measured 2e-7:
    vLLM's LoRA on lm_head was 0.17 off, so runs adapting lm_head sample merged); switching back
    to a run's adapter reuses it (no second write, the same seeded samples); the base sampler after
    an adapter samples the base."""
    vllm_models = tmp_path / "models"
    build_model_dir(vllm_models / "tiny", family="llama", head_dim=32)  # vLLM's CPU attention needs >= 32
    out = run_distributed(vllm_adapter_samplers, 1, str(vllm_models))[0]
    assert out["kinds"] == [True, True] and out["written"] == 2
    assert out["unembed_kind"]  # a run adapting lm_head samples merged weights (vLLM's head LoRA differs)
    adapter, merged = out["adapter"], out["merged"]
    _same(adapter[2], adapter[0], "run A's adapter served again")
    _same(adapter[3], adapter[1], "run B's adapter served again")
    for i in range(2):
        (seqs, prompt), (want_seqs, want_prompt) = adapter[i], merged[i]
        assert [s[0] for s in seqs] == [s[0] for s in want_seqs], i
        gaps = [abs(a - b) for (_, lp), (_, wlp) in zip(seqs, want_seqs, strict=True) for a, b in zip(lp, wlp, strict=True)]
        gaps += [abs(a - b) for a, b in zip(prompt[1:], want_prompt[1:], strict=True)]
        assert max(gaps) <= 1e-4, (i, max(gaps))
    assert adapter[0][0] != adapter[1][0]  # the two runs' adapters differ
    _same(out["base_again"], out["base"], "the base sampler after an adapter")


def test_adapter_samplers_on_a_rollout_backend_without_lora_are_refused_at_start(models):
    with pytest.raises(
        ValueError, match=r"rollout.lora_rank = 8: the 'hf' rollout backend serves no LoRA adapters; fix: rollout.backend=vllm"
    ):
        _factory(str(models), "fsdp", "rollout.lora_rank=8")
