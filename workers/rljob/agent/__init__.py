"""The Search-R1 style agent: prompt, action parsing, rewards and the multi-turn rollout loop.

`rljob.agent.rollout.generate_groups` imports torch-free modules only; the engines bring torch.
"""
