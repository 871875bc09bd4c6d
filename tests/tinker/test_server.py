"""The Tinker server on a real engine (FSDP, LoRA) driven by the official ``tinker`` SDK, against
independent references: the same datums straight into a ``shared_engine.EngineRun`` in this process, and
one fp32 step of HF + peft + torch AdamW written out here.

One server per module (uvicorn in a thread over ``factory.EngineFactory``), a tiny Llama-style model
with a character tokenizer (``tests/support/user_data.py``), fp32 on CPU.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import tinker
import torch
from tinker import types

from tests.support.tinker import ADAM, ALPHA, KEY, RANK, datums, plain, rel, running_server
from tests.support.user_data import build_model_dir
from tinker_server.config import RunSettings, load_server_config
from tinker_server.contract import AdamIn, LoraIn
from tinker_server.factory import EngineFactory


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    build_model_dir(root / "tiny", family="llama")
    return root


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    cfg = load_server_config(
        "configs/tinker_tiny.yaml",
        [
            f"server.model_root={models}",
            f"server.api_keys=[{KEY}]",
            f"server.state_dir={tmp_path_factory.mktemp('state')}",
            f"tinker.lora_alpha={ALPHA}",
            "server.max_runs=24",  # the module's service holds every run of its tests open
            "server.max_runs_per_key=24",
        ],
    )
    # the SDK sends at most 4 datums per forward_backward request: a 6-datum call arrives in chunks
    cfg_settings = cfg.server_settings()
    cfg_settings.extra["client_config"] = {"fwdbwd_max_chunk_len": 4}
    factory = EngineFactory(cfg.server.model_root, {}, cfg.run_settings())
    with running_server(cfg_settings, factory) as url:
        yield url, factory, cfg


@pytest.fixture(scope="module")
def service(server):
    client = tinker.ServiceClient(base_url=server[0], api_key=KEY)
    yield client
    client.close("success").result()


def _new_client(service, factory, create):
    """``create()`` (a future of a training client), its client, and the engine run the server
    built for it (runs are built in request order; the future resolves once it is built)."""
    before = len(factory.created)
    client = create().result()
    assert len(factory.created) == before + 1, "the server built no run for the client"
    return client, factory.created[-1]


def _adapter(run) -> dict[str, torch.Tensor]:
    with run.shared.serving(run) as engine:
        return {k: v.detach().clone() for k, v in engine.export_adapter_weights()}


@pytest.mark.parametrize("loss", ["cross_entropy", "ppo"])
def test_through_the_server_equals_the_engine_in_process(server, service, loss):
    """Losses, per-token log-probs and the updated adapter: the SDK's results equal the same
    datums given to an EngineRun directly, in the same two calls per step, over two steps (fp32;
    what differs is only the wire: protobuf tensors, futures, the engine thread)."""
    _, factory, _ = server
    client, served = _new_client(service, factory, lambda: service.create_lora_training_client(base_model="tiny", rank=RANK, seed=0))
    direct = factory.create_run("tiny", LoraIn(rank=RANK, seed=0))
    for step in range(2):
        data = datums(10 + step, loss=loss)
        a = client.forward_backward(data[:2], loss).result()
        b = client.forward_backward(data[2:], loss).result()
        client.optim_step(types.AdamParams(**ADAM)).result()
        wa = direct.forward_backward(plain(data[:2]), loss, None, False)
        wb = direct.forward_backward(plain(data[2:]), loss, None, False)
        direct.optim_step(AdamIn(**ADAM))
        for got, want in ((a, wa), (b, wb)):
            assert math.isclose(got.metrics["loss:sum"], want.metrics["loss:sum"], rel_tol=1e-6), (step, got.metrics, want.metrics)
            for g, w in zip(got.loss_fn_outputs, want.outputs, strict=True):
                assert torch.allclose(torch.as_tensor(g["logprobs"].to_torch()), w["logprobs"], atol=1e-6)
    ours, theirs = _adapter(served), _adapter(direct)
    assert ours.keys() == theirs.keys()
    assert rel(ours, theirs) <= 1e-6, rel(ours, theirs)


def test_one_step_equals_hf_peft_and_torch_adamw(server, service, models):
    """cross_entropy with real weights, summed (no mean), one AdamW step with clipping: the trained
    adapter equals peft's LoRA on the HF model stepped by torch AdamW, fp32."""
    import peft
    from transformers import AutoModelForCausalLM

    client, served = _new_client(service, server[1], lambda: service.create_lora_training_client(base_model="tiny", rank=RANK, seed=3))
    before = _adapter(served)
    data = datums(21)
    adam = {**ADAM, "grad_clip_norm": 0.5}
    fb = client.forward_backward(data, "cross_entropy").result()
    client.optim_step(types.AdamParams(**adam)).result()

    hf = AutoModelForCausalLM.from_pretrained(str(models / "tiny"), dtype=torch.float32)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    ref = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=modules, lora_dropout=0.0))
    peft.set_peft_model_state_dict(ref, before)
    ref.train()
    loss = 0.0
    for d in data:
        ids = torch.tensor(d.model_input.to_ints())[None]
        logp = torch.log_softmax(ref(ids).logits[0].float(), -1)
        lp = logp.gather(-1, torch.as_tensor(d.loss_fn_inputs["target_tokens"].to_torch())[:, None]).squeeze(-1)
        loss = loss - (lp * torch.as_tensor(d.loss_fn_inputs["weights"].to_torch())).sum()
    loss.backward()
    params = [p for p in ref.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, adam["grad_clip_norm"])
    torch.optim.AdamW(
        params, lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"], weight_decay=adam["weight_decay"]
    ).step()
    # peft's state dict also carries lm_head's frozen base weight (an adapted output layer): the adapters are compared
    want = {k: v for k, v in peft.get_peft_model_state_dict(ref).items() if "lora_" in k}
    got = _adapter(served)
    assert math.isclose(fb.metrics["loss:sum"], float(loss), rel_tol=1e-6)
    assert got.keys() == want.keys()
    assert rel(got, want) <= 1e-6, rel(got, want)
    assert any(not torch.equal(got[k], before[k]) for k in want)


