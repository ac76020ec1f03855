"""Test scaffolding (toy environments, tiny models, a tunable rollout worker): not part of the wheel."""
