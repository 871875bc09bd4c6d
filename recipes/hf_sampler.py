"""A plain-HF sampler for ``roles.rollout.Rollout`` (CPU; one sequence at a time with a KV cache).

Exactness over speed: the recorded log-prob of each sampled token is
``log_softmax(logits / temperature)`` from the same forward that sampled it, which is what the
actor computes for that token with the same ``temperature`` metadata.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import AutoConfig, AutoModelForCausalLM


class HFSampler:
    """Owns an HF causal LM built from ``model_path``'s config; weights arrive via ``load_weights``."""

    def __init__(self, model_path: str, eos_token_id: int | None = None) -> None:
        config = AutoConfig.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=torch.float32).eval()
        self.eos_token_id = eos_token_id

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
    def sample(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float, top_p: float, generator: torch.Generator):
        """Sample up to ``max_new_tokens`` (stopping after ``eos_token_id``); see ``Sampler.sample``."""
        out = self.model(prompt[None], use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
        tokens, log_probs = [], []
        for _ in range(max_new_tokens):
            logp = torch.log_softmax(logits.float() / temperature, dim=-1)
            token = _sample_top_p(logp, top_p, generator)
            tokens.append(token)
            log_probs.append(logp[token])
            if token == self.eos_token_id:
                break
            out = self.model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
        return torch.tensor(tokens, dtype=torch.long), torch.stack(log_probs)


def _sample_top_p(logp: torch.Tensor, top_p: float, generator: torch.Generator) -> int:
    probs = logp.exp()
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        keep = (sorted_probs.cumsum(0) - sorted_probs) < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
