"""HF model loading shared by the backends (the FSDP engine trains the HF module itself; the
megatron engine converts its weights, and needs the same seeded value-head init)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import pickle
import re
import sys

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification
from transformers.utils import logging as hf_logging

from engine_api.kit import RouterSpec, RoutingRecorder

# What loading a causal-LM directory as a value model leaves out or adds, by design: the LM head
# is not used and the one-output ``score`` layer is new.
_VALUE_HEAD_UNEXPECTED = ("lm_head.",)
_VALUE_HEAD_MISSING = ("score.",)


def softcapping(hf_config) -> float | None:
    """The model's attention-logit soft-capping (Gemma-2: ``attn_logit_softcapping``), which
    HF's eager and flash-attention kernels apply and its sdpa kernel silently does not."""
    return getattr(hf_config, "attn_logit_softcapping", None)


def attn_problems(hf_config, requested: str, device_type: str) -> list[str]:
    """Why ``model.attn_implementation = requested`` cannot run this model exactly here (empty
    when it can); ``auto`` always can (see :func:`resolve_attn_implementation`)."""
    field = "model.attn_implementation"
    if requested == "sdpa" and softcapping(hf_config) is not None:
        return [
            f"{field} = 'sdpa': the model's attn_logit_softcapping = {softcapping(hf_config)} is not applied by HF's sdpa "
            "kernel (the attention scores, and so every log-prob, would differ from the model's); fix: use auto or eager"
        ]
    if requested == "flash_attention_2" and (device_type != "cuda" or importlib.util.find_spec("flash_attn") is None):
        why = "needs a CUDA device" if device_type != "cuda" else "flash-attn is not installed"
        return [f"{field} = 'flash_attention_2': {why}; fix: use auto, sdpa or eager (or pip install flash-attn on a GPU machine)"]
    return []


def resolve_attn_implementation(hf_config, requested: str, device_type: str) -> str | None:
    """The ``attn_implementation`` to hand HF for ``requested`` (a ``model.attn_implementation``
    value). ``auto``: flash_attention_2 on CUDA with flash-attn installed (varlen kernels for
    packed rows), eager for a soft-capped model, else None, i.e. HF's own default for the
    family (sdpa where the model supports it, eager otherwise)."""
    if requested != "auto":
        return requested
    if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    if softcapping(hf_config) is not None:
        return "eager"
    return None


@contextlib.contextmanager
def refusing_pickled_objects(path: str):
    """Turn torch's refusal of a pickled checkpoint that holds more than tensors (a
    ``pytorch_model.bin`` that would run code when unpickled) into advice a user can act on
    safely: torch's own message suggests ``weights_only=False``, the unsafe step."""
    try:
        yield
    except pickle.UnpicklingError as exc:
        # torch's message: advice to drop weights_only (withheld), then which global it blocked.
        detail = next((line.strip() for line in str(exc).splitlines() if "global" in line.lower()), type(exc).__name__)
        raise ValueError(
            f"model.path = {path!r}: its pickled weights (*.bin) hold objects other than tensors, which could run code when "
            f"loaded, so they are refused (torch's safe loader: {detail}); fix: get the model as safetensors, or, only "
            "if you trust its source, convert it once elsewhere (load it and save_pretrained(dir, safe_serialization=True))"
        ) from None


def load_hf_model(path: str, head: str, seed: int, attn_implementation: str | None = None, value_bias: bool = True) -> nn.Module:
    """Load ``path`` through the normal HF path, on CPU, in fp32.

    ``head: lm`` gives ``AutoModelForCausalLM``; ``head: value`` gives
    ``AutoModelForTokenClassification`` with one label and no classifier dropout, its new
    ``score`` layer initialised by HF under ``torch.manual_seed(seed)`` (so every rank and
    every backend gets the same head). With ``value_bias`` False the ``score`` layer is
    bias-free, HF sequence classification's (``model.value_bias``); a checkpoint that stores a
    non-zero ``score.bias`` is then refused (dropping it would shift every score).
    ``attn_implementation`` goes to HF as is (None: HF's default for the family); see
    :func:`resolve_attn_implementation`.

    Raises:
        ValueError: ``value_bias`` False and ``path`` stores a non-zero ``score.bias``.
    """
    torch.manual_seed(seed)
    if head == "value":
        hf_config = AutoConfig.from_pretrained(path, num_labels=1)
        hf_config.classifier_dropout = 0.0  # HF defaults it to 0.1: values would be noisy in train mode
        # HF logs a multi-line LOAD REPORT (lm_head UNEXPECTED, score MISSING) that newcomers read
        # as an error; it is silenced here, anything beyond those keys is reported below.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            with refusing_pickled_objects(path):
                model, info = AutoModelForTokenClassification.from_pretrained(
                    path, config=hf_config, dtype=torch.float32, attn_implementation=attn_implementation, output_loading_info=True
                )
        finally:
            hf_logging.set_verbosity(verbosity)
        _report_value_head_load(path, info)
        missing = set(info.get("missing_keys", []))
        if not value_bias:
            return _without_score_bias(model, path, stored="score.bias" not in missing)
        if "score.bias" in missing and "score.weight" not in missing and model.score.bias is not None:
            # A sequence-classification checkpoint (a reward model): its head has no bias, so the
            # scores equal HF's only with the token-classification head's bias at 0.
            with torch.no_grad():
                model.score.bias.zero_()
        return model
    with refusing_pickled_objects(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)


