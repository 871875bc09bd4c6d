"""The rollout conformance kit: proves that a rollout backend keeps the ``BaseRollout`` contract
(``engine_api.rollout``)::

    python -m engine_api.conformance --rollout hf
    python -m engine_api.conformance --rollout vllm --only logprobs sync_exact
    python -m engine_api.conformance --rollout mypkg.rollout:MyRollout

or from Python with :func:`run_rollout_conformance`. A rollout engine is per-rank (nothing
collective), so the kit runs in the calling process and builds ONE engine that every check
shares (vLLM takes ~15 s to start), shut down at the end. The checks are written against the
contract only (``generate``, the weight-update phases, ``weight_version``,
``weight_shapes``), never a backend's internals. After a failed check the kit verifies that
the engine still holds the weights and version it should (a short generate against the
reference); if not, it rebuilds the engine so one bug does not fail every later check.

The model: a tiny Qwen2-style decoder (q/k/v biases, tied embedding and LM head: the harder
case for a weight loader; head_dim 32, the least vLLM's CPU attention takes) built from its
config with a fixed seed and every constant tensor (norms, biases) perturbed, so a backend that
drops or swaps a tensor cannot match by accident. Nothing is downloaded.

The reference: the HF ``AutoModelForCausalLM`` in fp32 on the CPU holding the weights the
engine should hold, one sequence per forward; a sampled token's log-prob is
``log_softmax(logits / temperature)`` at its position. Tolerances: 1e-4 against the reference
(fp32 noise measured 5e-7 on the hf and vllm backends, while a temperature, a dropped tensor
or a stale weight moves log-probs by >= 1e-2), 1e-6 between two identical calls, 1e-5 for
log-prob 0 under ``top_k = 1``; under top_k / top_p a token whose kept set has its edge within
1e-5 (a tie at the k-th logit, a prefix mass that close to top_p) is not judged.

The kit runs with ``torch.set_num_threads(1)`` (restored after): the model is tiny, and on a
busy machine OpenMP threads waiting for each other made it 10x slower.

Importing this module imports no inference library and no transformers: the checks import
transformers when they run (to build the model and the reference).
"""

from __future__ import annotations

import gc
import re
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine_api.conformance import fixtures as fx
from engine_api.conformance.checks import CheckFailed
from engine_api.rollout import FINISH_REASONS, BaseRollout, RolloutEngineConfig, Sample, SamplingParams

TOL = 1e-4  # log-probs against the HF reference
SELF_TOL = 1e-6  # log-probs of two calls with the same seeds
TOP1_TOL = 1e-5  # log-prob 0 of the only token top_k = 1 keeps
CHUNK_MB = 0.02  # ~20 KB chunks: the ~250 KB model arrives in many of them
TRAINER = "fsdp"  # the training engine of sync_after_step

# The kit's model: Qwen2-style (q/k/v biases, tied embeddings), head_dim 64 / 2 = 32 (vLLM's CPU minimum).
MODEL_DIMS = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    use_sliding_window=False,
)
VOCAB = MODEL_DIMS["vocab_size"]
# Prompts of different lengths (two equal, which a backend may batch together); seeds of all sizes.
PROMPT_LENGTHS = (1, 4, 7, 7, 12, 23)
SEEDS = (0, 1, 7, 12345, 2**40 + 3, 99)


# The kit's tokenizer: one character per token id, so a stop string of k characters spans k
# tokens and a response's text is its ids read through this table.
CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ+-"
assert len(CHARS) == VOCAB


