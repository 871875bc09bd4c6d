"""The Tinker HTTP layer (``tinker_server``) driven by the official ``tinker`` SDK.

One server per module (uvicorn in a thread) over :class:`FakeFactory`, whose every output is a
known function of its input: the checks compare what the SDK decodes with what the fake computed,
what reached the fake (the exact AdamParams, datums in ``seq_id`` order) and, for refused
requests, that nothing reached it. Raw ``httpx`` requests cover what the SDK would refuse to send.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from tests.support.tinker import KEY, running_server
from tests.tinker.fake_run import MODEL, OTHER, VOCAB, FakeFactory, FakeRun, fake_logprob
from tinker_server import tenants
from tinker_server.checkpoints import META_FILE, CheckpointRef, CheckpointStore
from tinker_server.contract import AdamIn, LoraIn, SampleParamsIn, ServerSettings

MAX_RUNS = 8
MAX_BODY = 1 << 20
CHUNK_LEN = 4  # the server tells the SDK to send at most 4 datums per forward_backward request


@dataclass
class Server:
    url: str
    factory: FakeFactory
    settings: ServerSettings


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    factory = FakeFactory()
    settings = ServerSettings(
        api_keys=(KEY,),
        state_dir=tmp_path_factory.mktemp("tinker") / "state",
        max_runs=MAX_RUNS,
        max_body_bytes=MAX_BODY,
        poll_timeout_s=5.0,
        extra={"client_config": {"fwdbwd_max_chunk_len": CHUNK_LEN}},
    )
    with running_server(settings, factory) as url:
        yield Server(url, factory, settings)
    assert factory.closed and not factory.live  # shutdown closed every run, then the factory


@pytest.fixture(scope="module")
def service(server):
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url + "/api/v1", headers={"X-API-Key": KEY}, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def trainer(service, server) -> tuple[tinker.TrainingClient, FakeRun]:
    client = service.create_lora_training_client(MODEL, rank=8, seed=3).result()
    return client, server.factory.runs[-1]


def batch(n: int, start: int) -> list[types.Datum]:
    """``n`` datums; datum i's tokens start at ``start + i`` (so the fake's log shows the order)."""
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints([start + i, start + i + 1, start + i + 2]),
            loss_fn_inputs={"target_tokens": [start + i + 1, start + i + 2, start + i + 3], "weights": [1.0, 1.0, 0.5]},
        )
        for i in range(n)
    ]


def expected(data: list[types.Datum], step: int) -> tuple[list[np.ndarray], float]:
    """The fake's logprobs per datum and its ``loss:sum``."""
    lps = [fake_logprob(np.asarray(d.loss_fn_inputs["target_tokens"].data, np.float32), step) for d in data]
    loss = sum(float(-(lp * np.asarray(d.loss_fn_inputs["weights"].data)).sum()) for lp, d in zip(lps, data, strict=True))
    return lps, loss


def check_output(out: types.ForwardBackwardOutput, data: list[types.Datum], step: int) -> None:
    lps, loss = expected(data, step)
    assert len(out.loss_fn_outputs) == len(data)
    for got, want in zip(out.loss_fn_outputs, lps, strict=True):
        np.testing.assert_allclose(got["logprobs"].to_numpy(), want, rtol=1e-6)
    assert out.metrics["loss:sum"] == pytest.approx(loss, rel=1e-5)


def user_error(excinfo, *words: str) -> str:
    """The refused request's message; checks the SDK's error shape, category user, and the words."""
    err = excinfo.value
    assert isinstance(err, tinker.APIStatusError), err
    assert err.body["category"] == "user", err.body
    for word in words:
        assert word in err.body["error"], (word, err.body)
    return err.body["error"]


def failed_user_error(excinfo, *words: str) -> None:
    """A failed future (the request was queued, then refused before the run was touched)."""
    err = excinfo.value
    assert err.category == types.RequestErrorCategory.User, err
    for word in words:
        assert word in str(err), (word, str(err))


def raw_error(response: httpx.Response, status: int, *words: str) -> str:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert body["category"] == "user" and set(body) == {"error", "category"}, body
    for word in words:
        assert word in body["error"], (word, body)
    return body["error"]


# ---------------------------------------------------------------------------------- training
def test_forward_backward_forward_and_optim_step_round_trip(trainer):
    client, run = trainer
    info = client.get_info()
    assert (info.model_id, info.lora_rank, info.model_data.model_name) == (client.model_id, 8, MODEL)
    assert client.model_id.endswith(":train:0") and run.lora == LoraIn(rank=8, seed=3)
    data = batch(2, 10)

    check_output(client.forward_backward(data, "cross_entropy").result(), data, step=0)
    assert run.calls[-1] == ("forward_backward", {"loss_fn": "cross_entropy", "config": None, "forward_only": False, "n": 2})
    torch.testing.assert_close(run.datums[-1].tokens, torch.tensor([11, 12, 13]))
    assert run.datums[-1].inputs["weights"].dtype == torch.float32

    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.25}
    check_output(client.forward(data, "ppo", config).result(), data, step=0)
    assert run.calls[-1] == ("forward_backward", {"loss_fn": "ppo", "config": config, "forward_only": True, "n": 2})

    adam = types.AdamParams(learning_rate=2e-4, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.5)
    assert client.optim_step(adam).result().metrics == {"step:max": 1.0}
    assert run.adam[-1] == AdamIn(learning_rate=2e-4, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.5)
    check_output(client.forward(data, "cross_entropy").result(), data, step=1)


def test_two_dimensional_targets_arrive_dense_through_sparse_encoding(trainer):
    client, run = trainer
    targets = torch.zeros(5, 3, dtype=torch.int64)
    targets[1, 2], targets[4, 0] = 7, 9  # mostly zeros: the SDK sends it as sparse CSR
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5]), loss_fn_inputs={"target_tokens": targets})
    assert datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    out = client.forward([datum], "cross_entropy").result()
    torch.testing.assert_close(run.datums[-1].inputs["target_tokens"], targets)
    got = out.loss_fn_outputs[0]["logprobs"]
    assert got.shape == [5, 3]
    np.testing.assert_allclose(got.to_numpy(), fake_logprob(targets.float().numpy(), run.step), rtol=1e-6)


def test_chunked_forward_backward_executes_in_seq_order(trainer):
    client, run = trainer
    data = batch(18, 100)  # 5 requests of <= 4 datums, sent concurrently, the first one last
    before = len(run.calls)
    out = client.forward_backward(data, "cross_entropy").result()
    assert [c[1]["n"] for c in run.calls[before:]] == [4, 4, 4, 4, 2]
    assert [int(d.tokens[0]) for d in run.datums[-18:]] == list(range(100, 118))
    check_output(out, data, step=run.step)


