"""Action parsing, prompt building and the multi-turn loop on a tiny random model."""

from __future__ import annotations

import pytest
import torch

from rljob.agent.actions import Action, parse_action
from rljob.agent.prompt import INVALID_ACTION, information_block, prompt_ids
from rljob.agent.rollout import generate_groups, run_episodes
from rljob.assets import hotpotqa_file
from rljob.config import AgentSpec
from rljob.data.hotpotqa import Passage, load_questions
from rljob.engines.base import Completion, GenerationEngine, TurnParams
from rljob.engines.hf import HFEngine
from rljob.protocol import PromptRequest
from rljob.retrieval import Retriever
from support.tiny_models import tiny_random_model, train_tiny_tokenizer

torch.set_num_threads(1)


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("<think>hmm</think> <search> capital of France </search>", Action("search", "capital of France")),
        ("<answer> Paris </answer>", Action("answer", "Paris")),
        ("<answer> I think <answer> Paris </answer>", Action("answer", "Paris")),
        ("<search>a</search><answer>b</answer>", Action("search", "a")),  # the first closing tag wins
        ("<answer>b</answer> then <search>a</search>", Action("answer", "b")),
        ("<search>   </search>", Action("invalid")),
        ("Paris </answer>", Action("invalid")),
        ("I am not sure.", Action("invalid")),
        ("<search>multi\nline\tquery</search>", Action("search", "multi line query")),
    ],
)
def test_parse_action(text: str, action: Action) -> None:
    assert parse_action(text) == action


def test_information_block_titles_and_trims() -> None:
    block = information_block([Passage("Paris", "one two three four"), Passage("Lyon", "x")], max_words=2)
    assert "Doc 1 (Title: Paris) one two ..." in block and "Doc 2 (Title: Lyon) x" in block
    assert block.strip().startswith("<information>") and block.strip().endswith("</information>")
    assert "No results." in information_block([], 5)


class ScriptedEngine(GenerationEngine):
    """Replays fixed turn texts through a real tokenizer: exercises the loop's bookkeeping. A turn
    given as (text, "eos") ends with the tokenizer's end-of-sequence token, as a model's would."""

    def __init__(self, tokenizer, turns: list[str | tuple[str, str]]):
        self.tokenizer, self.turns, self.calls = tokenizer, turns, []

    def generate(self, contexts, params: TurnParams):
        self.calls.append((len(contexts), params))
        turn = self.turns[len(self.calls) - 1]
        text, reason = turn if isinstance(turn, tuple) else (turn, "stop")
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if reason == "eos":
            ids.append(self.tokenizer.eos_token_id)
        return [Completion(ids, [-0.5] * len(ids), text, reason) for _ in contexts]

    def sync_weights(self, reader):
        raise NotImplementedError


@pytest.fixture(scope="module")
def corpus_and_tokenizer():
    questions = load_questions(hotpotqa_file("dev.jsonl"), limit=60)
    tokenizer = train_tiny_tokenizer([q.question for q in questions] + [p.text for q in questions for p in q.context])
    return questions, Retriever.from_questions(questions), tokenizer


def test_loop_masks_injected_tokens_and_scores(corpus_and_tokenizer) -> None:
    questions, retriever, tokenizer = corpus_and_tokenizer
    q = questions[0]
    engine = ScriptedEngine(tokenizer, ["<search> Helensvale </search>", "oops", f"<answer> {q.answers[0]} </answer>"])
    spec = AgentSpec(max_turns=4, max_total_tokens=4096, format_reward=0.2, search_reward=0.1)
    [ep] = run_episodes(engine, retriever, [(q.question, q.answers)], spec)
    assert ep.finish_reason == "answer" and ep.turns == 3 and ep.searches == ["Helensvale"]
    traj = ep.to_trajectory(spec, policy_version=7)
    assert traj.exact_match == 1.0 and traj.reward == pytest.approx(1.3) and traj.policy_version == 7
    assert traj.prompt_length == len(prompt_ids(tokenizer, q.question))
    generated = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
    expected = [i for t in engine.turns for i in tokenizer.encode(t, add_special_tokens=False)]
    assert generated == expected
    assert all(lp == -0.5 for lp, m in zip(traj.behaviour_logprobs, traj.loss_mask, strict=True) if m)
    assert all(lp == 0.0 for lp, m in zip(traj.behaviour_logprobs, traj.loss_mask, strict=True) if not m)
    injected = tokenizer.decode(
        [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if not m][traj.prompt_length :]
    )
    assert "<information>" in injected and INVALID_ACTION.strip()[:20] in injected


