"""``Rollout``: sample a step's responses with a rollout engine (``engine_api.rollout.BaseRollout``,
picked by ``rollout.backend``) whose weights are synced from the actor, on engine calls only.

* **Sharded.** Each rank of the rollout group (the whole world by default: one colocated
  engine per rank) generates a contiguous block of the step's prompts; the samples are
  assembled on every rank with tensor collectives (``engine_api.dist.all_gather_rows``), so
  the roles get the same global batch everywhere. The seed of prompt ``i`` at step ``s`` is a
  function of ``(rollout.seed, s, i)`` only, so 1 and N ranks give the same batch.
* **Versioned sync.** ``sync_weights(version)`` streams the actor's ``export_weights`` (in
  ``sync_bucket_mb`` buckets) through the engine's begin / chunks / finish phases; with a LoRA
  actor and a backend that serves adapters (``lora_sync=adapter``) only the adapters move.
  Every sample carries the version that produced it (``rollout_weight_version``).
* **Failures.** A rank whose engine fails (generation or sync) makes every rank raise a clear
  error instead of leaving the others blocked in the gather.

``roles/`` imports no inference library: the engine is built by the recipe.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine_api import make_batch
from engine_api.base import bucket_bytes
from engine_api.dist import all_gather_rows, all_reduce, comm_device, group_rank, group_size
from engine_api.moe import ROLLOUT_ROUTING_FIELD
from engine_api.plugins import is_import_path
from engine_api.rollout import BaseRollout, Sample, SamplingParams, chunk_pairs, sample_seed
from engine_api.rollout_registry import available_rollouts, missing_extra, rollout_installed

LORA_SYNC = ("auto", "adapter", "merged")
DTYPES = ("float32", "bfloat16", "float16")


class WeightSource(Protocol):
    """Where the rollout's weights come from: an engine, or a role (``Actor`` or the legacy
    actor) exposing the same method."""

    def export_weights(self, bucket_mb: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full_tensor)`` pairs (``BaseEngine.export_weights``). Collective."""


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling and the rollout engine.

    Attributes:
        backend: the rollout engine: ``hf`` (plain HF, always installed), ``vllm`` (the
            ``vllm`` extra), an import path ``pkg.mod:Class`` or an ``enginekit.rollouts``
            entry point (``engine_api.rollout_registry``).
        max_new_tokens: response length cap.
        temperature: softmax temperature (> 0).
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens (-1: off).
        seed: base seed; the seed of prompt ``i`` of call ``s`` is derived from (seed, s, i).
        sync_bucket_mb: the actor's weights are gathered in flat buckets of about this many MB,
            one collective per bucket, and handed to the engine one bucket per
            ``update_weights`` chunk (512, as in verl and NeMo-RL); ``None``: one tensor each.
        lora_sync: with a LoRA actor: ``adapter`` sends only the adapters (the backend must
            serve them: vllm), ``merged`` sends merged full weights, ``auto`` picks adapter
            when the backend can.
        dtype: the engine's compute dtype (``float32`` for exact parity on CPU).
        max_model_len: longest prompt + response the engine accepts; None: the engine's own
            limit (vllm: the model's ``max_position_embeddings``; hf: none).
        options: backend settings (vllm: ``backends.rollout.vllm.VLLMOptions``).
        release_memory: free the engine's memory between a step's sampling and the next sync
            (vLLM sleep on GPU, so the colocated trainer gets the device memory back; a recorded
            no-op on CPU, where vLLM cannot sleep).
    """

    backend: str = "hf"
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    sync_bucket_mb: float | None = 512.0
    lora_sync: str = "auto"
    dtype: str = "float32"
    max_model_len: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    release_memory: bool = True

    def sampling(self, stop_token_ids: Sequence[int] = (), stop: Sequence[str] = ()) -> SamplingParams:
        """The engine's sampling settings for one sample per prompt."""
        return SamplingParams(
            n=1,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_new_tokens,
            stop_token_ids=tuple(int(t) for t in stop_token_ids),
            stop=tuple(stop),
        )

    def _problems(self) -> list[str]:
        out = [p for p in self.sampling()._problems() if not p.startswith("max_tokens")]
        if self.max_new_tokens < 1:
            out.append(f"max_new_tokens = {self.max_new_tokens}: must be >= 1; fix: e.g. 8")
        try:
            bucket_bytes(self.sync_bucket_mb)
        except ValueError:
            out.append(
                f"sync_bucket_mb = {self.sync_bucket_mb!r}: must be a number > 0 of MB or null; fix: e.g. 512, or null for one tensor at a time"
            )
        if self.lora_sync not in LORA_SYNC:
            out.append(f"lora_sync = {self.lora_sync!r}: unknown; fix: use one of {', '.join(LORA_SYNC)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            out.append(f"max_model_len = {self.max_model_len}: must be >= 2 or null; fix: e.g. null (the model's own)")
        if self.backend not in available_rollouts() and not is_import_path(self.backend):
            out.append(
                f"backend = {self.backend!r}: not a rollout backend; fix: use one of {', '.join(available_rollouts())}, "
                "or an import path package.module:ClassName of a BaseRollout subclass"
            )
        elif not rollout_installed(self.backend):
            out.append(f"backend = {self.backend!r}: {missing_extra(self.backend)}")
        if self.dtype not in DTYPES:
            out.append(f"dtype = {self.dtype!r}: unknown; fix: use one of {', '.join(DTYPES)}")
        return out


class Rollout:
    """Generates a step's responses with the actor's current weights (see the module docstring).

    Args:
        source: the actor (or its engine): ``export_weights`` (and ``export_adapter_weights``).
        engine: this rank's rollout engine.
        config: sampling and sync settings.
        stop_token_ids, stop: what ends a response (EOS ids, stop strings).
        lora: the actor's LoRA settings (``r``, ``lora_alpha``, ``target_modules``) when it
            trains adapters; None otherwise.
        group: the ranks that split the prompts (None: the world).
    """

    def __init__(
        self,
        source: WeightSource,
        engine: BaseRollout,
        config: RolloutConfig,
        stop_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        lora: Mapping[str, Any] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.source, self.engine, self.config, self.group = source, engine, config, group
        self.params = config.sampling(stop_token_ids, stop)
        problems = self.params._problems()
        if problems:
            raise ValueError("rollout: " + "; ".join(problems))
        self.lora = dict(lora) if lora else None
        self.adapter_sync = bool(self.lora) and config.lora_sync != "merged" and engine.supports_lora
        if self.lora and config.lora_sync == "adapter" and not engine.supports_lora:
            raise ValueError(
                f"rollout.lora_sync = 'adapter': the {type(engine).__name__} backend serves no LoRA adapters; "
                "fix: rollout.lora_sync=merged (or auto), or rollout.backend=vllm"
            )
        self._calls = 0
        #: whether generation can run while training does (never in process: the same ranks)
        self.overlaps = False
        #: the last sync's seconds and MB handed to the engine (``rollout/sync_s``, ``rollout/sync_mb``)
        self.last_sync: dict[str, float] = {}

    @property
    def weight_version(self) -> int:
        """The version of the weights the engine samples from now."""
        return self.engine.weight_version

    def sync_weights(self, version: int | None = None) -> None:
        """Copy the actor's weights (or only its adapters) into the engine as ``version``
        (default: the current one + 1). Collective: every rank drains the export; a rank whose
        engine refuses the update makes every rank raise."""
        version = self.engine.weight_version + 1 if version is None else version
        moved, start = 0, time.perf_counter()
        error = _attempt(self.engine.resume_memory)
        if error is not None:
            if self.adapter_sync:
                dict(self.source.export_adapter_weights())  # still drained: the export is collective
            else:
                for _ in self.source.export_weights(bucket_mb=self.config.sync_bucket_mb):
                    pass
        elif self.adapter_sync:
            adapter = dict(self.source.export_adapter_weights())  # collective: drained on every rank
            moved = sum(t.numel() * t.element_size() for t in adapter.values())
            error = _attempt(lambda: self.engine.load_adapter(adapter, self.lora, version))
        else:
            named = self.source.export_weights(bucket_mb=self.config.sync_bucket_mb)
            try:
                self.engine.begin_weight_update(version)
            except (RuntimeError, ValueError) as exc:
                error = exc
            for chunk in chunk_pairs(named, self.config.sync_bucket_mb):  # drained even after a failure: it is collective
                moved += sum(t.numel() * t.element_size() for _, t in chunk)
                if error is None:
                    error = _attempt(lambda chunk=chunk: self.engine.update_weights(chunk))
            if error is None:
                error = _attempt(self.engine.finish_weight_update)
            else:
                self.engine.abort_weight_update()
        self._agree(error, f"weight sync to version {version}")
        self.last_sync = {"rollout/sync_s": time.perf_counter() - start, "rollout/sync_mb": moved / 2**20}

    def generate(self, prompts: Sequence[torch.Tensor], seed_offset: int | None = None) -> TensorDict:
        """Sample one response per prompt; returns a protocol batch of prompt + response
        (:func:`samples_to_batch`).

        Prompt ``i`` is sampled with a seed derived from ``(seed, seed_offset, i)`` (default
        offset: the number of earlier calls; recipes pass the step so a resumed run samples what
        the uninterrupted one would have), on the rank whose block holds it. Collective over
        the rollout group.
        """
        offset = self._calls if seed_offset is None else seed_offset
        self._calls += 1
        prompts = [torch.as_tensor(p, dtype=torch.long) for p in prompts]
        samples = self.sample(prompts, self.seeds(offset, len(prompts)))
        return samples_to_batch(prompts, samples, self.config.temperature)

    def seeds(self, seed_offset: int, count: int) -> list[int]:
        """The seeds of prompts ``0 .. count - 1`` of call ``seed_offset`` (``generate``'s draws)."""
        return step_seeds(self.config.seed, seed_offset, count)

    def sample(
        self,
        prompts: Sequence[torch.Tensor],
        seeds: Sequence[int],
        kept: Sequence[Sample | None] | None = None,
        max_new_tokens: int | None = None,
        stop: Sequence[str] | None = None,
    ) -> list[Sample]:
        """One ``Sample`` per prompt, on every rank, in prompt order: prompt ``i`` drawn with
        ``seeds[i]`` on the rank whose block holds it. ``kept`` continues unfinished samples of
        an earlier call (partial rollouts: ``BaseRollout.generate``); ``max_new_tokens``: the
        new tokens this call may draw (default ``rollout.max_new_tokens``); ``stop``: stop
        strings of this call, added to the run's (``rollout.stop_strings``; a request of an
        agent through the gateway). Collective over the rollout group."""
        prompts = [torch.as_tensor(p, dtype=torch.long) for p in prompts]
        params = self.params if max_new_tokens is None else replace(self.params, max_tokens=int(max_new_tokens))
        if stop:
            params = replace(params, stop=tuple(dict.fromkeys((*params.stop, *stop))))
        size, rank = group_size(self.group), group_rank(self.group)
        begin, end = _block(len(prompts), size, rank)
        mine = None if kept is None else list(kept[begin:end])
        local: list = []

        def work() -> None:
            self.engine.resume_memory()
            # ``kept`` only when continuing: a backend that overrides ``generate`` with the
            # contract's older signature keeps working for everything else.
            extra = {"kept": mine} if mine is not None and any(k is not None for k in mine) else {}
            local.extend(self.engine.generate(prompts[begin:end], params, list(seeds[begin:end]), **extra))

        error = _attempt(work)
        self._agree(error, "generation")
        return self._gather([group[0] for group in local], prompts)

    def release(self) -> None:
        """After a step's sampling: free the engine's memory for training (``release_memory``);
        the next ``sync_weights`` or ``generate`` resumes it. Released already: nothing to do."""
        if self.config.release_memory and not self.engine.memory_released:
            self.engine.release_memory()

    def _gather(self, samples: list[Sample], prompts: list[torch.Tensor]) -> list[Sample]:
        """Every rank's samples, in prompt order, on every rank (tensor collectives only)."""
        total = len(prompts)
        lengths = torch.tensor([len(s.token_ids) for s in samples], dtype=torch.long)
        meta = torch.tensor([[s.weight_version, int(s.finish_reason == "length")] for s in samples], dtype=torch.long).reshape(-1, 2)
        ids = torch.cat([s.token_ids for s in samples]) if samples else torch.zeros(0, dtype=torch.long)
        lps = torch.cat([s.log_probs.float() for s in samples]) if samples else torch.zeros(0)
        versions = torch.cat([s.versions() for s in samples]) if samples else torch.zeros(0, dtype=torch.long)
        lengths, meta, ids, lps, versions = (torch.cat(all_gather_rows(t, self.group)) for t in (lengths, meta, ids, lps, versions))
        assert len(lengths) == total, (len(lengths), total)
        split = lengths.tolist()
        routing = None
        if self.engine.config.return_routing:
            routing = self._gather_routing(samples, [len(p) + n for p, n in zip(prompts, split, strict=True)])
        return [
            Sample(
                token_ids=i,
                log_probs=lp,
                finish_reason="length" if int(m[1]) else "stop",
                weight_version=int(m[0]),
                routed_experts=None if routing is None else routing[k],
                token_versions=v,
            )
            for k, (i, lp, v, m) in enumerate(zip(ids.split(split), lps.split(split), versions.split(split), meta, strict=True))
        ]

    def _gather_routing(self, samples, lengths: list[int]) -> list[torch.Tensor]:
        """Every sample's recorded routing (``Sample.routed_experts``, ``[P + R, L, k]``), in
        prompt order, on every rank (``lengths``: each sample's P + R): one all-gather of the
        rows (each token's ``L x k`` experts) and one max all-reduce of ``(L, k)`` (a rank may
        hold no sample)."""
        shape = torch.tensor(list(samples[0].routed_experts.shape[1:]) if samples else [0, 0], dtype=torch.long)
        shape = all_reduce(shape.to(comm_device(self.group)), "max", self.group).cpu()
        layers, top_k = int(shape[0]), int(shape[1])
        rows = torch.cat([s.routed_experts.reshape(-1, layers * top_k) for s in samples]) if samples else torch.zeros(0, layers * top_k)
        flat = torch.cat(all_gather_rows(rows.long(), self.group)).reshape(-1, layers, top_k)
        if flat.shape[0] != sum(lengths):
            raise RuntimeError(
                f"rollout backend {type(self.engine).__name__} returned routing for {flat.shape[0]} tokens, the samples hold "
                f"{sum(lengths)}; fix the backend (Sample.routed_experts has one row per prompt + response token)"
            )
        return list(flat.split(lengths))

    def _agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank when any rank's engine failed (none is left in a collective)."""
        flag = torch.tensor([0.0 if error is None else 1.0], device=comm_device(self.group))
        failed = int(all_reduce(flag, "sum", self.group).item())
        if error is not None:
            raise RuntimeError(f"rollout {what} failed on this rank ({type(error).__name__}: {error})") from error
        if failed:
            raise RuntimeError(f"rollout {what} failed on {failed} other rank(s) (their error says why); this rank stops too")


def pack_rows(rows: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """1-D tensors as one flat tensor and their lengths (``unpack_rows`` inverts it): a few
    tensors to send or save instead of one per row (pickling a list of small tensors costs
    ~0.1 ms each)."""
    flat = torch.cat([r.reshape(-1) for r in rows]) if rows else torch.zeros(0, dtype=torch.long)
    return {"values": flat, "lengths": torch.tensor([r.numel() for r in rows], dtype=torch.long)}


def unpack_rows(packed: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    return [r.clone() for r in packed["values"].split(packed["lengths"].tolist())]


def pack_samples(samples: Sequence[Sample | None]) -> dict[str, torch.Tensor]:
    """Samples (None: not started) as a few flat tensors (``unpack_samples`` inverts it): what
    travels between the driver and a rollout pool, and what a checkpoint of the asynchronous
    pipeline holds."""
    rows = [s for s in samples if s is not None]
    out = {"started": torch.tensor([s is not None for s in samples], dtype=torch.long)}
    if not rows:
        return out
    out["lengths"] = torch.tensor([len(s.token_ids) for s in rows], dtype=torch.long)
    out["token_ids"] = torch.cat([s.token_ids.reshape(-1) for s in rows]).long()
    out["log_probs"] = torch.cat([s.log_probs.reshape(-1) for s in rows]).float()
    out["token_versions"] = torch.cat([s.versions() for s in rows]).long()
    out["stopped"] = torch.tensor([s.finish_reason == "stop" for s in rows], dtype=torch.long)
    out["weight_version"] = torch.tensor([s.weight_version for s in rows], dtype=torch.long)
    if rows[0].routed_experts is not None:
        out["routing"] = torch.cat([s.routed_experts for s in rows]).long()
        out["routing_rows"] = torch.tensor([len(s.routed_experts) for s in rows], dtype=torch.long)
    return out


def unpack_samples(packed: Mapping[str, torch.Tensor]) -> list[Sample | None]:
    """The samples of :func:`pack_samples`.

    Raises:
        ValueError: the tensors do not describe one sample per started row.
    """
    started = packed["started"].tolist()
    out: list[Sample | None] = [None] * len(started)
    rows = [i for i, s in enumerate(started) if s]
    if not rows:
        return out
    lengths = packed["lengths"].tolist()
    if len(lengths) != len(rows) or sum(lengths) != len(packed["token_ids"]):
        raise ValueError(
            f"packed samples: {len(lengths)} lengths summing to {sum(lengths)} for {len(rows)} started rows, {len(packed['token_ids'])} tokens"
        )
    ids, lps, ver = (packed[k].split(lengths) for k in ("token_ids", "log_probs", "token_versions"))
    stopped, wv = packed["stopped"].tolist(), packed["weight_version"].tolist()
    routing = packed["routing"].split(packed["routing_rows"].tolist()) if "routing" in packed else None
    for j, i in enumerate(rows):
        out[i] = Sample(
            token_ids=ids[j].clone(),
            log_probs=lps[j].clone(),
            finish_reason="stop" if stopped[j] else "length",
            weight_version=int(wv[j]),
            routed_experts=None if routing is None else routing[j].clone(),
            token_versions=ver[j].clone(),
        )
    return out


def step_seeds(seed: int, seed_offset: int, count: int) -> list[int]:
    """The seeds of prompts ``0 .. count - 1`` of ``Rollout.generate`` call ``seed_offset`` with
    base seed ``seed`` (``rollout.seed``): a function of the three only."""
    call_seed = sample_seed(seed, seed_offset)
    return [sample_seed(call_seed, i) for i in range(count)]


def samples_to_batch(prompts: Sequence[torch.Tensor], samples: Sequence[Sample], temperature: float) -> TensorDict:
    """The protocol batch of ``prompts`` and their ``samples`` (:func:`rl_batch`): prompt +
    response, the loss mask and the sampling log-probs and versions on the response tokens, the
    recorded routing when the samples carry it."""
    sequences, masks, lps, versions = [], [], [], []
    for prompt, s in zip(prompts, samples, strict=True):
        prompt = torch.as_tensor(prompt, dtype=torch.long)
        zeros = torch.zeros(len(prompt))
        sequences.append(torch.cat([prompt, s.token_ids]))
        masks.append(torch.cat([zeros, torch.ones(len(s.token_ids))]))
        lps.append(torch.cat([zeros, s.log_probs.float()]))
        versions.append(torch.cat([zeros.long(), s.versions()]))
    routing = [s.routed_experts for s in samples] if samples and samples[0].routed_experts is not None else None
    return rl_batch(
        sequences,
        masks,
        lps,
        versions,
        prompt_len=torch.tensor([len(p) for p in prompts]),
        truncated=torch.tensor([int(s.finish_reason == "length") for s in samples]),
        temperature=temperature,
        routing=routing,
    )


def rl_batch(
    ids: Sequence[torch.Tensor],
    loss_mask: Sequence[torch.Tensor],
    rollout_log_probs: Sequence[torch.Tensor],
    token_versions: Sequence[torch.Tensor],
    prompt_len: torch.Tensor,
    truncated: torch.Tensor,
    temperature: float,
    routing: Sequence[torch.Tensor] | None = None,
) -> TensorDict:
    """The RL training batch: the one constructor of its schema, for single-turn samples and
    multi-turn trajectories alike. Per token: ``input_ids``, ``loss_mask`` (1 exactly on the
    sampled tokens), ``rollout_log_probs`` and ``rollout_token_versions`` (0 off the sampled
    tokens), and the recorded routing (``engine_api.moe.ROLLOUT_ROUTING_FIELD``) when given; per
    sample ``prompt_len``, ``rollout_truncated`` (1: ended at a length cap) and
    ``rollout_weight_version``: the OLDEST version that sampled any of its tokens, which its
    staleness counts from (the one place that rule is written); the ``temperature`` metadata."""
    extra = {} if routing is None else {ROLLOUT_ROUTING_FIELD: list(routing)}
    return make_batch(
        list(ids),
        loss_mask=list(loss_mask),
        rollout_log_probs=list(rollout_log_probs),
        rollout_token_versions=list(token_versions),
        **extra,
        prompt_len=prompt_len,
        rollout_weight_version=torch.tensor([int(v[m > 0].min()) for v, m in zip(token_versions, loss_mask, strict=True)]),
        rollout_truncated=truncated,
        temperature=temperature,
    )


def _attempt(fn) -> BaseException | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 (reported on every rank by _agree)
        return exc
    return None


def _block(total: int, size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share of ``total`` items split ``size`` ways (sizes differ by <= 1)."""
    base, extra = divmod(total, size)
    begin = rank * base + min(rank, extra)
    return begin, begin + base + (1 if rank < extra else 0)