def test_forward_backward_custom_runs_forward_then_weighted_cross_entropy(trainer):
    client, run = trainer
    data = batch(2, 40)

    def loss_fn(data, logprobs_list):
        loss = sum((lp * lp).sum() for lp in logprobs_list)
        return loss, {"custom_sq:sum": float(loss.detach())}

    before = len(run.calls)
    out = client.forward_backward_custom(data, loss_fn).result()
    assert [(c[1]["forward_only"], c[1]["loss_fn"]) for c in run.calls[before:]] == [(True, "cross_entropy"), (False, "cross_entropy")]
    lps, _ = expected(data, run.step)
    for datum, lp in zip(run.datums[-2:], lps, strict=True):  # the backward pass: weights = -dC/dlogprobs = -2 lp
        np.testing.assert_allclose(datum.inputs["weights"].numpy(), -2 * lp, rtol=1e-6)
    assert out.metrics["loss:sum"] == pytest.approx(sum(float((lp * lp).sum()) for lp in lps), rel=1e-5)
    assert "surrogate_loss:sum" in out.metrics and "custom_sq:sum" in out.metrics


def test_save_state_load_state_and_create_from_state(server):
    service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    client = service.create_lora_training_client(MODEL, rank=4, train_unembed=False).result()
    run = server.factory.runs[-1]
    client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    saved = client.save_state("ckpt-a").result()
    assert saved.path == f"tinker://{client.model_id}/weights/ckpt-a"
    assert (Path(server.settings.state_dir) / client.model_id / "weights" / "ckpt-a" / "tinker_checkpoint.json").is_file()
    client.optim_step(types.AdamParams(learning_rate=2e-3)).result()
    assert run.step == 2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # load_state* are deprecated in the SDK, still served
        client.load_state(saved.path).result()
        assert (run.calls[-1][0], run.calls[-1][1]["with_optimizer"], run.step) == ("load_state", False, 1)
        client.load_state_with_optimizer(saved.path).result()
        assert (run.calls[-1][1]["with_optimizer"], [a.learning_rate for a in run.adam]) == (True, [1e-3])

    resumed = service.create_training_client_from_state_with_optimizer(saved.path).result()
    run2 = server.factory.runs[-1]
    assert run2 is not run and run2.lora == LoraIn(rank=4, train_unembed=False)
    assert [(c[0], c[1].get("with_optimizer")) for c in run2.calls] == [("load_state", True)]
    assert resumed.get_info().lora_rank == 4 and resumed.model_id.endswith(":train:1")
    data = batch(1, 7)
    check_output(resumed.forward(data, "cross_entropy").result(), data, step=1)

    fresh = service.create_training_client_from_state(saved.path).result()
    assert server.factory.runs[-1].calls == [
        ("load_state", {"directory": server.factory.runs[-1].calls[0][1]["directory"], "with_optimizer": False})
    ]
    assert fresh.get_info().lora_rank == 4

    with pytest.raises(tinker.BadRequestError) as e:  # refused before it runs; the client goes on
        client.save_state("ckpt-a").result()
    user_error(e, "ckpt-a", "already exists")
    client.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=15)
    service.close("success").result()
    assert run.closed and run2.closed


def test_sampling_snapshot_named_sampler_and_base_model(service, trainer, server):
    client, run = trainer
    step = run.step
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    params = types.SamplingParams(max_tokens=3, seed=11, temperature=0.5, top_k=20, top_p=0.9, stop=["\n"])
    result = sampler.sample(prompt, 2, params).result()
    assert [s.tokens for s in result.sequences] == [[(7 + step + i + k) % VOCAB for k in range(3)] for i in range(2)]
    assert [s.stop_reason for s in result.sequences] == ["length", "length"]
    np.testing.assert_allclose(result.sequences[0].logprobs, [-0.25, -0.5, -0.75])
    assert all(s.sequence_id for s in result.sequences) and result.prompt_logprobs is None
    assert server.factory.log[-1][2]["params"] == SampleParamsIn(
        max_tokens=3, temperature=0.5, top_k=20, top_p=0.9, seed=11, stop_strings=("\n",)
    )

    sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, stop=[13, 14])).result()
    assert server.factory.log[-1][2]["params"] == SampleParamsIn(max_tokens=2, stop_token_ids=(13, 14))

    lps = sampler.compute_logprobs(prompt).result()
    assert lps[0] is None and lps[1:] == pytest.approx([fake_logprob(6, step), fake_logprob(7, step)])
    assert sampler.compute_logprobs(prompt, prompt_logprobs_last_n=1).result()[:2] == [None, None]

    client.optim_step(types.AdamParams(learning_rate=1e-4)).result()  # the snapshot keeps its weights
    assert sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1)).result().sequences[0].tokens == [(7 + step) % VOCAB]

    named = client.save_weights_for_sampler("s1").result()
    assert named.path == f"tinker://{client.model_id}/sampler_weights/s1"
    loaded = service.create_sampling_client(model_path=named.path).result()
    assert loaded.get_base_model() == MODEL
    assert loaded.sample(prompt, 1, types.SamplingParams(max_tokens=1)).result().sequences[0].tokens == [(7 + step + 1) % VOCAB]
    assert server.factory.log[-2][0] == "load_sampler" and server.factory.log[-2][1].name == "s1"

    base = service.create_sampling_client(base_model=MODEL).result()
    assert base.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result().sequences[0].tokens == [7, 8]


def test_snapshots_are_evicted_by_last_use_naming_the_setting(trainer):
    """``server.snapshots_per_model`` (4) unnamed snapshots per run, evicted by last use: a
    snapshot scored every step (a DPO reference, with an evaluator taking a new snapshot every
    step) outlives many later ones, while one unused since is evicted and answered with the
    setting that would have kept it (before: the 5th newer snapshot evicted the reference)."""
    client, _ = trainer
    prompt = types.ModelInput.from_ints([5, 6, 7])
    one = types.SamplingParams(max_tokens=1)
    reference = client.save_weights_and_get_sampling_client().result()
    idle = client.save_weights_and_get_sampling_client().result()
    for _ in range(8):
        reference.compute_logprobs(prompt).result()
        client.save_weights_and_get_sampling_client().result().sample(prompt, 1, one).result()
    assert reference.sample(prompt, 1, one).result().sequences
    with pytest.raises(tinker.BadRequestError) as e:
        idle.sample(prompt, 1, one).result()
    assert "least recently used" in str(e.value) and "server.snapshots_per_model = 4" in str(e.value) and "fix:" in str(e.value)


def test_checkpoint_listing_and_weights_info(server, trainer):
    client, _ = trainer
    client.save_state("listed").result()
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(client.model_id).result().checkpoints}
    assert {"weights/listed", "sampler_weights/s1"} <= set(listed)
    assert listed["weights/listed"].checkpoint_type == "training" and listed["weights/listed"].size_bytes > 0
    assert listed["sampler_weights/s1"].tinker_path == f"tinker://{client.model_id}/sampler_weights/s1"
    run_info = rest.get_training_run(client.model_id).result()
    assert (run_info.base_model, run_info.lora_rank, run_info.last_checkpoint.checkpoint_id) == (MODEL, 8, "weights/listed")
    assert client.model_id in [r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs]
    info = rest.get_weights_info_by_tinker_path(listed["weights/listed"].tinker_path).result()
    assert (info.base_model, info.lora_rank, info.is_lora) == (MODEL, 8, True)
    assert [m.model_name for m in rest.get_server_capabilities().result().supported_models] == [MODEL, OTHER]
    rest.delete_checkpoint(client.model_id, "weights/listed").result()
    assert "weights/listed" not in {c.checkpoint_id for c in rest.list_checkpoints(client.model_id).result().checkpoints}