def test_seeded_samples_reproduce_and_prompt_logprobs_score_the_prompt(server, service):
    client = service.create_lora_training_client(base_model="tiny", rank=RANK).result()
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([5, 9, 12, 7])
    params = types.SamplingParams(max_tokens=6, seed=7, temperature=1.0)
    a = sampler.sample(prompt=prompt, num_samples=3, sampling_params=params).result()
    b = sampler.sample(prompt=prompt, num_samples=3, sampling_params=params).result()
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert len({tuple(s.tokens) for s in a.sequences}) > 1  # the samples of one request differ
    scored = sampler.compute_logprobs(prompt).result()
    assert scored[0] is None and len(scored) == 4
    # the prompt's log-probs equal the trained run's forward of the same tokens (targets = next tokens)
    fwd = client.forward(
        [
            types.Datum(
                model_input=types.ModelInput.from_ints([5, 9, 12]), loss_fn_inputs={"target_tokens": [9, 12, 7], "weights": [1.0, 1.0, 1.0]}
            )
        ],
        "cross_entropy",
    ).result()
    want = torch.as_tensor(fwd.loss_fn_outputs[0]["logprobs"].to_torch())
    assert torch.allclose(torch.tensor(scored[1:]), want, atol=1e-5)


def test_resume_with_the_optimizer_continues_exactly(server, service):
    """save_state -> create_training_client_from_state_with_optimizer -> the next step equals the
    uninterrupted run's (adapter bit for bit within fp32 reordering)."""
    client, first = _new_client(service, server[1], lambda: service.create_lora_training_client(base_model="tiny", rank=RANK, seed=5))
    client.forward_backward(datums(31), "cross_entropy").result()
    client.optim_step(types.AdamParams(**ADAM)).result()
    path = client.save_state("mid").result().path
    resumed, second = _new_client(service, server[1], lambda: service.create_training_client_from_state_with_optimizer(path))
    for c in (client, resumed):
        c.forward_backward(datums(32), "cross_entropy").result()
        c.optim_step(types.AdamParams(**ADAM)).result()
    assert rel(_adapter(second), _adapter(first)) <= 1e-7


