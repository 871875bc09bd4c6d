"""Train an agent that already exists as ordinary code calling an OpenAI-style API: an
OpenAI-compatible gateway over the rollout, one session per trajectory, tokens kept exactly as
sampled (docs/agents.md#agents-behind-an-openai-api).

Modules (imported on use; none is imported by this package):

* ``config``: ``AgentConfig`` (the RL recipe's ``agent`` section) and its cross-section checks;
* ``wire``: the chat-completions wire format (requests checked, answers, streams, errors);
* ``session``: one session = one trajectory, its messages mapped onto the kept tokens;
* ``server``: the HTTP server (uvicorn thread on rank 0) and each session's allowance of calls;
* ``agents``: running ``agent.function`` per session in worker processes (``agent_worker``);
* ``producer``: ``GatewayProducer``, the sessions of a batch as a ``Producer`` of RL batches.
"""
