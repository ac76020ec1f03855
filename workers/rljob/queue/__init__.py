"""The prompt/trajectory protocol between the trainer and the rollout workers, through Redis streams.

One home for both ends, so that each rule is written once:

- Streams (keys in `rljob.keys.JobKeys`): the trainer adds `PromptRequest`s to `prompts` and
  `eval:prompts`; workers read them in the consumer group `rollout` and answer with a
  `TrajectoryGroup` on `trajectories` (read by the trainer's group `trainer`) or `eval:results`.
  Messages are JSON in the entry field `data` (`rljob.protocol`); a prompt a worker cannot parse
  is answered with a rejection (`rejected`, `reason`), so the trainer fails naming the cause
  instead of waiting.
- Exactly once: a worker publishes a group, marks its request done and acknowledges the prompt in
  one transaction (`worker_end.publish_group`); a request already done is only acknowledged.
- The done set's lifecycle (`done.DoneSet`): a request id enters when its group is published and
  leaves once the trainer has trained (or read) it, so the set holds only what is in flight.
- Retention: the job's Redis runs with noeviction, so every entry is deleted as it is acknowledged;
  a prompt stream's length is then its backlog (`backlog`, which the operator's autoscaler reads).

Nothing here imports torch: the operator imports `backlog`.
"""