# ---------------------------------------------------------------------------------- refusals
def test_unknown_api_key_is_refused_with_401(server, http):
    response = httpx.post(server.url + "/api/v1/client/config", json={"sdk_version": "x"}, headers={"X-API-Key": "tml-wrong"})
    raw_error(response, 401, "X-API-Key")
    runs = len(server.factory.runs)
    with pytest.raises(tinker.AuthenticationError) as e:
        tinker.ServiceClient(base_url=server.url, api_key="tml-wrong").create_lora_training_client(MODEL).result()
    user_error(e, "X-API-Key")
    assert len(server.factory.runs) == runs
    assert http.get("/healthz").json() == {"status": "ok"}


def test_unknown_base_model_names_the_served_ones(service, server):
    runs = len(server.factory.runs)
    with pytest.raises(tinker.BadRequestError) as e:
        service.create_lora_training_client("nope/model").result()
    user_error(e, "base_model", "'nope/model'", MODEL)
    assert len(server.factory.runs) == runs


def test_refused_losses_and_bad_values_leave_the_run_untouched(trainer):
    client, run = trainer
    calls, adam = list(run.calls), list(run.adam)
    for loss, why in (("stable_reinforce", "loss_fn='importance_sampling'"), ("custom", "client-side")):
        with pytest.raises(tinker.BadRequestError) as e:
            client.forward_backward(batch(1, 3), loss).result()
        user_error(e, "loss_fn", loss, why)
    with pytest.raises(tinker.BadRequestError) as e:
        client.optim_step(types.AdamParams(learning_rate=-1.0)).result()
    user_error(e, "adam_params.learning_rate", "-1.0")
    with pytest.raises(tinker.BadRequestError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        client.load_state(f"tinker://{client.model_id}/weights/../../../etc").result()
    user_error(e, "path", "..")
    assert (run.calls, run.adam) == (calls, adam)
    data = batch(1, 3)  # each refused request used up its seq_id: the next one runs
    check_output(client.forward(data, "cross_entropy").result(timeout=15), data, step=run.step)


def test_bad_paths_are_refused(service, server):
    runs = len(server.factory.runs)
    bad = {  # path -> the part the message names
        "tinker://../weights/x": "'..' is not a model id",
        "tinker://abc:train:0/weights/..": "'..' is not a valid checkpoint name",
        "/etc/passwd": "'/etc/passwd' is not a checkpoint path",
        "tinker://abc:train:0/weights/a/b": "'tinker://abc:train:0/weights/a/b' is not a checkpoint path",
    }
    for path, named in bad.items():
        with pytest.raises(tinker.BadRequestError) as e:
            service.create_training_client_from_state(path).result()
        user_error(e, "path: ", named)
    with pytest.raises(tinker.BadRequestError) as e:
        service.create_sampling_client(model_path="tinker://abc:train:0/sampler_weights/..").result()
    user_error(e, "model_path")
    with pytest.raises(tinker.BadRequestError) as e:
        service.create_sampling_client(model_path="tinker://abc:train:0/sampler_weights/missing").result()
    user_error(e, "model_path", "does not exist")
    assert len(server.factory.runs) == runs and not any(
        name == "load_sampler" and "missing" in str(src) for name, src, _, _ in server.factory.log
    )


def _fb_request(model_id: str, seq_id: int, data: list[types.Datum], loss_fn: str = "cross_entropy") -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"), model_id=model_id, seq_id=seq_id
    )
    msg = forward_backward_request_to_proto(request)
    msg.loss_fn = loss_fn
    return msg.SerializeToString()


def test_raw_requests_the_sdk_would_not_send(service, server, http):
    client = service.create_lora_training_client(MODEL, rank=2).result()  # driven by raw requests from here on
    run = server.factory.runs[-1]
    proto = {"Content-Type": "application/x-protobuf"}
    data = batch(1, 20)
    raw_error(
        http.post("/forward_backward", content=_fb_request(client.model_id, 1, data, "hinge"), headers=proto),
        400,
        "loss_fn",
        "'hinge'",
        "cross_entropy",
    )
    image = pb.ForwardBackwardRequest.FromString(_fb_request(client.model_id, 2, data))
    image.data[0].model_input[0].ClearField("encoded_text")
    image.data[0].model_input[0].image.data = b"\x89PNG"
    raw_error(http.post("/forward_backward", content=image.SerializeToString(), headers=proto), 400, "data[0].model_input[0]", "'image'")
    short = [types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [1, 2, 3]})]
    raw_error(
        http.post("/forward_backward", content=_fb_request(client.model_id, 3, short), headers=proto),
        400,
        "target_tokens",
        "[3]",
        "2 tokens",
    )
    raw_error(http.post("/forward_backward", content=b"\xff" * (MAX_BODY + 1), headers=proto), 413, "server.max_body_mb")
    raw_error(
        http.post("/forward_backward", content=iter([b"\xff" * MAX_BODY, b"\xff"]), headers=proto), 413, "server.max_body_mb"
    )  # chunked
    raw_error(http.post("/forward_backward", json={"model_id": client.model_id}), 400, "protobuf")
    assert run.calls == []

    answer = http.post("/forward_backward", content=_fb_request(client.model_id, 4, data), headers=proto).json()
    assert answer["model_id"] == client.model_id
    # A re-sent request (the SDK retries after a dropped connection) gets the same future.
    assert http.post("/forward_backward", content=_fb_request(client.model_id, 4, data), headers=proto).json() == answer
    result = http.post("/retrieve_future", json={"request_id": answer["request_id"]}, headers={"Accept": "application/x-protobuf"})
    assert result.status_code == 200 and "try_again" not in result.text, result.text  # held open until done, not try_again
    assert result.headers["content-type"] == "application/x-protobuf"
    check_output(deserialize_forward_backward_output(result.content), data, step=0)
    assert [c[0] for c in run.calls] == ["forward_backward"]

    # seq 6 arrives before seq 5: it waits for it, and a poll for its result is held open meanwhile.
    later = http.post("/forward_backward", content=_fb_request(client.model_id, 6, batch(1, 60)), headers=proto).json()
    send_5 = threading.Timer(
        0.3,
        httpx.post,
        [http.base_url.join("forward_backward")],
        {"content": _fb_request(client.model_id, 5, batch(1, 50)), "headers": {**proto, "X-API-Key": KEY}},
    )
    start = time.monotonic()
    send_5.start()
    result = http.post("/retrieve_future", json={"request_id": later["request_id"]})
    send_5.join()
    assert result.headers["content-type"] == "application/x-protobuf" and 0.25 < time.monotonic() - start < server.settings.poll_timeout_s
    assert [int(d.tokens[0]) for d in run.datums] == [20, 50, 60]
    zstd = {**proto, "Content-Encoding": "zstd"}
    packed = zstandard.ZstdCompressor().compress(_fb_request(client.model_id, 7, batch(1, 70)))
    answer = http.post("/forward_backward", content=packed, headers=zstd).json()
    assert http.post("/retrieve_future", json={"request_id": answer["request_id"]}).status_code == 200
    assert int(run.datums[-1].tokens[0]) == 70
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (MAX_BODY + 1))  # small on the wire, too large inflated
    raw_error(http.post("/forward_backward", content=bomb, headers=zstd), 413, "server.max_body_mb")

    raw_error(http.post("/retrieve_future", json={"request_id": "nope-1"}), 410, "request_id", "'nope-1'")
    raw_error(http.post("/get_info", json={"model_id": "abc:train:7"}), 404, "model_id", "abc:train:7")
    raw_error(http.post("/get_info", json={}), 400, "model_id", "missing")
    raw_error(http.post("/create_custom_loss", json={}), 400, "client-side")
    prompt = {"chunks": [{"type": "image", "data": "AA==", "format": "png"}]}
    raw_error(
        http.post("/asample", json={"base_model": MODEL, "prompt": prompt, "sampling_params": {}}), 400, "prompt.chunks[0]", "'image'"
    )
    text = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
    raw_error(
        http.post("/asample", json={"base_model": MODEL, "prompt": text, "sampling_params": {}, "topk_prompt_logprobs": 3}),
        400,
        "topk_prompt_logprobs",
    )

    unload = http.post("/unload_model", json={"model_id": client.model_id}).json()
    assert http.post("/retrieve_future", json={"request_id": unload["request_id"]}).json() == {
        "model_id": client.model_id,
        "type": "unload_model",
    }
    assert run.closed
    raw_error(http.post("/get_info", json={"model_id": client.model_id}), 400, "closed")


