"""The prompt/trajectory protocol between the trainer and the rollout workers, through Redis streams.

Streams (keys in `rljob.keys.JobKeys`): the trainer adds `PromptRequest`s to `prompts` and
`eval:prompts`; workers read them in the consumer group `rollout` and answer with a
`TrajectoryGroup` on `trajectories` (read by the trainer's group `trainer`) or `eval:results`.
Messages are JSON in the entry field `data` (`rljob.protocol`); a prompt a worker cannot parse is
answered with a rejection (`rejected`, `reason`), so the trainer fails naming the cause instead of
waiting. Exactly-once publishing: `worker_end`; the done set's lifecycle: `done`; the trainer's
recovery from its own or Redis's crashes: `trainer_end`.

Retention: the job's Redis runs with noeviction, so every entry is deleted as it is acknowledged;
a prompt stream's length is then its backlog (`backlog`, which the operator's autoscaler reads).
Nothing here imports torch: the operator imports `backlog`.
"""
