"""``async``: the RL recipe's asynchronous mode (``posttrain.async_rl``)."""

from __future__ import annotations

from dataclasses import dataclass

# The largest K accepted: each of the K steps ahead holds a whole batch of prompts and responses
# in memory, and the field runs 1-8 (verl and prime-rl default to 8); past this it is a typo.
MAX_STALENESS = 64


@dataclass(frozen=True)
class AsyncConfig:
    """How far the rollout may run ahead of training (docs/async.md).

    Attributes:
        max_staleness: K, the bound. A sample's staleness is the trainer's version at its
            update minus the OLDEST weight version that sampled any of its tokens; none is
            trained beyond K. 0: the synchronous loop (sample a step's batch with the newest
            weights, then train on it). K >= 1: the prompts of step ``s + K`` are admitted
            while step ``s`` trains, and the rollout generates them while the actor updates
            (overlapped when the rollout has a Ray pool of its own).
        partial_rollouts: with K >= 1, spread each admitted batch's generation over the K
            steps it has before it is trained: the unfinished responses pause at a token
            boundary at every weight update and continue under the new weights (each token
            records the version that sampled it). False: a batch is generated whole, under
            one version, the step it is admitted.
        deterministic: the schedule (which tokens each weight version samples) is fixed by
            the step and the data order, never by timing, so two runs, and a resumed run and an
            uninterrupted one, are bit-identical. The only schedule today: false is refused.
        check_version_parity: a debugging probe: before each update the actor (at version
            ``s + 1``) also scores every response sampled so far, and the largest gap between
            its log-probs and the rollout's over the tokens version ``s + 1`` sampled is logged
            as ``async/version_logprob_abs_diff_max`` (float noise when the rollout samples
            what the trainer trains). Costs an actor forward over the K batches in flight and
            runs the rollout's round before the update (no overlap).
    """

    max_staleness: int = 0
    partial_rollouts: bool = True
    deterministic: bool = True
    check_version_parity: bool = False

    @property
    def enabled(self) -> bool:
        """Whether the rollout runs ahead of training (K >= 1)."""
        return self.max_staleness > 0

    def _problems(self) -> list[str]:
        out = []
        k = self.max_staleness
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            out.append(f"max_staleness = {k!r}: must be an integer >= 0 (0: synchronous); fix: e.g. 2")
        elif k > MAX_STALENESS:
            out.append(
                f"max_staleness = {k}: above the limit {MAX_STALENESS} (each of the K steps ahead holds a whole batch of prompts "
                "and responses in memory; asynchronous trainers run 1-8); fix: e.g. async.max_staleness=2"
            )
        if self.deterministic is not True:
            out.append(
                f"deterministic = {self.deterministic!r}: the timing-driven schedule is not built; the deterministic one (the "
                "schedule fixed by the step and the data order) overlaps rollout and training the same way; fix: async.deterministic=true"
            )
        return out
