"""The trained model as an HF directory: merged weights (``AutoModelForCausalLM``) or a peft
adapter directory (``PeftModel.from_pretrained``), from any engine or role through the
``engine_api`` export methods (``export_weights``, ``export_adapter_weights``)."""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from engine_api.dist import all_reduce, comm_device, is_initialized
from posttrain.dist import rank
from posttrain.text_data import load_tokenizer

__all__ = ["save_hf"]


def _hf_model_of(model_path: str, head: str):
    """The HF model the export is written into: a causal LM, or for ``model.head: value`` an
    ``AutoModelForSequenceClassification`` with one label (the critic's and reward model's
    weights under the same names: ``model.*``, ``score.weight``; the engine head's ``score.bias``,
    a constant offset of every score, has no place there and is dropped, said once). HF scores a row at its last token
    that is not ``pad_token_id`` (the config's, kept as is; batches of several rows need one):
    the engine's score when no real token at a sequence's end is the pad id."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    if head != "value":
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = AutoConfig.from_pretrained(model_path, num_labels=1)
    return AutoModelForSequenceClassification.from_pretrained(model_path, config=config, dtype=torch.float32)


def save_hf(source, engine_config, out_dir: str, fmt: str = "merged") -> str:
    """Write the trained model of ``source`` (an engine or a role) as an HF directory.
    Collective: every rank drains the export; rank 0 writes; every rank returns once the
    directory is complete.

    ``fmt``:
        * ``merged``: the weights ``source.export_weights()`` yields (a value head: an HF
          ``AutoModelForSequenceClassification`` directory, :func:`_hf_model_of`) (with LoRA: merged, in the
          compute dtype of the engine's mixed-precision policy) as float32 safetensors, with the config, generation
          config and tokenizer of ``engine_config.model.path`` (the tokenizer only when that
          directory has one); rank 0 assembles the model in CPU memory.
        * ``adapter``: a peft adapter directory (``adapter_config.json``,
          ``adapter_model.safetensors``) from ``source.export_adapter_weights()``, plus the
          tokenizer; load it with ``PeftModel.from_pretrained(base, out_dir)``.

    The directory appears whole or not at all (written next to ``out_dir``, then renamed), and a
    previous ``out_dir`` is replaced only after the new one is complete.

    Raises:
        ValueError: (rank 0) an exported name is not a parameter of the HF model, a shape
            differs, or a parameter received no value; nothing is written then.
    """
    model_path = engine_config.model.path
    rank0 = rank() == 0
    problems, written, model, state = [], set(), None, {}
    dropped_bias = None
    if rank0:
        try:
            model = _hf_model_of(model_path, engine_config.model.head)
            state = model.state_dict()
        except (OSError, ValueError) as exc:  # still drain the export below: it is collective
            problems.append(f"cannot load the HF model to write into: {exc}")
    if fmt == "adapter":
        adapters = {name: tensor for name, tensor in source.export_adapter_weights()}  # collective
        if model is not None:
            model = _peft_model_with(model, engine_config, adapters, problems)
    else:
        with torch.no_grad():
            for name, tensor in source.export_weights():  # drained on every rank: it is collective
                if model is None:
                    continue
                if name == "score.bias" and name not in state:  # an HF sequence-classification head has no bias
                    dropped_bias = tensor.float().reshape(-1)
                    continue
                if name not in state or state[name].shape != tensor.shape:
                    got = "not a parameter" if name not in state else f"shape {tuple(tensor.shape)} != {tuple(state[name].shape)}"
                    problems.append(f"{name}: {got}")
                    continue
                state[name].copy_(tensor.to(torch.float32))
                written.add(state[name].data_ptr())
        problems += [f"{n}: no exported value" for n, t in state.items() if t.data_ptr() not in written]  # tied names share storage
    failed = torch.tensor([float(bool(problems))])
    if is_initialized():  # every rank learns whether rank 0 may write (none waits on a failed peer)
        failed = all_reduce(failed.to(comm_device(None)), "sum", None).cpu()
    if problems:
        raise ValueError(f"trainer.save_hf: the export does not match the HF model of {model_path!r}: " + "; ".join(problems[:5]))
    if failed.item():
        raise RuntimeError("trainer.save_hf: rank 0 found the export does not match the HF model (its error says how); nothing written")
    if rank0:
        _write_dir(out_dir, model, model_path)
        if dropped_bias is not None and bool(dropped_bias.abs().max() > 0):
            print(
                f"[enginekit] {out_dir}: the value head's bias ({dropped_bias.tolist()}) is not in HF's sequence-classification "
                "head, so HF's scores are the engine's minus it (differences, and a Bradley-Terry model's ranking, unchanged)",
                flush=True,
            )
    if is_initialized():
        dist.barrier()
    return out_dir


def _peft_model_with(model, engine_config, adapters: dict, problems: list[str]):
    """peft's model on ``model`` with the engine's LoRA settings and ``adapters`` loaded."""
    import peft

    wrapped = peft.get_peft_model(model, engine_config.model.lora.to_peft(engine_config.model.head))
    expected = set(peft.get_peft_model_state_dict(wrapped))
    try:
        result = peft.set_peft_model_state_dict(wrapped, adapters)
    except (RuntimeError, ValueError, KeyError) as exc:  # e.g. a shape mismatch; the other ranks must still learn of it
        problems.append(f"the adapters do not load into peft's model: {exc}")
        return wrapped
    problems += [f"{k}: not an adapter of the peft model" for k in result.unexpected_keys]
    problems += [f"{k}: no exported value" for k in sorted(expected - set(adapters))]
    return wrapped


def _write_dir(out_dir: str, model, model_path: str) -> None:
    """``model.save_pretrained`` + the tokenizer of ``model_path`` into ``out_dir``, atomically.

    An ``out_dir`` that is a symbolic link (an export directory placed on another disk) is
    replaced where it points, so the link stays valid; a leftover ``.tmp`` / ``.old`` that is a
    link is unlinked, never followed."""
    if os.path.islink(out_dir):
        out_dir = os.path.realpath(out_dir)
    tmp, old = f"{out_dir}.tmp", f"{out_dir}.old"
    _delete(tmp)
    model.save_pretrained(tmp)
    try:
        load_tokenizer(model_path).save_pretrained(tmp)
    except ValueError:
        pass  # a model directory without a tokenizer (the built tiny model): weights + config only
    if os.path.lexists(out_dir):  # lexists: a broken link is in the way of the rename too
        _delete(old)
        os.replace(out_dir, old)  # renames a link itself, never its target
    os.replace(tmp, out_dir)
    _delete(old)


def _delete(path: str) -> None:
    """Remove ``path`` if present: a symbolic link (broken or not) or a file is unlinked, never
    followed (``shutil.rmtree`` refuses a link, and with ``ignore_errors`` silently left it in the
    way of the next export's rename); a directory tree is removed best-effort."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
