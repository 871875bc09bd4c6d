"""The Tinker server launched as a user launches it (``python -m recipes.tinker_server``, a real
process) with ``engine.ranks=2``: each run's engine is 2 data-parallel Ray workers the server
drives as its single controller. Against a 1-rank ``EngineRun`` in this process: the same losses,
log-probs (relative 1e-6 per step) and trained weights after three steps (1e-5; float noise of another reduction order), for an odd
number of datums (the server pads the DP shards with datums that count 0: dro would see them otherwise), so which datums share a
rank changes nothing.
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time

import httpx
import pytest
import ray  # noqa: F401  (an installed extra: make test installs it; a missing one must fail, not skip)
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from recipes.tinker_server.contract import AdamIn, LoraIn
from recipes.tinker_server.runs import EngineFactory, RunSettings
from tests.support.launch import REPO, free_port, launch_env
from tests.support.tinker import ADAM, KEY, RANK, datums, plain, rel
from tests.support.user_data import build_model_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    build_model_dir(models / "tiny", family="llama")
    state = tmp_path_factory.mktemp("state")
    port = free_port()
    args = [sys.executable, "-m", "recipes.tinker_server", "--config", "configs/tinker_tiny.yaml", f"server.model_root={models}",
            f"server.port={port}", f"server.state_dir={state}", f"server.api_keys=[{KEY}]", "engine.ranks=2", "engine.cpus_per_rank=0.5",
            "tinker.lora_alpha=32"]  # fmt: skip
    log = tmp_path_factory.mktemp("log") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(args, cwd=REPO, env=launch_env(TINKER_TELEMETRY="0"), stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/api/v1/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the server did not answer healthz: " + log.read_text()[-3000:])
    yield url, models, state, proc, log
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def test_two_ray_ranks_behind_the_server_equal_one_rank_in_process(served, monkeypatch):
    url, models, state, proc, log = served
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    client = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=0).result()
    direct = EngineFactory(str(models), {}, RunSettings(lora_alpha=32.0)).create_run("tiny", LoraIn(rank=RANK, seed=0))
    for step, loss in enumerate(("cross_entropy", "ppo", "dro")):  # dro: padding must count 0 (its q^2 term is not)
        data = datums(60 + step, n=5, loss=loss)
        got = client.forward_backward(data, loss).result()
        client.optim_step(types.AdamParams(**ADAM)).result()
        want = direct.forward_backward(plain(data), loss, None, False)
        direct.optim_step(AdamIn(**ADAM))
        assert math.isclose(got.metrics["loss:sum"], want.metrics["loss:sum"], rel_tol=1e-6), (step, got.metrics, want.metrics)
        for g, w in zip(got.loss_fn_outputs, want.outputs, strict=True):
            assert torch.allclose(torch.as_tensor(g["logprobs"].to_torch()), w["logprobs"], atol=1e-6)
    path = client.save_weights_for_sampler("final").result().path
    merged = load_file(str(state / client.model_id / "sampler_weights" / "final" / "model.safetensors"))
    assert path.endswith("/sampler_weights/final")
    # three AdamW steps of two ranks' reduction order: measured 2e-6 (a padding datum counted in dro: the loss differs by 1e-2)
    assert rel(merged, direct.merged_weights()) <= 1e-5
    service.close("success").result()
    proc.send_signal(signal.SIGINT)  # the server stops, and with it the runs' Ray workers
    assert proc.wait(60) == 0, log.read_text()[-3000:]
