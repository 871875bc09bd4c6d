"""A plain-HF sampler for ``roles.rollout.Rollout`` (CPU; KV cache, prompts batched by length).

Exactness over speed: the recorded log-prob of each sampled token is
``log_softmax(logits / temperature)`` from the same forward that sampled it, which is what the
actor computes for that token with the same ``temperature`` metadata. Prompts are batched only
with prompts of the same length, so no row is padded and no attention mask is needed: each
row's logits are those of a forward of that sequence alone (up to batched-matmul rounding).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from transformers import AutoConfig, AutoModelForCausalLM


class HFSampler:
    """Owns an HF causal LM built from ``model_path``'s config; weights arrive via ``load_weights``.

    A row stops after sampling one of ``eos_token_id`` (an id or several; None: every row runs
    ``max_new_tokens``), or after the token that completes one of ``stop_strings`` in the
    row's decoded response (needs ``tokenizer``; the stop string stays in the response, as in
    HF ``generate``). A stop string is looked for in the decoded text of the last
    ``len(stop) + 8`` tokens, which holds it whenever those tokens decode to at least one
    character each on average (every tokenizer in use; byte-fallback pieces decode to less).
    """

    def __init__(
        self,
        model_path: str,
        eos_token_id: int | Sequence[int] | None = None,
        stop_strings: Sequence[str] = (),
        tokenizer=None,
    ) -> None:
        config = AutoConfig.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=torch.float32).eval()
        ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.eos_ids = torch.tensor(ids, dtype=torch.long)
        # Rows that ended keep being fed this id (their later draws are discarded).
        self.eos_token_id = ids[0] if ids else None
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings need the tokenizer that decodes the responses; fix: pass tokenizer=")
        self.stop_strings, self.tokenizer = [s for s in stop_strings if s], tokenizer
        self._window = max((len(s) for s in self.stop_strings), default=0) + 8

    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(hf_name, tensor)`` pairs into the model (tied heads may come twice)."""
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in state:
                    raise KeyError(
                        f"exported weight {name!r} is not a parameter of the rollout model; fix: build both from the same HF directory"
                    )
                state[name].copy_(tensor.to(state[name].device, state[name].dtype))

    @torch.no_grad()
    def sample(
        self, prompts: Sequence[torch.Tensor], max_new_tokens: int, temperature: float, top_p: float, generator: torch.Generator
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Sample up to ``max_new_tokens`` per prompt (a row stops after ``eos_token_id``); see
        ``Sampler.sample``. Groups of equal-length prompts are decoded together, in order of
        first appearance, so the draws from ``generator`` depend only on the prompts."""
        groups: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault(len(prompt), []).append(i)
        results: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(prompts)  # type: ignore[list-item]
        for members in groups.values():
            for i, result in zip(
                members,
                self._sample_group(torch.stack([prompts[i] for i in members]), max_new_tokens, temperature, top_p, generator),
                strict=True,
            ):
                results[i] = result
        return results

    def _sample_group(self, prompts: torch.Tensor, max_new_tokens: int, temperature: float, top_p: float, generator: torch.Generator):
        """Decode a [B, P] block of equal-length prompts; rows that sampled EOS keep being fed
        it (their later draws are discarded), so the batch keeps one shape and one KV cache."""
        out = self.model(prompts, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
        tokens, log_probs = [], []
        done = torch.zeros(len(prompts), dtype=torch.bool)
        lengths = torch.full((len(prompts),), max_new_tokens)
        for step in range(max_new_tokens):
            logp = torch.log_softmax(logits.float() / temperature, dim=-1)
            token = _sample_top_p(logp, top_p, generator)
            token = torch.where(done, torch.full_like(token, self.eos_token_id or 0), token)
            tokens.append(token)
            log_probs.append(logp.gather(1, token[:, None])[:, 0])
            ended = ~done & torch.isin(token, self.eos_ids)
            if self.stop_strings:
                ended |= ~done & self._hits_stop_string(torch.stack(tokens, 1))
            lengths[ended] = step + 1
            done |= ended
            if bool(done.all()) or step + 1 == max_new_tokens:
                break
            out = self.model(token[:, None], past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1]
        ids, lps = torch.stack(tokens, 1), torch.stack(log_probs, 1)
        return [(ids[r, : int(n)].clone(), lps[r, : int(n)].clone()) for r, n in enumerate(lengths.tolist())]

    def _hits_stop_string(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows whose newest token [B, T][:, -1] completes a stop string: one is in the decoded
        tail window and was not before that token."""
        hits = torch.zeros(len(ids), dtype=torch.bool)
        for r, row in enumerate(ids[:, -self._window :].tolist()):
            now = self.tokenizer.decode(row, skip_special_tokens=False)
            before = self.tokenizer.decode(row[:-1], skip_special_tokens=False) if len(row) > 1 else ""
            hits[r] = any(s in now and now.count(s) > before.count(s) for s in self.stop_strings)
        return hits


def _sample_top_p(logp: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``logp`` [B, V] from the smallest prefix of mass >= ``top_p``."""
    probs = logp.exp()
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    return torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=generator)[:, 0]
