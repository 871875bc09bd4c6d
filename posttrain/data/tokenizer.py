"""The model directory's own HF tokenizer (``load_tokenizer``) and the token ids that end a
response (``stop_token_ids``: EOS, the generation config's EOS ids, the chat template's
end-of-turn token)."""

from __future__ import annotations

import json
import os


def load_tokenizer(model_path: str):
    """The model directory's own HF tokenizer (``AutoTokenizer.from_pretrained``).

    Raises:
        ValueError: the directory has no loadable tokenizer.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(
            f"engine.model.path = {model_path!r}: no HF tokenizer could be loaded from it ({str(exc).splitlines()[0]}); data files "
            "are tokenized with the model directory's own tokenizer; fix: save it there (tokenizer.save_pretrained(path))"
        ) from exc


def stop_token_ids(tokenizer, model_path: str, end_of_turn: bool = True) -> list[int]:
    """Token ids that end a response: the tokenizer's EOS, the model's generation-config EOS
    ids, and (``end_of_turn``, with a chat template) the special token the template puts right
    after an assistant message (e.g. ``<|im_end|>``, which base models' generation configs
    omit)."""
    ids = set()
    turn_end = _template_end_of_turn(tokenizer) if end_of_turn else None
    if turn_end is not None:
        ids.add(turn_end)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_path = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    if not ids:
        raise ValueError(
            f"engine.model.path = {model_path!r}: neither the tokenizer nor generation_config.json names an EOS token, so responses "
            "could never end; fix: set eos_token in the tokenizer config"
        )
    return sorted(ids)


def _template_end_of_turn(tokenizer) -> int | None:
    """The special token the chat template writes right after an assistant message's content,
    found by rendering a two-message chat; None without a template, when the template needs
    more than that chat, or when what follows the content is not a special token."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    try:
        start = tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception:  # noqa: BLE001 (a template may raise anything on a minimal chat)
        return None
    if not full.startswith(start) or not full[len(start) :].lstrip().startswith("y"):
        return None
    rest = full[len(start) :].lstrip()[1:]
    ids = tokenizer(rest, add_special_tokens=False)["input_ids"] if rest else []
    special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return int(ids[0]) if ids and ids[0] in special else None
