"""Multi-turn agentic RL: trajectories kept token in, token out, environments and tools
(docs/agents.md)."""

from posttrain.agents.config import EnvConfig
from posttrain.agents.env import Environment, StepResult, ToolEnv, Turn
from posttrain.agents.loop import AgentBatch, AgentLoop, AgentRun
from posttrain.agents.tools import ToolCall, parse_tool_calls, run_tool
from posttrain.agents.trajectory import HistoryMismatch, Trajectory

__all__ = [
    "AgentBatch",
    "AgentLoop",
    "AgentRun",
    "EnvConfig",
    "Environment",
    "HistoryMismatch",
    "StepResult",
    "ToolCall",
    "ToolEnv",
    "Trajectory",
    "Turn",
    "parse_tool_calls",
    "run_tool",
]
