"""Multi-turn agentic RL: trajectories kept token in, token out, environments and tools
(docs/agents.md).

The names below are imported on first use (PEP 562), so a light submodule (the tool worker
process, ``posttrain.agents.tool_worker``) starts without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AgentBatch": "posttrain.agents.loop",
    "AgentLoop": "posttrain.agents.loop",
    "AgentProducer": "posttrain.agents.producer",
    "AgentRun": "posttrain.agents.loop",
    "EnvConfig": "posttrain.agents.config",
    "Environment": "posttrain.agents.env",
    "HistoryMismatch": "posttrain.agents.trajectory",
    "StepResult": "posttrain.agents.env",
    "ToolCall": "posttrain.agents.tools",
    "ToolEnv": "posttrain.agents.env",
    "ToolResult": "posttrain.agents.tools",
    "Trajectory": "posttrain.agents.trajectory",
    "Turn": "posttrain.agents.env",
    "parse_tool_calls": "posttrain.agents.tools",
    "run_tool": "posttrain.agents.tools",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'posttrain.agents' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