def test_loop_respects_turn_and_token_budgets(corpus_and_tokenizer) -> None:
    questions, retriever, tokenizer = corpus_and_tokenizer
    spec = AgentSpec(max_turns=2, max_total_tokens=4096)
    engine = ScriptedEngine(tokenizer, ["<search> a </search>", "<search> b </search>"])
    [ep] = run_episodes(engine, retriever, [(questions[1].question, questions[1].answers)], spec)
    assert ep.finish_reason == "max_turns" and ep.answer is None and len(engine.calls) == 2
    # the last turn's search is not answered: nothing is injected after the final model turn
    assert ep.loss_mask[-1] == 1

    prompt_len = len(prompt_ids(tokenizer, questions[1].question))
    tight = AgentSpec(max_turns=4, max_total_tokens=prompt_len + 20, max_new_tokens_per_turn=8)
    engine = ScriptedEngine(tokenizer, ["<search> Helensvale </search>"] * 4)
    [ep] = run_episodes(engine, retriever, [(questions[1].question, questions[1].answers)], tight)
    assert ep.finish_reason == "length" and len(ep.token_ids) <= tight.max_total_tokens
    assert engine.calls[0][1].max_new_tokens == [8]


def test_an_end_of_sequence_without_an_action_ends_the_episode(corpus_and_tokenizer) -> None:
    """The model's own end-of-sequence token ends its message: the loop used to append a correction
    after it and ask for another turn, so the trajectory trained tokens past an EOS in mid-sequence
    (an untrained chat model ends most turns so)."""
    questions, retriever, tokenizer = corpus_and_tokenizer
    q = questions[0]
    spec = AgentSpec(max_turns=3, format_reward=0.2)
    engine = ScriptedEngine(tokenizer, [("I think it is Paris.", "eos"), f"<answer> {q.answers[0]} </answer>"])
    [ep] = run_episodes(engine, retriever, [(q.question, q.answers)], spec)
    assert ep.finish_reason == "eos" and ep.answer is None and ep.turns == 1 and len(engine.calls) == 1
    assert ep.token_ids[-1] == tokenizer.eos_token_id and ep.loss_mask[-1] == 1  # ending is an action, trained
    assert ep.to_trajectory(spec, 0).reward == 0.0
    # Without EOS, a turn without an action still gets the correction and another turn.
    engine = ScriptedEngine(tokenizer, ["I think it is Paris.", f"<answer> {q.answers[0]} </answer>"])
    [ep] = run_episodes(engine, retriever, [(q.question, q.answers)], spec)
    assert ep.finish_reason == "answer" and ep.turns == 2
    assert tokenizer.decode(ep.token_ids).count("That was not a valid step") == 1


def test_a_last_turn_that_spends_the_token_budget_ends_as_length(corpus_and_tokenizer) -> None:
    """The same truncation reads the same on the last turn as on any other (it read max_turns)."""
    questions, retriever, tokenizer = corpus_and_tokenizer
    q = questions[1]
    prompt_len = len(prompt_ids(tokenizer, q.question))
    rambling = " ".join(["words"] * 200)  # no tag, longer than any budget here
    for max_turns in (1, 2):
        spec = AgentSpec(max_turns=max_turns, max_total_tokens=prompt_len + 30, max_new_tokens_per_turn=30)

        class Rambling(ScriptedEngine):
            def generate(self, contexts, params: TurnParams):
                self.calls.append((len(contexts), params))
                ids = self.tokenizer.encode(rambling, add_special_tokens=False)
                return [Completion(ids[:n], [-0.5] * len(ids[:n]), "", "length") for n in params.max_new_tokens]

        [ep] = run_episodes(Rambling(tokenizer, []), retriever, [(q.question, q.answers)], spec)
        assert len(ep.token_ids) == spec.max_total_tokens
        assert ep.finish_reason == "length", (max_turns, ep.finish_reason)


def test_generate_groups_on_a_tiny_model(corpus_and_tokenizer) -> None:
    questions, retriever, tokenizer = corpus_and_tokenizer
    engine = HFEngine(tiny_random_model(tokenizer, seed=0), tokenizer, seed=0)
    spec = AgentSpec(max_turns=2, max_new_tokens_per_turn=10, max_total_tokens=600)
    requests = [
        PromptRequest(
            request_id=f"r{i}",
            step=0,
            question_id=q.id,
            question=q.question,
            answers=q.answers,
            group_size=2,
            greedy=(i == 1),
        )
        for i, q in enumerate(questions[:2])
    ]
    groups = generate_groups(engine, retriever, requests, spec, worker_id="w")
    assert [g.request_id for g in groups] == ["r0", "r1"]
    for group in groups:
        assert len(group.trajectories) == 2 and group.worker_id == "w"
        for traj in group.trajectories:
            assert 1 <= traj.num_turns <= 2 and len(traj.token_ids) <= 600
            assert sum(traj.loss_mask) > 0 and traj.finish_reason in {"answer", "max_turns", "length"}
            assert all(lp <= 0.0 for lp in traj.behaviour_logprobs)
    greedy = groups[1].trajectories
    assert greedy[0].token_ids == greedy[1].token_ids


def test_stale_heartbeats_are_found_for_pruning() -> None:
    # A SIGKILLed or OOM-killed worker never removes its own entry from the heartbeat hash.
    import json

    from rljob.rollout.worker import stale_workers

    entries = {b"alive": json.dumps({"ts": 1000.0}), b"killed": json.dumps({"ts": 900.0}), b"garbled": b"{"}
    assert sorted(stale_workers(entries, now=1010.0, max_age_s=60.0)) == ["garbled", "killed"]
    assert stale_workers({}, now=0.0, max_age_s=60.0) == []
