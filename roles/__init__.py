"""RL roles (actor, critic, reference, rollout) written on BaseEngine calls only."""
