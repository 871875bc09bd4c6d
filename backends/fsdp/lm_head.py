"""Log-probs straight from the LM head, chunked (``engine_api.logprobs.HeadRequest``).

HF's causal LMs end with ``logits = lm_head(hidden)`` over every position: ``[tokens, vocab]``
logits in the compute dtype, which the plain path then upcasts to fp32, log-softmaxes and keeps
for backward (several fp32 ``[tokens, vocab]`` tensors per micro-batch: gigabytes at 16k tokens
and a 128k vocabulary). Here, for the length of one forward, the head module returns the
request's per-token columns instead (log-prob of the next token, entropy, target log-probs),
computed chunk by chunk from the hidden states and its own weight.

Why inside the head's forward rather than after the model: the head's weight belongs to the
root FSDP unit, which gathers it for the model's forward and reduces its gradient from the
backward of that forward's outputs; computing in the head keeps both as FSDP expects, and
every gradient flows through the one output tensor.

Where it applies (:func:`chunked_head_problem`): an ``lm`` head that is a plain
``nn.Linear``, with or without a bias (the chunks add it; a LoRA-wrapped head, a head of another
class and a model without one run the plain path, each named), and a model that hands the
head's output back unchanged as its logits. Families that transform the logits after the head
(Gemma-2's ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's
``logits_scaling``) would transform the columns instead; :func:`chunked_head_exact` compares
the two paths once on a tiny probe, and a model that fails it runs the plain path.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn as nn

from engine_api.kit import HeadRequest, lm_token_outputs, make_batch, pack

#: why a model whose head :func:`chunked_head_problem` accepts still runs the plain path
PROBE_MISMATCH = (
    "a probe's log-probs from the chunks differ from full logits': the model changes the head's output after it "
    "(e.g. a scale or a soft-cap)"
)


def chunked_head_problem(model: nn.Module) -> str | None:
    """Why the chunked head cannot serve ``model`` (None when it can), naming what it found. A
    bias is no reason: the chunks compute ``hidden @ weight.T + bias`` (``HeadRequest.columns``)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return "the model has no output head (get_output_embeddings() is None)"
    wrapped = _adapter_wrapper(head)
    if wrapped is not None:
        return wrapped
    if type(head) is not nn.Linear:
        name = f"{type(head).__module__}.{type(head).__qualname__}"
        kind = "a subclass of torch.nn.Linear" if isinstance(head, nn.Linear) else "not a torch.nn.Linear"
        return f"the output head is {name}, {kind}: its forward may compute more than the chunks' hidden @ weight.T + bias"
    if getattr(model.config, "final_logit_softcapping", None) is not None:
        return f"final_logit_softcapping = {model.config.final_logit_softcapping} transforms the logits after the head"
    return None


def _adapter_wrapper(head: nn.Module) -> str | None:
    """What peft wrapped the head in (None: nothing): its output is no longer the base weight's."""
    if "peft" not in sys.modules:  # nothing was wrapped without peft (and no import for the check)
        return None
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    name = f"{type(head).__module__}.{type(head).__qualname__}"
    if isinstance(head, LoraLayer):
        return (
            f"the output head carries LoRA adapters ({name}): its output adds the adapters' path, which the chunks, "
            "computed from the base weight alone, would leave out"
        )
    if isinstance(head, ModulesToSaveWrapper):
        return f"the output head is a trained copy of lm_head ({name}), which the chunks do not read"
    return None


@contextlib.contextmanager
def head_serves(model: nn.Module, request: HeadRequest):
    """For the forwards inside, ``model``'s LM head returns ``request.columns(hidden, W, b)``
    (shaped ``[1, tokens, C]``) instead of logits."""
    head = model.get_output_embeddings()
    own = head.__dict__.get("forward")  # an instance-level forward someone else set (kept)
    head.forward = lambda hidden: request.columns(hidden, head.weight, head.bias)[None]
    try:
        yield
    finally:
        if own is None:
            del head.forward  # the class's forward again
        else:
            head.forward = own


def chunked_head_exact(model: nn.Module, vocab_size: int, device: torch.device, half: bool = False) -> bool:
    """Whether the chunked head gives the plain path's log-probs on ``model`` (two short seeded
    sequences, one packed row; tolerance as ``packed_rows_exact``: 1e-4, 2e-2 in half
    precision). A collective under FSDP (every rank runs the same)."""
    g = torch.Generator().manual_seed(1)
    batch = make_batch([torch.randint(0, vocab_size, (n,), generator=g) for n in (5, 3)]).to(device)
    packed = pack(batch["input_ids"])
    ids, pos = packed.input_ids[None], packed.position_ids[None]
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            plain = lm_token_outputs(
                model(input_ids=ids, position_ids=pos, use_cache=False).logits[0], packed.input_ids, packed.cu_seqlens, batch
            )
            request = HeadRequest.of(batch, packed.input_ids, packed.cu_seqlens)
            with head_serves(model, request):
                chunked = request.outputs(model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float())
    finally:
        model.train(training)
    tol = 2e-2 if half else 1e-4
    return bool(torch.allclose(plain["log_probs"].float(), chunked["log_probs"], rtol=tol, atol=tol))