def test_split_chunks_and_interleaved_clients_change_nothing(server, service):
    """One step of 6 datums: sent as one call (two chunks of <= 4 on the wire) by client A, as three
    calls of 2 by client B, and by client C in one call while B's calls run interleaved with it:
    the three adapters agree (relative 1e-6; fp32 sums in another order), so neither the split nor
    another client's run changes a run."""
    _, factory, _ = server
    runs = []
    clients = []
    for _ in range(3):
        client, run = _new_client(service, factory, lambda: service.create_lora_training_client(base_model="tiny", rank=RANK, seed=9))
        clients.append(client)
        runs.append(run)
    a, b, c = clients
    data = datums(41)
    futures = [a.forward_backward(data, "cross_entropy")]
    for i in range(3):  # B's three calls and C's one call, queued alternately
        futures.append(b.forward_backward(data[2 * i : 2 * i + 2], "cross_entropy"))
        if i == 1:
            futures.append(c.forward_backward(data, "cross_entropy"))
    [f.result() for f in futures]
    for client in clients:
        client.optim_step(types.AdamParams(**ADAM)).result()
    adapters = [_adapter(run) for run in runs]
    assert rel(adapters[1], adapters[0]) <= 1e-6 and rel(adapters[2], adapters[0]) <= 1e-6
    assert any(float(v.abs().max()) > 0 for k, v in adapters[0].items() if "lora_B" in k)  # it trained (B starts at 0)


