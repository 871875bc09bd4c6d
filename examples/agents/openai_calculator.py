"""An agent with tool calling, written with the plain ``openai`` SDK as for any OpenAI-compatible
server: it offers a calculator, runs the calls the model makes, sends the results back as
``tool`` messages, and returns the model's final answer (``reward.function`` scores it, e.g.
``math_answer``). Nothing in it knows it is being trained: the RL run hands it a session URL as
``base_url`` (docs/agents.md#agents-behind-an-openai-api).

Use: ``agent.function=examples/agents/openai_calculator.py:run`` with data rows that have a
``question`` column (and ``answer`` for the reward).
"""

from __future__ import annotations

import json

from openai import OpenAI

from posttrain.agents.builtin_tools import calculator

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
        },
    }
]


def run(base_url: str, question: str, max_turns: int = 5, **row) -> str:
    client = OpenAI(base_url=base_url, api_key="enginekit", max_retries=0)
    messages = [
        {"role": "system", "content": "Use the calculator for arithmetic. Put the final answer in \\boxed{}."},
        {"role": "user", "content": question},
    ]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as exc:  # noqa: BLE001 (a bad call is the model's to see)
                result = f"Error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return messages[-1].get("content") or ""