def test_too_many_runs_is_refused_until_a_session_finishes(server):
    service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    mine = [service.create_lora_training_client(MODEL, rank=1).result() for _ in range(MAX_RUNS - len(server.factory.live))]
    runs = len(server.factory.runs)
    with pytest.raises(tinker.BadRequestError) as e:
        service.create_lora_training_client(MODEL, rank=1).result()
    user_error(e, f"max_runs={MAX_RUNS}", "finish a session", "unload")
    assert len(server.factory.runs) == runs
    service.close("success").result()
    assert len(mine) >= 1 and all(r.closed for r in server.factory.runs[-len(mine) :])
    other = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    other.create_lora_training_client(MODEL, rank=1).result()
    other.close("success").result()


def test_finished_session_closes_runs_and_samplers(server, http):
    service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    client = service.create_lora_training_client(MODEL, rank=1).result()
    sampler = client.save_weights_and_get_sampling_client().result()
    run = server.factory.runs[-1]
    session_id = client.model_id.split(":")[0]
    service.close("success").result()
    assert run.closed
    raw_error(http.post("/session_heartbeat", json={"session_id": session_id}), 410, "finished")
    raw_error(http.post("/get_info", json={"model_id": client.model_id}), 400, "closed")
    sample = {
        "sampling_session_id": sampler._sampling_session_id,
        "seq_id": 9,
        "prompt": {"chunks": [{"tokens": [1]}]},
        "sampling_params": {},
    }
    raw_error(http.post("/asample", json=sample), 400, "finished")


# ---------------------------------------------------------------------------------- issue 53
def _ppo(n: int, **extra) -> list[types.Datum]:
    inputs = {"target_tokens": [1] * n, "logprobs": [-1.0] * n, "advantages": [1.0] * n, **extra}
    return [types.Datum(model_input=types.ModelInput.from_ints(list(range(1, n + 1))), loss_fn_inputs=inputs)]


def test_loss_values_per_token_are_checked_like_the_config(trainer):
    """Inverted per-token clip thresholds (alone, or against the config's other bound) and DRO with
    beta < 0 are refused as their loss_fn_config forms are, naming datum, position and fix."""
    client, run = trainer
    calls = list(run.calls)
    cases = [
        (_ppo(3, clip_low_threshold=[0.8, 2.0, 0.8], clip_high_threshold=[1.2, 0.5, 1.2]), "ppo", None, "position 1"),
        (_ppo(2, clip_low_threshold=[1.5, 0.8]), "cispo", None, "position 0"),  # above the default high 1.2
        (_ppo(2, clip_high_threshold=[-0.5, 1.2]), "gspo", {"clip_low_threshold": 0.0}, "position 0"),
    ]
    for data, loss, config, where in cases:
        with pytest.raises(tinker.RequestFailedError) as e:
            client.forward(data, loss, config).result()
        failed_user_error(e, "data[0].loss_fn_inputs", "clip_", where, "fix: clip_low_threshold <= 1 <= clip_high_threshold")
    with pytest.raises(tinker.RequestFailedError) as e:
        client.forward(_ppo(2), "dro", {"beta": -1.0}).result()
    failed_user_error(e, "loss_fn_config", "beta = -1", "fix")
    assert run.calls == calls


def test_a_run_from_a_checkpoint_keeps_its_base_model(service, trainer, server, http):
    """create_training_client_from_state with another base_model (same shapes, other weights) is
    refused naming both; the checkpoint's own name is accepted."""
    client, _ = trainer
    path = client.save_state("base-check").result().path
    runs = len(server.factory.runs)
    session_id = client.model_id.split(":")[0]
    body = {"session_id": session_id, "model_seq_id": 90, "path": path, "optimizer": False, "base_model": OTHER}
    raw_error(http.post("/load_weights", json=body), 400, "base_model", repr(OTHER), repr(MODEL), "fix: omit base_model")
    assert len(server.factory.runs) == runs
    answer = http.post("/load_weights", json=body | {"base_model": MODEL}).json()
    assert http.post("/retrieve_future", json={"request_id": answer["request_id"]}).json()["model_id"].endswith(":train:90")
    assert server.factory.runs[-1].base_model == MODEL
    http.post("/unload_model", json={"model_id": answer["model_id"]})


def test_a_sampler_checkpoint_serves_what_is_on_disk_now(service, trainer, server):
    """A deleted sampler checkpoint no longer samples; one saved again under the same name samples
    the new weights (the loaded-sampler cache is keyed by the file on disk)."""
    client, run = trainer
    prompt, params = types.ModelInput.from_ints([5]), types.SamplingParams(max_tokens=1)
    path = client.save_weights_for_sampler("again").result().path
    sampler = service.create_sampling_client(model_path=path).result()
    assert sampler.sample(prompt, 1, params).result().sequences[0].tokens == [(5 + run.step) % VOCAB]
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    rest.delete_checkpoint(client.model_id, "sampler_weights/again").result()
    with pytest.raises(tinker.RequestFailedError, match="does not exist"):
        sampler.sample(prompt, 1, params).result()
    client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    assert client.save_weights_for_sampler("again").result().path == path
    assert sampler.sample(prompt, 1, params).result().sequences[0].tokens == [(5 + run.step) % VOCAB]


def test_a_failed_overwrite_keeps_the_checkpoint_it_would_replace(trainer, server):
    """save_state(overwrite=True) that fails half way (a full disk) leaves the old checkpoint whole
    and loadable, and no partial directory behind."""
    client, run = trainer
    path = client.save_state("keep").result().path
    where = Path(server.settings.state_dir) / client.model_id / "weights"
    before = sorted(p.name for p in (where / "keep").iterdir())
    server.factory.fail_saves = True
    try:
        with pytest.raises(tinker.RequestFailedError, match="No space left"):
            client.save_state("keep", overwrite=True).result()
    finally:
        server.factory.fail_saves = False
    assert sorted(p.name for p in (where / "keep").iterdir()) == before
    assert not [p for p in where.iterdir() if p.name.startswith(".")]  # the staging directory is gone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        client.load_state(path).result()
    assert run.calls[-1][0] == "load_state"
    client.save_state("keep", overwrite=True).result()  # a save that succeeds replaces it
    assert sorted(p.name for p in (where / "keep").iterdir()) == before