def build_model(path: str, seed: int = 0) -> str:
    """Save the kit's tiny Qwen2-style model under ``path`` and its character-level tokenizer
    (no special tokens) under ``tokenizer_dir(path)``; returns ``path``.

    The model declares an EOS (``eos_token_id`` in ``config.json`` and
    ``generation_config.json``, as every HF model does): the token it puts the most probability
    on, averaged over random contexts, so sampled responses contain it. The contract ends a
    response only at the caller's ``stop_token_ids`` / ``stop`` strings, so the EOS must end
    none (an engine left to its own EOS handling, e.g. vLLM without ``ignore_eos``, stops there:
    the ``eos`` check)."""
    import json
    import os

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    fx.save_model(Qwen2Config(**MODEL_DIMS), path, seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    contexts = torch.randint(0, VOCAB, (16, 12), generator=torch.Generator().manual_seed(seed + 7))
    with torch.no_grad():
        eos = int(torch.softmax(model(contexts).logits.float(), -1).mean((0, 1)).argmax())
    for name in ("config.json", "generation_config.json"):
        file = os.path.join(path, name)
        data = json.load(open(file)) if os.path.exists(file) else {}
        data["eos_token_id"] = eos
        with open(file, "w") as f:
            json.dump(data, f, indent=2)
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(CHARS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    # In its own directory: next to a qwen2 config.json, AutoTokenizer would build Qwen2's
    # tokenizer class, which adds its own special tokens past the model's vocabulary.
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tokenizer_dir(path))
    return path


def tokenizer_dir(path: str) -> str:
    """Where ``build_model`` saved the kit's tokenizer for the model at ``path``."""
    import os

    return os.path.join(path, "tokenizer")


def model_eos(path: str) -> int:
    """The EOS id the kit's model declares (``build_model``)."""
    import json
    import os

    with open(os.path.join(path, "generation_config.json")) as f:
        return int(json.load(f)["eos_token_id"])


def text(ids) -> str:
    """A response's text under the kit's tokenizer (one character per id)."""
    return "".join(CHARS[int(i)] for i in ids)


def make_prompts(lengths: Sequence[int] = PROMPT_LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    """Random int64 prompts of ``lengths`` over the kit's vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


# ----------------------------------------------------------------------------- the checks
@dataclass(frozen=True)
class RolloutCheck:
    """One named property of the rollout contract."""

    name: str
    fn: Callable[[Kit], str]
    doc: str


ROLLOUT_CHECKS: dict[str, RolloutCheck] = {}


def rollout_check(name: str):
    def register(fn: Callable[[Kit], str]) -> Callable[[Kit], str]:
        ROLLOUT_CHECKS[name] = RolloutCheck(name, fn, (fn.__doc__ or "").strip().splitlines()[0])
        return fn

    return register


@dataclass
class Worst:
    """The largest |engine - reference| log-prob gap of a set of samples, and where it is."""

    diff: float = 0.0
    where: str = "no token"
    tokens: int = 0

    def __str__(self) -> str:
        return f"{self.diff:.1e}"


class Kit:
    """What every check shares: the engine under test, the HF reference holding the weights the
    engine should hold (``expected``), the version it should report, and (for
    ``sync_after_step``) a trained training engine."""

    def __init__(self, backend: str, model_dir: str, options: Mapping[str, Any] | None = None) -> None:
        self.backend, self.model_dir = backend, model_dir
        self.options = dict(options or {})
        self.engine: BaseRollout | None = None
        self.hf = fx.hf_model(model_dir)
        self.base = self._snapshot()
        self.expected = self.base
        self._loaded: dict[str, torch.Tensor] | None = self.base
        self.version = 0
        self.trainer = None
        self.trainer_error: str | None = None
        self.prompts = make_prompts()

    # ------------------------------------------------------------------ engine life
    def start(self) -> None:
        from engine_api.rollout_registry import build_rollout

        self.engine = build_rollout(
            self.backend,
            RolloutEngineConfig(model_path=self.model_dir, tokenizer_path=tokenizer_dir(self.model_dir), seed=0, options=self.options),
        )
        self.expected, self.version = self.base, 0

    def stop(self) -> None:
        """Shut the engine down (a failing shutdown is printed, not raised: the report matters more)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
        gc.collect()

    def close(self) -> None:
        self.stop()
        self.trainer = None
        gc.collect()

    def restore(self) -> str | None:
        """After a failed check: None when the engine still serves the expected weights and
        version, else rebuild it (returns why)."""
        problem = self._health()
        if problem is None:
            return None
        self.stop()
        self.start()
        return f"{problem}; the kit rebuilt the engine for the next checks"

    def _health(self) -> str | None:
        e = self.engine
        try:
            e.abort_weight_update()  # a failed check may have left an update open
            if e.weight_version != self.version:
                return f"the engine reports weight_version {e.weight_version}, the kit expected {self.version}"
            worst = self.compare(self.prompts[:3], self.generate(self.prompts[:3], SamplingParams(max_tokens=4), SEEDS[:3]), 1.0)
            if worst.diff > TOL:
                return f"the engine no longer serves the expected weights (log-probs off by {worst})"
        except Exception as exc:  # noqa: BLE001 - any failure means: rebuild
            return f"the engine no longer serves ({type(exc).__name__}: {first_line(exc)})"
        return None

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams, seeds: Sequence[int]) -> list[list[Sample]]:
        """``engine.generate`` and the shape of its answer (every call of every check)."""
        e = self.engine
        out = e.generate(list(prompts), params, list(seeds))
        if not isinstance(out, list) or len(out) != len(prompts):
            raise CheckFailed(
                f"generate returned {type(out).__name__} of {len(out) if hasattr(out, '__len__') else '?'} groups for {len(prompts)} prompts"
            )
        for i, group in enumerate(out):
            if len(group) != params.n:
                raise CheckFailed(f"prompt {i}: {len(group)} samples for n = {params.n}")
            for j, s in enumerate(group):
                at = f"prompt {i} sample {j}"
                ids, lps = s.token_ids, s.log_probs
                if not (isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and ids.dim() == 1):
                    raise CheckFailed(f"{at}: token_ids must be a 1-D int64 tensor, got {_describe(ids)}")
                if not (isinstance(lps, torch.Tensor) and lps.dtype == torch.float32 and lps.dim() == 1):
                    raise CheckFailed(f"{at}: log_probs must be a 1-D float32 tensor, got {_describe(lps)}")
                if len(ids) != len(lps):
                    raise CheckFailed(f"{at}: {len(ids)} token_ids but {len(lps)} log_probs")
                if not 1 <= len(ids) <= params.max_tokens:
                    raise CheckFailed(f"{at}: {len(ids)} tokens, must be in [1, max_tokens = {params.max_tokens}]")
                if s.finish_reason not in FINISH_REASONS:
                    raise CheckFailed(f"{at}: finish_reason {s.finish_reason!r}, must be one of {FINISH_REASONS}")
                if not bool(torch.isfinite(lps).all()) or float(lps.max()) > 1e-6:
                    raise CheckFailed(f"{at}: log_probs must be finite and <= 0, got {lps.tolist()}")
                if s.weight_version != e.weight_version:
                    raise CheckFailed(f"{at}: weight_version {s.weight_version!r}, the engine's weight_version is {e.weight_version}")
        return out

    # ------------------------------------------------------------------ reference
    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.hf.state_dict().items()}

    def _load(self, weights: dict[str, torch.Tensor]) -> None:
        if self._loaded is weights:
            return
        state = self.hf.state_dict()
        with torch.no_grad():
            for name, tensor in weights.items():
                state[name].copy_(tensor)
        self._loaded = weights

    def with_update(
        self, named: Sequence[tuple[str, torch.Tensor]], base: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The HF weights after loading ``named`` over ``base`` (default: ``expected``); a tied
        head follows its embedding."""
        self._load(self.expected if base is None else base)
        state = self.hf.state_dict()
        unknown = [n for n, _ in named if n not in state]
        if unknown:
            raise CheckFailed(f"names {unknown[:3]} are not weights of the HF model")
        with torch.no_grad():
            for name, tensor in named:
                state[name].copy_(tensor.detach().to(torch.float32))
        self._loaded = None
        snap = self._snapshot()
        self._loaded = snap
        return snap

    def expect(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """From now on the engine should serve ``weights`` at ``version``."""
        self.expected, self.version = weights, version

    def params(self) -> list[tuple[str, torch.Tensor]]:
        """The expected weights as an update carries them: every parameter once (a tied head
        only as its embedding), in the model's order."""
        self._load(self.expected)
        return [(n, self.expected[n]) for n, _ in self.hf.named_parameters()]

    def perturbed(self, seed: int, scale: float = 0.02) -> list[tuple[str, torch.Tensor]]:
        """Every parameter of ``expected`` plus ``scale`` * seeded normal noise."""
        g = torch.Generator().manual_seed(seed)
        return [(n, t + scale * torch.randn(t.shape, generator=g)) for n, t in self.params()]

    @torch.no_grad()
    def reference(self, prompts, groups, temperature: float, weights=None) -> list[list[torch.Tensor]]:
        """Per sample: ``log_softmax(HF logits / temperature)`` at its response tokens."""
        self._load(self.expected if weights is None else weights)
        out = []
        for p, group in zip(prompts, groups, strict=True):
            row = []
            for s in group:
                ids = torch.cat([torch.as_tensor(p, dtype=torch.long), s.token_ids.cpu()])
                logits = self.hf(ids[None]).logits[0, len(p) - 1 : len(ids) - 1].float() / temperature
                row.append(torch.log_softmax(logits, -1).gather(-1, s.token_ids.cpu()[:, None])[:, 0])
            out.append(row)
        return out

    @torch.no_grad()
    def logits(self, prompt: torch.Tensor, sample: Sample) -> torch.Tensor:
        """HF logits [R, V] that predicted each response token of ``sample`` (``expected`` weights)."""
        self._load(self.expected)
        ids = torch.cat([prompt, sample.token_ids.cpu()])
        return self.hf(ids[None]).logits[0, len(prompt) - 1 : len(ids) - 1].float()

    def compare(self, prompts, groups, temperature: float, weights=None) -> Worst:
        """The worst engine-vs-reference log-prob gap over every sampled token."""
        return worst_gap(groups, self.reference(prompts, groups, temperature, weights))

    def sync_failure(self, what: str, prompts, groups, temperature: float, worst: Worst, before, named) -> CheckFailed:
        """A failed sync, diagnosed: were the weights not applied at all, or all but one tensor?"""
        msg = f"{what}: log-probs differ from the updated HF model by {worst.diff:.2e} (> {TOL:g}) at {worst.where}"
        stale = self.compare(prompts, groups, temperature, before)
        if stale.diff <= TOL:
            return CheckFailed(f"{msg}; they equal the weights before the update (|diff| {stale}): the update was not applied")
        target = self.with_update(named)
        for name, _ in named:
            partial = self.with_update([(name, before[name])], base=target)
            if self.compare(prompts, groups, temperature, partial).diff <= TOL:
                return CheckFailed(f"{msg}; they equal the update with {name!r} left at its previous value: that tensor was not applied")
        if "lm_head.weight" in target and self.hf.config.tie_word_embeddings:
            # A tied head the engine untied: the embedding moved, the LM head kept its old values (or the reverse).
            embed = next(k for k in target if k.endswith("embed_tokens.weight"))
            for moved, kept in (("the embedding", "LM head"), ("the LM head", "embedding")):
                head, emb = (before, target) if kept == "LM head" else (target, before)
                untied = self.untied_reference(prompts, groups, temperature, target, emb[embed], head[embed])
                if worst_gap(groups, untied).diff <= TOL:
                    return CheckFailed(
                        f"{msg}; they equal the update with {moved} updated but the {kept} at its previous value: the engine untied "
                        f"the tied lm_head.weight / {embed} (e.g. an update without the optional 'lm_head.weight' left the head stale)"
                    )
        return CheckFailed(f"{msg}; vs the weights before the update: {stale.diff:.2e}")

    @torch.no_grad()
    def untied_reference(self, prompts, groups, temperature, weights, embed: torch.Tensor, head: torch.Tensor):
        """``reference`` of a copy of the model with its head untied: ``weights`` but ``embed`` / ``head``."""
        import copy

        from transformers import AutoModelForCausalLM

        config = copy.deepcopy(self.hf.config)
        config.tie_word_embeddings = False
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        model.load_state_dict(weights)
        model.get_input_embeddings().weight.copy_(embed)
        model.get_output_embeddings().weight.copy_(head)
        hf, loaded = self.hf, self._loaded
        self.hf, self._loaded = model, weights
        try:
            return self.reference(prompts, groups, temperature, weights)
        finally:
            self.hf, self._loaded = hf, loaded


def worst_gap(groups: list[list[Sample]], refs: list[list[torch.Tensor]]) -> Worst:
    worst = Worst()
    for i, (group, ref) in enumerate(zip(groups, refs, strict=True)):
        for j, (s, want) in enumerate(zip(group, ref, strict=True)):
            got = s.log_probs.detach().cpu().double()
            worst.tokens += len(got)
            if len(got) == 0:
                continue
            gap = (got - want.double()).abs()
            k = int(gap.argmax())
            if float(gap[k]) > worst.diff or worst.where == "no token":
                worst.diff = float(gap[k])
                worst.where = (
                    f"prompt {i} sample {j} response position {k} (token {int(s.token_ids[k])}: engine {float(got[k]):.6f}, "
                    f"reference {float(want[k]):.6f})"
                )
    return worst


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dim()}-D {x.dtype} tensor"
    return type(x).__name__