def _without_score_bias(model: nn.Module, path: str, stored: bool) -> nn.Module:
    """``model`` (HF token classification) with its ``score`` layer replaced by a bias-free one
    holding the same weight: HF sequence classification's head. ``stored``: ``path`` has a
    ``score.bias`` (refused unless it is zero)."""
    old = model.score
    if stored and bool(old.bias.detach().abs().max() > 0):
        raise ValueError(
            f"model.value_bias = false, but {path!r} stores a non-zero score.bias ({old.bias.detach().flatten().tolist()}): a "
            "bias-free head would shift every score by it; fix: model.value_bias=true (a critic's head), or a checkpoint "
            "whose head has no bias (AutoModelForSequenceClassification)"
        )
    head = nn.Linear(old.in_features, old.out_features, bias=False, dtype=old.weight.dtype)
    with torch.no_grad():
        head.weight.copy_(old.weight)
    model.score = head
    return model


def _report_value_head_load(path: str, info: dict) -> None:
    """One line for the expected outcome (once per process), every surprising key in full."""
    missing, unexpected = list(info.get("missing_keys", [])), list(info.get("unexpected_keys", []))
    odd = [f"missing {k}" for k in missing if not k.startswith(_VALUE_HEAD_MISSING)]
    odd += [f"unexpected {k}" for k in unexpected if not k.startswith(_VALUE_HEAD_UNEXPECTED)]
    if odd:
        print(f"[enginekit] WARNING: loading {path} as a value model: {', '.join(odd)}", file=sys.stderr, flush=True)
    elif missing:
        note_once(f"[enginekit] value model from {path}: new one-output `score` head (seeded), LM head unused (expected)")


@functools.cache
def note_once(line: str) -> None:
    """Print an informational ``line`` to stderr once per process, on rank 0 only."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


def value_head_state(path: str, seed: int, bias: bool = True) -> dict[str, torch.Tensor]:
    """``score.weight`` (and with ``bias``, ``score.bias``) as :func:`load_hf_model`
    initialises them (or as the directory stores them, for a trained critic or reward model)."""
    model = load_hf_model(path, "value", seed, value_bias=bias)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("score.")}


def attach_router_recorder(model: nn.Module, reduce_counts, reduce_stats=None) -> RoutingRecorder | None:
    """A :class:`~engine_api.moe.RoutingRecorder` fed by forward hooks on an HF MoE model's
    routers, or None for a dense model.

    The routers are the modules HF itself records ``router_logits`` from (the model's
    ``_can_record_outputs["router_logits"]``: a class and the index of the logits in its
    output), so any HF MoE family that declares them is covered; a global layer index is read
    from the module path (``layers.<i>.``). Replay (``engine_api.moe``) rewrites the router's
    output ``(logits, top-k weights, top-k indices)`` (:func:`replayed_router_output`).
    ``reduce_counts`` / ``reduce_stats``: see :class:`~engine_api.moe.RoutingRecorder`.
    """
    spec = RouterSpec.from_hf_config(model.config)
    routers, index = router_modules(model)
    if spec is None or not routers:
        return None
    recorder = RoutingRecorder(
        spec, model.config.num_hidden_layers, reduce_counts, moe_layers=[layer for layer, _ in routers], reduce_stats=reduce_stats
    )
    for layer, module in routers:
        module.register_forward_hook(lambda mod, args, out, layer=layer: _route(recorder, layer, out, index))
    return recorder


def router_modules(model: nn.Module) -> tuple[list[tuple[int, nn.Module]], int]:
    """``([(layer index, router module)] in layer order, index of the logits in its output)``
    of an HF MoE model: the modules HF records ``router_logits`` from
    (``_can_record_outputs``); ``([], 0)`` for a model that declares none."""
    target = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if target is None:
        return [], 0
    cls, index = (target.target_class, target.index) if hasattr(target, "target_class") else (target, 0)
    routers = []
    for name, module in model.named_modules():
        match = re.search(r"layers\.(\d+)\.", name)
        if isinstance(module, cls) and match:
            routers.append((int(match.group(1)), module))
    return sorted(routers, key=lambda item: item[0]), index


def _route(recorder: RoutingRecorder, layer: int, out, index: int):
    """The router hook: record, and replace the output's routing when the recorder replays."""
    logits = out[index] if isinstance(out, tuple) else out
    parts = router_parts(out, index)
    if parts is None:
        if recorder.routing_requested:
            raise RuntimeError(
                f"routing replay / recording: the router of layer {layer} returns {type(out).__name__}, not its logits with "
                "its top-k weights and indices (the family routes inside its MoE block, e.g. DeepSeek-V3's grouped sigmoid "
                "router); fix: actor.router_replay=off for this model family"
            )
        recorder.observe(layer, logits)
        return None
    routed = recorder.observe(layer, logits, out[parts[1]])
    out = out if routed is None else replayed_router_output(out, routed, layer, index, parts)
    # what the experts get (the block passes the router's output on)
    recorder.used(layer, torch.zeros_like(logits, dtype=torch.bool).reshape(-1, logits.shape[-1]).scatter_(1, out[parts[1]].long(), True))
    return None if routed is None else out