def test_small_refusals_name_the_field(trainer, server, http):
    """A checkpoint name with a newline, ttl_seconds out of range (negative, 1e400), a learning rate
    of 1e30, a JSON body nested 100,000 deep: each a user error naming the field, nothing reaching
    the run."""
    client, run = trainer
    calls = list(run.calls)
    with pytest.raises(tinker.BadRequestError) as e:
        client.save_state("name\n").result()
    user_error(e, "path", "not a valid checkpoint name")
    for ttl in (-5, 10**400):
        with pytest.raises(tinker.BadRequestError) as e:
            client.save_state("ttl", ttl_seconds=ttl).result()
        user_error(e, "ttl_seconds", "fix")
    with pytest.raises(tinker.BadRequestError) as e:  # finite, so the engine's non-finite check would not see it
        client.optim_step(types.AdamParams(learning_rate=1e30)).result()
    user_error(e, "learning_rate", "fix")
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ("/create_session", "/optim_step"):
        raw_error(http.post(path, content=deep, headers={"Content-Type": "application/json"}), 400, "nests", "deep")
    assert run.calls == calls
    assert not (Path(server.settings.state_dir) / client.model_id / "weights" / "name\n").exists()


def test_sparse_tensors_are_bounded_by_the_body_limit(service, server, http):
    """A small request whose sparse CSR tensor would inflate past the body limit is refused before
    any tensor is built, naming the limit's key; so is an unknown input name."""
    client = service.create_lora_training_client(MODEL, rank=1).result()  # driven by raw requests
    run = server.factory.runs[-1]
    proto = {"Content-Type": "application/x-protobuf"}
    unknown = pb.ForwardBackwardRequest.FromString(_fb_request(client.model_id, 1, batch(1, 3)))
    unknown.data[0].loss_fn_inputs["nosuch"].CopyFrom(unknown.data[0].loss_fn_inputs["weights"])
    raw_error(http.post("/forward_backward", content=unknown.SerializeToString(), headers=proto), 400, "'nosuch'", "not an input")
    msg = pb.ForwardBackwardRequest.FromString(_fb_request(client.model_id, 2, batch(1, 3)))
    target = msg.data[0].loss_fn_inputs["target_tokens"]
    target.ClearField("dense")
    del target.shape[:]
    target.shape.extend([3, MAX_BODY // 8])  # 3 rows x (1 MiB / 8) int64 columns: 3 MiB dense from a few bytes
    target.sparse_csr.crow_indices = np.array([0, 1, 1, 1], np.int64).tobytes()
    target.sparse_csr.col_indices = np.array([0], np.int64).tobytes()
    target.sparse_csr.values = np.array([5], np.int64).tobytes()
    assert len(msg.SerializeToString()) < 200
    raw_error(http.post("/forward_backward", content=msg.SerializeToString(), headers=proto), 400, "sparse shape", "server.max_body_mb")
    assert run.calls == []
    http.post("/unload_model", json={"model_id": client.model_id})


def test_sampling_is_bounded_and_cancel_future_cancels(service, server, http):
    """num_samples and max_tokens past the server's limits are refused naming the keys; a queued
    sample cancelled with cancel_future never runs, and the next one is served."""
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
    base = {"base_model": MODEL, "prompt": prompt}
    raw_error(http.post("/asample", json=base | {"sampling_params": {"max_tokens": 10**9}}), 400, "max_tokens", "server.max_sample_tokens")
    raw_error(
        http.post("/asample", json=base | {"num_samples": 20000, "sampling_params": {}}), 400, "num_samples", "server.max_num_samples"
    )
    raw_error(
        http.post("/asample", json=base | {"sampling_params": {}, "record_stability_info": True}),
        400,
        "stable_reinforce",
        "importance_sampling",
    )
    samples = len([c for c in server.factory.log if c[0] == "sample"])
    server.factory.hold = threading.Event()
    try:
        first = http.post("/asample", json=base | {"sampling_params": {"max_tokens": 1}}).json()
        queued = http.post("/asample", json=base | {"sampling_params": {"max_tokens": 2}}).json()
        assert http.post("/cancel_future", json={"request_id": queued["request_id"]}).status_code == 200
    finally:
        server.factory.hold.set()
        server.factory.hold = None
    assert http.post("/retrieve_future", json={"request_id": first["request_id"]}).status_code == 200
    assert http.post("/retrieve_future", json={"request_id": queued["request_id"]}).json() == {
        "error": f"request {queued['request_id']} was cancelled by the client",
        "category": "user",
    }
    after = http.post("/asample", json=base | {"sampling_params": {"max_tokens": 3}}).json()
    assert http.post("/retrieve_future", json={"request_id": after["request_id"]}).status_code == 200
    ran = [c[2]["params"].max_tokens for c in server.factory.log if c[0] == "sample"][samples:]
    assert ran == [1, 3]  # the cancelled one (2) never ran


def test_a_silent_client_frees_its_run_after_session_timeout(tmp_path):
    """A client that stopped heartbeating (its process exited without close()) holds its run only
    for server.session_timeout_s (default 60 s, documented), and the max_runs refusal says so."""
    settings = ServerSettings(api_keys=(KEY,), state_dir=tmp_path, max_runs=1, session_timeout_s=0.5)
    assert ServerSettings().session_timeout_s <= 60
    with running_server(settings, FakeFactory()) as url, httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": KEY}) as http:

        def create(seq: int) -> httpx.Response:
            session = http.post("/create_session", json={}).json()["session_id"]
            body = {"session_id": session, "model_seq_id": seq, "base_model": MODEL, "lora_config": {"rank": 1}}
            return http.post("/create_model", json=body)

        assert create(0).status_code == 200  # a session that never heartbeats again
        refused = create(0)
        raw_error(refused, 400, "max_runs=1", "server.session_timeout_s", "0.5 s")
        time.sleep(1.0)
        answer = create(0)
        assert answer.status_code == 200, answer.text
        for session in http.get("/sessions").json()["sessions"]:
            http.post(f"/sessions/{session}/finish", json={})


def test_every_training_side_call_ran_on_one_worker_thread(server):
    threads = {tid for _, _, _, tid in server.factory.log}
    assert len(threads) == 1 and threading.get_ident() not in threads


# ---------------------------------------------------------------------------------- tenants
def test_each_key_owns_its_runs_futures_samplers_and_checkpoints(tmp_path):
    """Two keys on one server (``server.tenants``, on): key B finds nothing of key A's (sessions,
    runs, futures, samplers, checkpoints), each request answered as for an id that does not
    exist, and A's run is untouched by B's tries; after a restart too (the owner is recorded on
    disk, as a tag); with ``tenants=false`` B reaches A's checkpoint."""
    other = "tml-other"
    factory = FakeFactory()
    settings = ServerSettings(api_keys=(KEY, other), state_dir=tmp_path / "state", max_runs=4)
    with running_server(settings, factory) as url:
        a = tinker.ServiceClient(base_url=url, api_key=KEY)
        b = tinker.ServiceClient(base_url=url, api_key=other)
        client = a.create_lora_training_client(MODEL, rank=4).result()
        run = factory.runs[-1]
        client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        state = client.save_state("a1").result().path
        sampler_path = client.save_weights_for_sampler("s-a").result().path
        mine = b.create_lora_training_client(MODEL, rank=4).result()  # B's own run works alongside
        with pytest.raises(tinker.BadRequestError) as e:
            b.create_training_client_from_state_with_optimizer(state).result()
        user_error(e, state, "does not exist")
        with pytest.raises(tinker.BadRequestError) as e:
            b.create_sampling_client(model_path=sampler_path).result()
        user_error(e, sampler_path, "does not exist")
        rest_b = tinker.RestClient(base_url=url, api_key=other)
        assert client.model_id not in [r.training_run_id for r in rest_b.list_training_runs(limit=100).result().training_runs]
        assert mine.model_id in [r.training_run_id for r in rest_b.list_training_runs(limit=100).result().training_runs]
        assert all(client.model_id not in c.tinker_path for c in rest_b.list_user_checkpoints().result().checkpoints)
        with (
            httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": other}) as http_b,
            httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": KEY}) as http_a,
        ):
            raw_error(http_b.get(f"/training_runs/{client.model_id}"), 404, "unknown training run")
            raw_error(http_b.get(f"/training_runs/{client.model_id}/checkpoints"), 404, "unknown training run")
            raw_error(http_b.delete(f"/training_runs/{client.model_id}/checkpoints/weights/a1"), 400, "does not exist")
            raw_error(http_b.post("/weights_info", json={"tinker_path": state}), 400, "does not exist")
            adam = {"model_id": client.model_id, "seq_id": 99, "adam_params": {"learning_rate": 1.0}}
            raw_error(http_b.post("/optim_step", json=adam), 404, "unknown model")
            raw_error(http_b.post("/unload_model", json={"model_id": client.model_id}), 404, "unknown model")
            session_a = client.model_id.split(":")[0]
            raw_error(http_b.post("/session_heartbeat", json={"session_id": session_a}), 404, "unknown session")
            assert session_a not in http_b.get("/sessions", params={"limit": 1000}).json()["sessions"]
            raw_error(http_b.get(f"/sessions/{session_a}"), 404, "unknown session")
            prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}
            asked = http_a.post("/asample", json={"base_model": MODEL, "prompt": prompt, "sampling_params": {"max_tokens": 1}}).json()
            raw_error(http_b.post("/retrieve_future", json={"request_id": asked["request_id"]}), 410, "unknown or expired")
            raw_error(http_b.post("/cancel_future", json={"request_id": asked["request_id"]}), 404, "unknown or expired")
            assert http_a.post("/retrieve_future", json={"request_id": asked["request_id"]}).status_code == 200
        assert (run.step, run.closed) == (1, False)  # A's run as it was
        assert client.save_state("a2").result().path.endswith("/a2")  # and A goes on
        a.close("success").result()
        b.close("success").result()
    with running_server(settings, FakeFactory()) as url:  # restarted: the owner is on disk (run.json), not only in memory
        b = tinker.ServiceClient(base_url=url, api_key=other)
        with pytest.raises(tinker.BadRequestError) as e:
            b.create_training_client_from_state(state).result()
        user_error(e, "does not exist")
        b.close("success").result()
    assert KEY not in (tmp_path / "state" / client.model_id / "run.json").read_text()  # a tag, never the key
    shared = ServerSettings(api_keys=(KEY, other), state_dir=tmp_path / "state", max_runs=4, tenants=False)
    with running_server(shared, FakeFactory()) as url:
        b = tinker.ServiceClient(base_url=url, api_key=other)
        b.create_training_client_from_state_with_optimizer(state).result()  # tenants off: every key reaches every run
        b.close("success").result()


# ---------------------------------------------------------------------------------- issue 60
OTHER_KEY = "tml-other"


def _run_ids(url: str, key: str) -> set[str]:
    rest = tinker.RestClient(base_url=url, api_key=key)
    return {r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs}


def test_the_creating_key_owns_its_runs_whatever_the_server_had(tmp_path, caplog):
    """A run created while the server had one key is recorded as that key's (its tag in run.json):
    once a second key is added, that key cannot list, load or delete it. A run record of the older
    ownerless format belongs to no key (left out of listings, its checkpoints refused naming
    server.ownerless_runs_owner) until the operator assigns it with that setting. A damaged
    run.json is skipped in every key's listing and logged naming the file."""
    state = tmp_path / "state"
    with running_server(ServerSettings(api_keys=(KEY,), state_dir=state), FakeFactory()) as url:
        a = tinker.ServiceClient(base_url=url, api_key=KEY)
        client = a.create_lora_training_client(MODEL, rank=4).result()
        path = client.save_state("one-key").result().path
        a.close("success").result()
    record = json.loads((state / client.model_id / "run.json").read_text())
    assert record["owner"] == tenants.tag_of(KEY) and KEY not in json.dumps(record)
    legacy = "legacy0000:train:0"  # a record as a server before issue 60 wrote it: no owner
    shutil.copytree(state / client.model_id, state / legacy)
    (state / legacy / "run.json").write_text(json.dumps({k: v for k, v in record.items() if k != "owner"} | {"model_id": legacy}))
    legacy_path = f"tinker://{legacy}/weights/one-key"
    damaged = state / "damaged000:train:0" / "run.json"
    damaged.parent.mkdir()
    damaged.write_text("{not json")
    caplog.set_level(logging.WARNING, logger="tinker_server")
    with running_server(ServerSettings(api_keys=(KEY, OTHER_KEY), state_dir=state), FakeFactory()) as url:
        assert _run_ids(url, OTHER_KEY) == set()  # (a listing despite the damaged record)
        assert _run_ids(url, KEY) == {client.model_id}
        a = tinker.ServiceClient(base_url=url, api_key=KEY)
        b = tinker.ServiceClient(base_url=url, api_key=OTHER_KEY)
        with pytest.raises(tinker.BadRequestError) as e:
            b.create_training_client_from_state(path).result()
        user_error(e, "does not exist")
        with httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": OTHER_KEY}) as http_b:
            raw_error(http_b.delete(f"/training_runs/{client.model_id}/checkpoints/weights/one-key"), 400, "does not exist")
        for service in (a, b):
            with pytest.raises(tinker.BadRequestError) as e:
                service.create_training_client_from_state(legacy_path).result()
            user_error(e, legacy, "without an owner", "server.ownerless_runs_owner")
        a.create_training_client_from_state(path).result()  # the key's own run loads
        a.close("success").result()
        b.close("success").result()
    assert (state / client.model_id / "weights" / "one-key" / META_FILE).is_file()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(damaged) in m for m in warned), warned
    assert any(legacy in m and "server.ownerless_runs_owner" in m for m in warned), warned
    assigned = ServerSettings(api_keys=(KEY, OTHER_KEY), state_dir=state, ownerless_runs_owner=KEY)
    with running_server(assigned, FakeFactory()) as url:
        assert {client.model_id, legacy} <= _run_ids(url, KEY) and not _run_ids(url, OTHER_KEY)
        b = tinker.ServiceClient(base_url=url, api_key=OTHER_KEY)
        with pytest.raises(tinker.BadRequestError) as e:
            b.create_training_client_from_state(legacy_path).result()
        user_error(e, "does not exist")
        b.close("success").result()
        a = tinker.ServiceClient(base_url=url, api_key=KEY)
        a.create_training_client_from_state(legacy_path).result()
        a.close("success").result()


