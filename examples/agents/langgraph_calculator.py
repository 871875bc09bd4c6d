"""The calculator agent written with an agent framework: LangGraph's prebuilt ReAct agent over
LangChain's ``ChatOpenAI`` (the ``agents`` extra installs both). The framework runs the loop
(model, tool calls, tool messages, model) against the session URL it is given as ``base_url``;
the RL run trains the model behind it unchanged (docs/agents.md#agents-behind-an-openai-api).

Use: ``agent.function=examples/agents/langgraph_calculator.py:run`` with rows that have a
``question`` column; its final answer goes to ``reward.function``.
"""

from __future__ import annotations

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from posttrain.agents.builtin_tools import calculator as evaluate


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses."""
    return evaluate(expression)


def run(base_url: str, question: str, **row) -> str:
    model = ChatOpenAI(base_url=base_url, api_key="enginekit", model="policy", max_retries=0)
    agent = create_react_agent(model, [calculator])
    state = agent.invoke({"messages": [("user", question)]}, {"recursion_limit": 12})
    return state["messages"][-1].content
