"""The rollout worker process: prompts in, scored trajectory groups out, through Redis streams."""
