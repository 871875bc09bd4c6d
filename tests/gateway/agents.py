"""Agents for the gateway tests (``agent.function=tests/gateway/agents.py:<name>``), each ordinary
code against the OpenAI API with the ``openai`` SDK; a light module (no torch): the agent
worker processes import it."""

from __future__ import annotations

import http.client
import os
import sys
import time
import urllib.parse

import openai
from openai import OpenAI

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "agents"))
from openai_calculator import run as calculator_agent  # noqa: E402, F401 (the shipped example)


def _client(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key="enginekit", max_retries=0, timeout=60)


def two_turns(base_url: str, **row) -> float:
    client = _client(base_url)
    messages = [{"role": "user", "content": "ab"}]
    first = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "ab"}]
    client.chat.completions.create(model="m", messages=messages)
    return 1.0


def rewrites_history(base_url: str, **row) -> float:
    """Its second call edits its first answer: refused (error mode) or split."""
    client = _client(base_url)
    messages = [{"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
    messages += [{"role": "assistant", "content": first + " (edited)"}, {"role": "user", "content": "again"}]
    try:
        client.chat.completions.create(model="m", messages=messages)
    except openai.BadRequestError as exc:
        return 1.0 if "renders the conversation before assistant turn 1 differently" in str(exc) else -1.0
    return 2.0


def by_row(base_url: str, how: str, **row):
    """Fails as the row says, or runs the calculator agent."""
    print("agent prints this to stderr", flush=True)
    if how == "raises":
        raise RuntimeError("the agent's own bug")
    if how == "exits":
        os._exit(3)
    if how == "hangs":
        time.sleep(60)
    if how == "no_call":
        return 1.0
    return calculator_agent(base_url, question="What is 2+3?")


def probes(base_url: str, question: str, **row):
    """Bad requests first (each must be refused with an OpenAI error), then the real work."""
    client = _client(base_url)
    user = [{"role": "user", "content": question}]
    refusals = []
    for kwargs in (
        {"messages": user, "n": 2},
        {"messages": [*user, {"role": "tool", "tool_call_id": "call_nobody_issued", "content": "5"}]},
        {"messages": [{"role": "user", "content": "x" * 5000}]},
        {"messages": user, "tool_choice": "required", "tools": []},
    ):
        try:
            client.chat.completions.create(model="m", **kwargs)
            refusals.append(None)
        except openai.APIStatusError as exc:
            refusals.append(exc.status_code)
    if refusals != [400, 400, 413, 400]:
        raise AssertionError(f"refusals {refusals}")
    parts = urllib.parse.urlsplit(base_url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    for _ in range(10_000):  # requests without a model call (one keep-alive connection)
        connection.request("GET", f"{parts.path}/models")
        answer = connection.getresponse()
        answer.read()
        if answer.status != 200:
            raise AssertionError(f"/models answered {answer.status}")
    connection.close()
    return calculator_agent(base_url, question=question)


def three_calls(base_url: str, prompt: str, **row) -> float:
    """Always three calls (the third waits for the next round when a round allows two)."""
    client = _client(base_url)
    messages = [{"role": "user", "content": prompt}]
    for _ in range(3):
        text = client.chat.completions.create(model="m", messages=messages, max_tokens=2).choices[0].message.content
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "1"}]
    return float(len(text))
