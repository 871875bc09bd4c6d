"""The HF forward of one micro-batch in the protocol's layouts, shared by ``FSDPEngine`` and
the legacy FSDP workers (``roles/legacy``), so both read the same logits."""

from __future__ import annotations

import torch.nn as nn
from tensordict import TensorDict

from engine_api.batch import pack, pad, unpack
from engine_api.logprobs import align_to_tokens, token_entropy, token_log_probs


def hf_forward(model: nn.Module, mb: TensorDict, head: str, remove_padding: bool) -> TensorDict:
    """Per-token outputs of micro-batch ``mb`` (jagged ``input_ids`` on the model's device).

    ``head: lm`` gives ``log_probs`` (and ``entropy`` when the metadata ``calculate_entropy`` is
    True; logits are divided by metadata ``temperature``, default 1); ``head: value`` gives
    ``values``, where ``values[i]`` is predicted from the prefix before token i (0 at 0).

    ``remove_padding``: one packed row with per-sequence positions, no mask and no KV cache, so
    HF starts a new sequence wherever the positions restart (varlen kernels with flash-attn);
    otherwise a right-padded batch with an attention mask.
    """
    ids = mb["input_ids"]
    packed = pack(ids)
    if remove_padding:
        out = model(input_ids=packed.input_ids[None], position_ids=packed.position_ids[None], use_cache=False)
        flat = out.logits[0]
    else:
        padded, mask = pad(ids)
        out = model(input_ids=padded, attention_mask=mask.long(), use_cache=False)
        flat = out.logits[mask]  # back to packed order
    if head == "value":
        values = align_to_tokens(flat[:-1, 0].float(), packed.cu_seqlens)
        return TensorDict({"values": unpack(values, ids)}, batch_size=mb.batch_size)
    temperature = float(mb.get_non_tensor("temperature", 1.0))
    logits = flat / temperature if temperature != 1.0 else flat
    outputs = {"log_probs": unpack(token_log_probs(logits, packed.input_ids, packed.cu_seqlens), ids)}
    if mb.get_non_tensor("calculate_entropy", False):
        outputs["entropy"] = unpack(token_entropy(logits, packed.cu_seqlens), ids)
    return TensorDict(outputs, batch_size=mb.batch_size)