def router_parts(out, index: int) -> tuple[int, int] | None:
    """Positions ``(weights, indices)`` in a router's output triple (the logits at ``index``;
    the indices the integer tensor), or None when the output is not such a triple. Families
    order them differently (Qwen3-MoE / Mixtral: logits, weights, indices; GraniteMoE:
    indices, weights, logits)."""
    if not isinstance(out, tuple) or len(out) != 3 or not all(isinstance(t, torch.Tensor) for t in out):
        return None
    rest = [i for i in range(3) if i != index]
    integer = [i for i in rest if not out[i].is_floating_point()]
    if len(integer) != 1:
        return None
    weights = next(i for i in rest if i != integer[0])
    return weights, integer[0]


def replayed_router_output(out: tuple, routed: torch.Tensor, layer: int, index: int = 0, parts: tuple[int, int] = (1, 2)) -> tuple:
    """An HF top-k router's output triple (logits at ``index``, top-k weights and indices at
    ``parts``) with the indices ``routed`` and the weights the router gives those experts.

    The router's weight formula is read off its own output: the weights it returned for its own
    choice are its scores at those experts (softmax, as Qwen3-MoE / Mixtral / OLMoE, or sigmoid,
    as DeepSeek-V3), renormalised over the top-k or not, times a constant (DeepSeek-V3's
    ``routed_scaling_factor``); the first form that reproduces them is applied to ``routed``,
    in the weights' dtype. (A score bias that only steers the choice, DeepSeek-V3's
    ``e_score_correction_bias``, does not enter the weights.)

    Raises:
        RuntimeError: no form reproduces the router's weights (e.g. PhiMoE's sparsemixer).
    """
    logits, weights, chosen = out[index], out[parts[0]], out[parts[1]]
    tol = 1e-5 if weights.dtype == torch.float32 else 1e-2
    for score in (torch.softmax(logits.float(), dim=-1), torch.sigmoid(logits.float())):
        for renorm in (False, True):
            own = _gate_weights(score, chosen.long(), renorm)
            scale = float((weights.float() / own).flatten().median()) if own.numel() else 1.0
            if torch.allclose(weights.float(), own * scale, rtol=tol, atol=tol):
                picked = _gate_weights(score, routed, renorm) * scale
                replaced = list(out)
                replaced[parts[0]], replaced[parts[1]] = picked.to(weights.dtype), routed.to(chosen.dtype)
                return tuple(replaced)
    raise RuntimeError(
        f"router replay: the router of layer {layer} weighs its experts by no form this replay reproduces (softmax or sigmoid "
        "scores at its top-k, renormalised or not, times a constant), so replayed experts cannot be given its weights; "
        "fix: actor.router_replay=off for this model family"
    )


def _gate_weights(score: torch.Tensor, indices: torch.Tensor, renorm: bool) -> torch.Tensor:
    """``score`` ``[rows, E]`` at ``indices`` ``[rows, k]``, renormalised over them when ``renorm``."""
    picked = score.gather(1, indices)
    return picked / picked.sum(-1, keepdim=True) if renorm else picked
