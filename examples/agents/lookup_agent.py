"""The gateway demo's agent (``configs/agent_gateway_tiny.yaml``): ordinary code against the
OpenAI API, written with the plain ``openai`` SDK; the RL run trains the model behind it by
giving it a session URL as ``base_url``, nothing else changed.

The task is the multi-turn demo's (``posttrain.agents.demo``): each row asks for the value stored
under a key (``key 37``), a random digit per row that only a lookup reveals. The agent sends the
question; when the model's answer asks for the lookup (it contains ``<tool_call>``, the demo
vocabulary's single tool token), the agent replies with the row's value and asks again; the first
answer without a call is the final one. Reward: 0.8 for the right value (digit by digit), plus
0.2 when the lookup came first (the demo environment's score).
"""

from __future__ import annotations

from openai import OpenAI


def run(base_url: str, prompt: str, value: str, **row) -> float:
    client = OpenAI(base_url=base_url, api_key="enginekit", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    called = False
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        if "<tool_call>" in text:
            called = True
            messages.append({"role": "user", "content": str(value)})
            continue
        answer = text.strip()
        right = sum(a == b for a, b in zip(answer, str(value), strict=False)) / len(str(value))
        return 0.8 * right + 0.2 * called
    return 0.2 * called