def test_a_refused_request_leaves_the_run_untouched(server, service):
    """A forward_backward (one request: 4 datums, the chunk size here) whose last datum holds a token
    outside the vocabulary is refused as a user error naming it, and so is a bad loss setting, before
    anything runs: the next step equals a run that never saw them (bit for bit)."""
    _, factory, _ = server
    bad = datums(51, n=4)
    bad[-1] = types.Datum(
        model_input=types.ModelInput.from_ints([3, 4, 999]),
        loss_fn_inputs=bad[-1].loss_fn_inputs | {"target_tokens": [4, 5, 6], "weights": [1.0, 1.0, 1.0]},
    )
    hit, clean = (
        _new_client(service, factory, lambda: service.create_lora_training_client(base_model="tiny", rank=RANK, seed=2)) for _ in range(2)
    )
    with pytest.raises(tinker.RequestFailedError, match="999"):
        hit[0].forward_backward(bad, "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="not a setting of ppo"):
        hit[0].forward_backward(datums(52, loss="ppo"), "ppo", {"beta": 1.0}).result()
    for client in (hit[0], clean[0]):
        client.forward_backward(datums(53), "cross_entropy").result()
        client.optim_step(types.AdamParams(**ADAM)).result()
    got, want = _adapter(hit[1]), _adapter(clean[1])
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_backend_without_lora_is_refused_when_the_server_starts(models):
    """Every Tinker run is a LoRA run: a strategy whose backend trains no adapters (here the
    reference DDP backend, which declares none) stops the server at start with the key
    and the fix, instead of failing each create_model."""
    strategy = "tests.reference_engine:ReferenceEngine"
    with pytest.raises(ValueError, match=r"engine.strategy = .*trains no LoRA adapters.*fix: engine.strategy=fsdp"):
        EngineFactory(str(models), {}, RunSettings(strategy=strategy))


def test_a_step_that_writes_non_finite_weights_is_refused_until_a_load(server, service):
    """optim_step(learning_rate=10, weight_decay=1e39) is answered with a user error naming the rate and the fix; the
    run then refuses to train or sample until a load, after which it trains as before."""
    _, factory, _ = server
    client, run = _new_client(service, factory, lambda: service.create_lora_training_client(base_model="tiny", rank=RANK, seed=4))
    client.forward_backward(datums(61), "cross_entropy").result()
    client.optim_step(types.AdamParams(**ADAM)).result()
    saved = client.save_state("finite").result().path
    client.forward_backward(datums(61), "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError) as e:
        # AdamW's decay factor 1 - lr * wd = -1e40 overflows float32: every trained weight becomes inf
        # (the learning rate itself is within the server's cap of 10: wire.MAX_LEARNING_RATE)
        client.optim_step(types.AdamParams(**{**ADAM, "learning_rate": 10.0, "weight_decay": 1e39})).result()
    assert e.value.category == types.RequestErrorCategory.User
    assert "learning_rate=10.0" in str(e.value) and "load_state" in str(e.value)
    with pytest.raises(tinker.RequestFailedError, match="refused.*load_state"):
        client.forward_backward(datums(62), "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="refused"):
        client.save_weights_and_get_sampling_client().result()
    client.load_state_with_optimizer(saved).result()
    client.forward_backward(datums(62), "cross_entropy").result()
    assert math.isfinite(client.optim_step(types.AdamParams(**ADAM)).result().metrics["grad_norm:mean"])
    assert all(bool(torch.isfinite(v).all()) for v in _adapter(run).values())


def test_a_loss_that_overflows_is_refused_not_skipped(server, service):
    """Finite weights whose loss overflows float32 (-inf) fail the call naming it; the gradients of
    the window are dropped (said so), so the next step is not silently skipped."""
    _, factory, _ = server
    client, _ = _new_client(service, factory, lambda: service.create_lora_training_client(base_model="tiny", rank=RANK, seed=5))
    huge = [
        types.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs | {"weights": [-3e38] * d.model_input.length})
        for d in datums(63, n=2)
    ]
    with pytest.raises(tinker.RequestFailedError, match="-inf.*discarded"):
        client.forward_backward(huge, "cross_entropy").result()
    client.forward_backward(datums(64), "cross_entropy").result()
    norm = client.optim_step(types.AdamParams(**ADAM)).result().metrics["grad_norm:mean"]
    assert math.isfinite(norm) and norm > 0


def test_sampling_and_creation_refusals_name_the_limit(server, service, models):
    """Out-of-vocabulary prompt tokens, prompt + max_tokens past the model's positions, a LoRA rank
    past the hidden size, an unknown engine setting (at start) and a tampered sampler checkpoint:
    each a user error naming the field and the fix, never a raw IndexError / SafetensorError."""
    _, factory, cfg = server
    sampler = service.create_sampling_client(base_model="tiny")
    long_prompt = [3 + i % 18 for i in range(130)]  # longer than the tiny model's 128 positions on its own
    for prompt, params, words in (
        ([3, 999], types.SamplingParams(max_tokens=2), "token id 999 is outside the model's vocabulary"),
        ([3, 4], types.SamplingParams(max_tokens=200), r"max_tokens = 200.*max_position_embeddings.*fix: max_tokens <= 126"),
        (long_prompt, types.SamplingParams(max_tokens=2), r"prompt: too long: its 130 tokens alone fill the model's 128 positions"),
    ):
        with pytest.raises(tinker.RequestFailedError, match=words) as e:
            sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result()
        assert "<= -" not in str(e.value)  # never a negative max_tokens as the fix
        assert e.value.category == types.RequestErrorCategory.User
    created = len(factory.created)
    with pytest.raises(tinker.RequestFailedError, match=r"lora_config.rank = 1099511627776.*hidden size"):
        service.create_lora_training_client(base_model="tiny", rank=2**40).result()
    assert len(factory.created) == created
    with pytest.raises(ValueError, match="engine.settings.*nosuch"):
        EngineFactory(str(models), {}, RunSettings(engine_overrides=("nosuch.key=1",)))

    client, _ = _new_client(service, factory, lambda: service.create_lora_training_client(base_model="tiny", rank=RANK, seed=6))
    for name, file, garbage in (("t1", "model.safetensors", b"\x00" * 64), ("t2", "sampler.json", b"[1]")):
        path = client.save_weights_for_sampler(name).result().path
        (Path(cfg.server.state_dir) / client.model_id / "sampler_weights" / name / file).write_bytes(garbage)
        with pytest.raises(tinker.RequestFailedError, match=f"sampler checkpoint '{name}' is damaged.*save it again") as e:
            service.create_sampling_client(model_path=path).sample(
                types.ModelInput.from_ints([3]), 1, types.SamplingParams(max_tokens=1)
            ).result()
        assert e.value.category == types.RequestErrorCategory.User


def test_a_checkpoint_of_other_lora_targets_is_refused_as_a_user_error(server, service):
    """load_state of a checkpoint saved by a run without lm_head's adapter (train_unembed=False)
    into a run with one: a user error naming both target sets and the fix (not a server error from
    inside the engine's checkpoint loader); the run is untouched and trains on."""
    _, factory, _ = server
    narrow, _ = _new_client(
        service, factory, lambda: service.create_lora_training_client(base_model="tiny", rank=RANK, seed=8, train_unembed=False)
    )
    path = narrow.save_state("narrow").result().path
    client, run = _new_client(service, factory, lambda: service.create_lora_training_client(base_model="tiny", rank=RANK, seed=8))
    before = _adapter(run)
    with pytest.raises(tinker.BadRequestError) as e:
        client.load_state(path).result()
    body = e.value.body
    assert body["category"] == "user", body
    for words in ("train_unembed=False", "the MLP projections and lm_head", "train_unembed=True", "fix: create_training_client_from_state"):
        assert words in body["error"], (words, body)
    got = _adapter(run)
    assert all(torch.equal(got[k], before[k]) for k in before)
    client.forward_backward(datums(71), "cross_entropy").result()
    assert math.isfinite(client.optim_step(types.AdamParams(**ADAM)).result().metrics["grad_norm:mean"])


def test_the_openai_endpoint_samples_what_asample_samples(server, service, models):
    """``/oai/api/v1`` against the native ``asample`` of the same weights: a seeded chat
    completion (its prompt rendered here with HF's ``apply_chat_template``) and a seeded text
    completion give the tokens and log-probs the SDK's ``SamplingClient.sample`` gives for the
    same prompt ids, seed and stop id, for the base model and for a ``tinker://`` sampler path
    saved after a step (whose log-probs differ from the base's: the path's weights are used);
    the streamed answer is the same text."""
    import openai
    from transformers import AutoTokenizer

    url = server[0]
    tok = AutoTokenizer.from_pretrained(models / "tiny")
    client = service.create_lora_training_client(base_model="tiny", rank=RANK).result()
    client.forward_backward(datums(3), "cross_entropy").result()
    client.optim_step(types.AdamParams(**{**ADAM, "learning_rate": 0.2})).result()
    path = client.save_weights_for_sampler("oai").result().path
    oai = openai.OpenAI(base_url=f"{url}/oai/api/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "12+7="}]
    prompt = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    stop = [tok.eos_token_id]
    answers = {}
    for model in ("tiny", path):
        native = service.create_sampling_client(**({"model_path": path} if model == path else {"base_model": "tiny"})).result()
        params = types.SamplingParams(max_tokens=8, seed=11, temperature=1.0, stop=stop)
        want = native.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params).result().sequences
        got = oai.chat.completions.create(model=model, messages=messages, max_tokens=8, seed=11, logprobs=True, n=2)
        for seq, c in zip(want, got.choices, strict=True):
            ids = seq.tokens[:-1] if seq.stop_reason == "stop" else seq.tokens
            assert c.message.content == tok.decode(ids)
            assert [p.logprob for p in c.logprobs.content] == pytest.approx(seq.logprobs, abs=1e-6)
            assert c.finish_reason == ("stop" if seq.stop_reason == "stop" else "length")
        text = oai.completions.create(model=model, prompt=prompt, max_tokens=8, seed=11, logprobs=1, n=2)
        assert [c.logprobs.token_logprobs for c in text.choices] == [pytest.approx(s.logprobs, abs=1e-6) for s in want]
        streamed = oai.chat.completions.create(model=model, messages=messages, max_tokens=8, seed=11, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == got.choices[0].message.content
        answers[model] = [p.logprob for p in got.choices[0].logprobs.content]
    assert answers["tiny"] != pytest.approx(answers[path], abs=1e-4)