def sample_ids(groups: list[list[Sample]]) -> list[list[list[int]]]:
    return [[s.token_ids.tolist() for s in g] for g in groups]


def expect_refusal(what: str, exc_type: type[Exception], fn: Callable[[], Any], *names: str) -> str:
    """Run ``fn``; it must raise ``exc_type`` whose message names every one of ``names``."""
    try:
        fn()
    except exc_type as exc:
        msg = str(exc)
        missing = [n for n in names if not re.search(rf"(?<![\w.]){re.escape(n)}(?![\w.])", msg)]
        if missing:
            raise CheckFailed(f"{what}: {exc_type.__name__} raised but its message does not name {missing}: {first_line(exc)!r}") from None
        return msg
    except Exception as exc:  # noqa: BLE001 - the wrong kind of refusal is the finding
        raise CheckFailed(f"{what}: raised {type(exc).__name__} ({first_line(exc)}), the contract says {exc_type.__name__}") from None
    raise CheckFailed(f"{what}: accepted, the contract says it raises {exc_type.__name__}")


def still_serving(kit: Kit, after: str) -> Worst:
    """After a refusal: version unchanged, generate works (nothing left open) and log-probs equal the expected weights."""
    e = kit.engine
    if e.weight_version != kit.version:
        raise CheckFailed(f"after {after}: weight_version is {e.weight_version}, must stay {kit.version}")
    try:
        out = kit.generate(kit.prompts, SamplingParams(max_tokens=6), SEEDS)
    except CheckFailed:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckFailed(
            f"after {after}: generate raises {type(exc).__name__} ({first_line(exc)}); the engine must keep serving"
        ) from None
    worst = kit.compare(kit.prompts, out, 1.0)
    if worst.diff > TOL:
        raise CheckFailed(
            f"after {after}: log-probs differ from the weights before it by {worst.diff:.2e} (> {TOL:g}) at {worst.where}: "
            "(part of) the refused update was applied"
        )
    return worst


# ----------------------------------------------------------------------------- outputs