def test_cancel_future_refuses_a_started_call_which_keeps_its_outcome(service, server, http):
    """cancel_future of a forward_backward the worker is running is refused as a user error (its
    gradients are in the run and reach the next optim_step) and its future keeps the call's real
    result; the call queued behind it, cancelled, never runs; a finished call's cancel is refused."""
    client = service.create_lora_training_client(MODEL, rank=1).result()  # driven by raw requests
    run = server.factory.runs[-1]
    proto = {"Content-Type": "application/x-protobuf"}
    started_data, queued_data = batch(1, 30), batch(1, 80)
    server.factory.hold, server.factory.entered = threading.Event(), threading.Event()
    try:
        started = http.post("/forward_backward", content=_fb_request(client.model_id, 1, started_data), headers=proto).json()
        assert server.factory.entered.wait(10)  # the worker is inside the call
        queued = http.post("/forward_backward", content=_fb_request(client.model_id, 2, queued_data), headers=proto).json()
        refused = http.post("/cancel_future", json={"request_id": started["request_id"]})
        raw_error(refused, 400, "already started", "cannot be cancelled", "next optim_step", "retrieve_future")
        assert http.post("/cancel_future", json={"request_id": queued["request_id"]}).status_code == 200
    finally:
        server.factory.hold.set()
        server.factory.hold = None
    result = http.post("/retrieve_future", json={"request_id": started["request_id"]})
    assert result.headers["content-type"] == "application/x-protobuf", result.text
    check_output(deserialize_forward_backward_output(result.content), started_data, step=0)
    cancelled = http.post("/retrieve_future", json={"request_id": queued["request_id"]}).json()
    assert cancelled == {"error": f"request {queued['request_id']} was cancelled by the client", "category": "user"}
    raw_error(http.post("/cancel_future", json={"request_id": started["request_id"]}), 400, "already finished")
    step = http.post("/optim_step", json={"model_id": client.model_id, "seq_id": 3, "adam_params": {"learning_rate": 1e-3}}).json()
    assert http.post("/retrieve_future", json={"request_id": step["request_id"]}).status_code == 200
    assert [c[0] for c in run.calls] == ["forward_backward", "optim_step"]
    assert [int(d.tokens[0]) for d in run.datums] == [30]  # the started call trained; the cancelled one never ran
    http.post("/unload_model", json={"model_id": client.model_id})


