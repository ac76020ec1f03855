"""The multi-turn search loop: batched over every sample of every question, one engine call a turn.

Each turn generates for all unfinished samples at once, answers all of that turn's searches with
one batched BM25 call, and appends the observations. A turn without a valid action gets a
correction and another turn, unless it ended with the model's end-of-sequence token, which ends
the episode (unanswered: reward 0). Tokens are never re-tokenised: a trajectory is
prompt ids + generated ids + injected ids, concatenated exactly as the engine saw them, so the
trainer's teacher-forced log-probs line up with `behaviour_logprobs` token for token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rljob.agent.actions import parse_action
from rljob.agent.prompt import INVALID_ACTION, STOP_STRINGS, information_block, prompt_ids
from rljob.agent.rewards import trajectory_reward
from rljob.config import AgentSpec
from rljob.engines.base import GenerationEngine, TurnParams
from rljob.protocol import PromptRequest, Trajectory, TrajectoryGroup


@dataclass
class Episode:
    """One sample being generated; becomes a Trajectory once done."""

    answers: list[str]
    token_ids: list[int]
    prompt_length: int
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    searches: list[str] = field(default_factory=list)
    answer: str | None = None
    turns: int = 0
    finish_reason: str = ""

    def __post_init__(self) -> None:
        self.loss_mask = [0] * len(self.token_ids)
        self.logprobs = [0.0] * len(self.token_ids)

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    def add_generated(self, ids: list[int], logprobs: list[float]) -> None:
        self.token_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs

    def add_injected(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def to_trajectory(self, spec: AgentSpec, policy_version: int) -> Trajectory:
        format_ok = self.answer is not None
        reward, em, f1 = trajectory_reward(self.answer, self.answers, format_ok, len(self.searches), spec)
        return Trajectory(
            token_ids=self.token_ids,
            prompt_length=self.prompt_length,
            loss_mask=self.loss_mask,
            behaviour_logprobs=self.logprobs,
            policy_version=policy_version,
            searches=self.searches,
            answer=self.answer,
            reward=reward,
            exact_match=em,
            f1=f1,
            format_ok=format_ok,
            num_turns=self.turns,
            finish_reason=self.finish_reason,
        )


def run_episodes(
    engine: GenerationEngine,
    retriever: Any,
    questions: Sequence[tuple[str, list[str]]],
    spec: AgentSpec,
    greedy: bool = False,
) -> list[Episode]:
    """Play (question, gold answers) pairs to the end under the protocol's turn and token budgets."""
    tokenizer = engine.tokenizer
    episodes = []
    for question, answers in questions:
        ids = prompt_ids(tokenizer, question)
        episodes.append(Episode(answers=list(answers), token_ids=list(ids), prompt_length=len(ids)))
    for ep in episodes:
        if len(ep.token_ids) >= spec.max_total_tokens:
            ep.finish_reason = "length"

    def inject(ep: Episode, text: str, last_turn: bool) -> None:
        if len(ep.token_ids) >= spec.max_total_tokens:
            ep.finish_reason = "length"  # the turn used the whole budget, on the last turn as on others
            return
        if last_turn:
            ep.finish_reason = "max_turns"
            return
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ep.token_ids) + len(ids) >= spec.max_total_tokens:
            ep.finish_reason = "length"  # no room left to read the observation and answer
            return
        ep.add_injected(ids)

    for turn in range(spec.max_turns):
        active = [ep for ep in episodes if not ep.done]
        if not active:
            break
        last_turn = turn == spec.max_turns - 1
        budgets = [min(spec.max_new_tokens_per_turn, spec.max_total_tokens - len(ep.token_ids)) for ep in active]
        params = TurnParams(
            max_new_tokens=budgets, temperature=spec.temperature, top_p=spec.top_p, greedy=greedy, stop=STOP_STRINGS
        )
        outputs = engine.generate([ep.token_ids for ep in active], params)
        searching: list[Episode] = []
        for ep, out in zip(active, outputs, strict=True):
            ep.add_generated(out.token_ids, out.logprobs)
            ep.turns += 1
            action = parse_action(out.text)
            if action.kind == "answer":
                ep.answer, ep.finish_reason = action.content, "answer"
            elif action.kind == "search":
                ep.searches.append(action.content)
                searching.append(ep)
            elif out.finish_reason == "eos":
                # The model ended its message without an action: the episode ends there, unanswered.
                # Going on would train tokens after its own end-of-sequence, outside the chat format.
                ep.finish_reason = "eos"
            else:
                inject(ep, INVALID_ACTION, last_turn)
        if searching:
            results = retriever.search_batch([ep.searches[-1] for ep in searching], spec.top_k)
            for ep, passages in zip(searching, results, strict=True):
                inject(ep, information_block(passages, spec.passage_max_words), last_turn)
    for ep in episodes:
        if not ep.done:
            ep.finish_reason = "length"
    return episodes


def generate_groups(
    engine: GenerationEngine,
    retriever: Any,
    requests: Sequence[PromptRequest],
    agent_spec: AgentSpec,
    worker_id: str = "local",
) -> list[TrajectoryGroup]:
    """One TrajectoryGroup per request (G samples each), in request order.

    All samples of all requests share each turn's engine call; greedy (eval) requests are run in
    their own batch because the decoding rule is per call.
    """
    groups: dict[str, TrajectoryGroup] = {}
    for greedy in (False, True):
        part = [r for r in requests if r.greedy == greedy]
        if not part:
            continue
        started = time.perf_counter()
        version = engine.policy_version
        questions = [(r.question, r.answers) for r in part for _ in range(r.group_size)]
        episodes = run_episodes(engine, retriever, questions, agent_spec, greedy=greedy)
        seconds = time.perf_counter() - started
        offset = 0
        for r in part:
            mine = episodes[offset : offset + r.group_size]
            offset += r.group_size
            groups[r.request_id] = TrajectoryGroup(
                request_id=r.request_id,
                step=r.step,
                question_id=r.question_id,
                worker_id=worker_id,
                trajectories=[ep.to_trajectory(agent_spec, version) for ep in mine],
                generation_seconds=seconds,
            )
    return [groups[r.request_id] for r in requests]