def test_each_key_has_its_own_limits_and_a_fair_turn(tmp_path):
    """Two keys. Key A opens 12 sampling sessions and queues a sample in each while the worker is
    busy, key B one: B's runs right after the call the worker was in, not after A's 11 others (the
    worker serves keys round-robin, then each key's queues). A's 13th sampling session and 3rd run
    are refused naming server.max_sampling_sessions_per_key / server.max_runs_per_key, while B
    still opens and creates; A's runs are untouched by the refusals."""
    factory = FakeFactory()
    settings = ServerSettings(
        api_keys=(KEY, OTHER_KEY), state_dir=tmp_path, max_runs=8, max_runs_per_key=2, max_sampling_sessions_per_key=12
    )
    with (
        running_server(settings, factory) as url,
        httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": KEY}, timeout=30) as http_a,
        httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": OTHER_KEY}, timeout=30) as http_b,
    ):
        session = {h: h.post("/create_session", json={}).json()["session_id"] for h in (http_a, http_b)}

        def open_sampler(h: httpx.Client, seq: int) -> httpx.Response:
            return h.post("/create_sampling_session", json={"session_id": session[h], "sampling_session_seq_id": seq, "base_model": MODEL})

        def sample(h: httpx.Client, sid: str, token: int) -> str:
            body = {"sampling_session_id": sid, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [token]}]}, "sampling_params": {"max_tokens": 1}}  # fmt: skip
            return h.post("/asample", json=body).json()["request_id"]

        mine = [open_sampler(http_a, i).json()["sampling_session_id"] for i in range(12)]
        raw_error(open_sampler(http_a, 12), 400, "server.max_sampling_sessions_per_key=12", "fix")
        theirs = open_sampler(http_b, 0).json()["sampling_session_id"]
        factory.hold = threading.Event()
        try:
            asked = [(http_a, sample(http_a, mine[0], 100))]
            assert factory.entered.wait(10)  # the worker is in A's first sample
            asked += [(http_a, sample(http_a, sid, 100 + i)) for i, sid in enumerate(mine[1:], 1)]
            asked.append((http_b, sample(http_b, theirs, 999)))
        finally:
            factory.hold.set()
            factory.hold = None
        for h, request_id in asked:
            assert h.post("/retrieve_future", json={"request_id": request_id}).status_code == 200
        order = [c[2]["prompt"][0] for c in factory.log if c[0] == "sample"]
        assert len(order) == 13 and order.index(999) == 1, order

        def create(h: httpx.Client, seq: int) -> httpx.Response:
            body = {"session_id": session[h], "model_seq_id": seq, "base_model": MODEL, "lora_config": {"rank": 1}}
            answer = h.post("/create_model", json=body)
            if answer.status_code == 200:
                assert h.post("/retrieve_future", json={"request_id": answer.json()["request_id"]}).status_code == 200
            return answer

        assert [create(http_a, i).status_code for i in range(2)] == [200, 200]
        a_runs = list(factory.live)
        raw_error(create(http_a, 2), 400, "server.max_runs_per_key=2", "unload")
        assert create(http_b, 0).status_code == 200
        assert len(factory.runs) == 3 and all(r.calls == [] and not r.closed for r in a_runs)
        for h in (http_a, http_b):
            h.post(f"/sessions/{session[h]}/finish", json={})


def test_loading_a_checkpoint_of_other_lora_targets_is_a_user_error(service, trainer, server):
    """load_state of a checkpoint whose adapters are on other layers (a run made with
    train_unembed=False) into a run adapting attention, MLP and lm_head: a user error naming both
    target sets and the fix, before anything reaches the run."""
    client, run = trainer
    narrow = service.create_lora_training_client(MODEL, rank=run.lora.rank, train_unembed=False).result()
    path = narrow.save_state("narrow").result().path
    calls = list(run.calls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(tinker.BadRequestError) as e:
            client.load_state(path).result()
    user_error(
        e,
        "the attention projections and the MLP projections (train_attn=True, train_mlp=True, train_unembed=False)",
        "the attention projections and the MLP projections and lm_head (train_attn=True, train_mlp=True, train_unembed=True)",
        "fix: create_training_client_from_state",
    )
    assert run.calls == calls
    httpx.post(f"{server.url}/api/v1/unload_model", json={"model_id": narrow.model_id}, headers={"X-API-Key": KEY})


def test_a_save_cut_short_by_a_killed_server_is_cleaned_at_start(tmp_path):
    """What a server SIGKILLed mid-save leaves under its state_dir, settled when the next one
    starts: a staging directory removed, a checkpoint moved aside for an overwrite whose
    replacement never arrived put back, one whose replacement is in place removed. Committed
    checkpoints stay; symbolic links (a link named like a staging directory, a linked run
    directory) are neither followed nor removed, and what they point to outside is untouched."""
    state, outside = tmp_path / "state", tmp_path / "outside"
    store = CheckpointStore(state)
    model_id, lora = "killed0000:train:0", LoraIn(rank=4)
    store.write_run(model_id, MODEL, lora, None, owner=tenants.tag_of(KEY))

    def committed(name: str) -> Path:  # a complete checkpoint, saved as the server saves
        ref = CheckpointRef(model_id, "weights", name)
        staging = store.begin(ref, False)
        (staging / "fake_state.json").write_text(json.dumps({"step": 0, "lora_rank": 4, "adam": []}))
        store.commit(ref, staging, MODEL, lora, with_optimizer=True, user_metadata=None, ttl_seconds=None)
        return store.directory(ref)

    keep, moved = committed("keep"), committed("moved")
    weights = keep.parent
    cut = store.begin(CheckpointRef(model_id, "weights", "cut"), False)  # killed while writing
    (cut / "partial").write_text("half a checkpoint")
    os.replace(moved, weights / ".moved.replaced-0123abcd")  # killed between the two renames of an overwrite
    shutil.copytree(keep, weights / ".keep.replaced-89abcdef")  # killed after the swap, before the old one went
    (outside / "weights" / ".x.saving-00000000").mkdir(parents=True)
    (outside / "precious").write_text("not the server's")
    (weights / ".evil.saving-deadbeef").symlink_to(outside, target_is_directory=True)
    (state / "linked0000:train:0").symlink_to(outside, target_is_directory=True)
    with running_server(ServerSettings(api_keys=(KEY,), state_dir=state), FakeFactory()) as url:
        listed = httpx.get(f"{url}/api/v1/training_runs/{model_id}/checkpoints", headers={"X-API-Key": KEY}).json()
    assert sorted(c["checkpoint_id"] for c in listed["checkpoints"]) == ["weights/keep", "weights/moved"]
    assert sorted(p.name for p in weights.iterdir()) == [".evil.saving-deadbeef", "keep", "moved"]
    assert (moved / META_FILE).is_file() and (keep / META_FILE).is_file()
    assert (outside / "precious").read_text() == "not the server's" and (outside / "weights" / ".x.saving-00000000").is_dir()


def test_runs_and_calls_are_logged_with_the_owner_tag_never_the_key(service, server, http, caplog):
    """One INFO line per run created and per run ended, naming the run and its key's owner tag;
    each call's timing at DEBUG (loggers under tinker_server); the key itself in no line."""
    caplog.set_level(logging.DEBUG, logger="tinker_server")
    client = service.create_lora_training_client(MODEL, rank=1).result()
    client.forward_backward(batch(1, 5), "cross_entropy").result()
    unload = http.post("/unload_model", json={"model_id": client.model_id}).json()
    assert http.post("/retrieve_future", json={"request_id": unload["request_id"]}).status_code == 200
    tag = tenants.tag_of(KEY)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("tinker_server")]
    created = [m for level, m in lines if level == logging.INFO and f"run {client.model_id} created" in m]
    ended = [m for level, m in lines if level == logging.INFO and f"run {client.model_id} ended" in m]
    assert len(created) == 1 and tag in created[0] and MODEL in created[0], lines
    assert len(ended) == 1 and tag in ended[0] and "unloaded by the client" in ended[0], lines
    timed = [m for level, m in lines if level == logging.DEBUG and m.startswith(f"forward_backward of {client.model_id}")]
    assert len(timed) == 1 and tag in timed[0] and re.search(r"ran \d+\.\d{3} s after waiting \d+\.\d{3} s", timed[0]), lines
    assert not [m for _, m in lines if KEY in m]


def test_the_per_key_and_ownership_settings_are_checked_at_start(tmp_path):
    """server.max_runs_per_key, max_sampling_sessions_per_key, ownerless_runs_owner and log_level:
    each bad value named with the key, the value and the fix before anything starts; a tag or one of
    api_keys is accepted as the owner of ownerless records."""
    from tinker_server.config import load_server_config

    base = ["configs/tinker_tiny.yaml", f"server.model_root={tmp_path}"]
    bad = [
        "server.max_runs_per_key=0",
        "server.max_sampling_sessions_per_key=0",
        "server.ownerless_runs_owner=bob",
        "server.log_level=loud",
    ]
    with pytest.raises(ValueError) as e:
        load_server_config(base[0], [base[1], *bad])
    for words in ("max_runs_per_key = 0", "max_sampling_sessions_per_key = 0", "ownerless_runs_owner = 'bob'", "log_level = 'loud'"):
        assert words in str(e.value) and "fix" in str(e.value), (words, str(e.value))
    with pytest.raises(ValueError, match="ownerless_runs_owner: that key is not one of api_keys"):
        load_server_config(base[0], [base[1], f"server.api_keys=[{KEY},{OTHER_KEY}]", "server.ownerless_runs_owner=tml-third"])
    for owner in (KEY, tenants.tag_of(KEY)):
        cfg = load_server_config(base[0], [base[1], f"server.api_keys=[{KEY},{OTHER_KEY}]", f"server.ownerless_runs_owner={owner}"])
        assert tenants.owner_tag(cfg.server_settings().ownerless_runs_owner) == tenants.tag_of(KEY)


# ---------------------------------------------------------------------------------- /oai/api/v1
def test_openai_chat_completions_render_the_template_and_return_tool_calls(server):
    """``/oai/api/v1`` through the plain ``openai`` SDK (a bearer key): the prompt that reaches the
    sampler is HF's rendering of the messages and tools, with the end-of-turn stop id; a sampled
    hermes call comes back as ``tool_calls`` (``tool_choice: none``: as text); a wrong key is a
    401, an unknown model a 404, ``n`` past ``server.max_num_samples`` a 400."""
    import openai

    chat = server.factory.chat_model(MODEL)
    tok, end = chat.tokenizer, chat.stop_token_ids[0]
    text = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "system", "content": "use tools"}, {"role": "user", "content": "2+3?"}]
    server.factory.replies = [tok(text, add_special_tokens=False)["input_ids"] + [end]]
    client = openai.OpenAI(base_url=f"{server.url}/oai/api/v1", api_key=KEY, max_retries=0)
    try:
        got = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, logprobs=True, seed=5)
        (picked,) = got.choices
        assert picked.finish_reason == "tool_calls" and picked.message.content is None
        (call,) = picked.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
        sent = [d for name, _, d, _ in server.factory.log if name == "sample"][-1]
        want = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert sent["prompt"] == tok(want, add_special_tokens=False)["input_ids"]
        assert sent["params"].stop_token_ids == (end,) and sent["params"].seed == 5
        assert [p.logprob for p in picked.logprobs.content] == [-0.25 * (k + 1) for k in range(len(server.factory.replies[0]))]
        plain = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="none")
        assert plain.choices[0].message.content == text and not plain.choices[0].message.tool_calls
        assert [m.id for m in client.models.list().data] == [MODEL, OTHER]
        with pytest.raises(openai.NotFoundError, match="not served"):
            client.chat.completions.create(model="nope", messages=messages)
        with pytest.raises(openai.BadRequestError, match="max_num_samples|n = "):
            client.chat.completions.create(model=MODEL, messages=messages, n=server.settings.max_num_samples + 1)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/oai/api/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        server.factory.replies = None
