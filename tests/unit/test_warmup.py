"""Protocol demonstrations and the supervised warm-up, on real HotpotQA train records, the real
BM25 retriever and prompt code, and a tiny random model with a tokenizer trained on the fly."""

from __future__ import annotations

import itertools

import pytest
import torch

from rljob.agent.prompt import information_block, prompt_ids
from rljob.assets import hotpotqa_file
from rljob.config import AgentSpec, RLJob, RLJobSpec, WarmupSpec
from rljob.data.hotpotqa import build_corpus, load_records, parse_question
from rljob.data.pools import job_pools
from rljob.retrieval import Retriever
from rljob.trainer.batch import Sample, collate
from rljob.trainer.loss import token_logprobs
from rljob.warmup import build_demonstrations, run_sft, warmup_for_job
from rljob.warmup.demonstrations import demonstration_for, supporting_titles
from rljob.warmup.sft import as_sample, masked_nll
from support.tiny_models import save_tiny_model, tiny_random_model, train_tiny_tokenizer

SPEC = AgentSpec(max_turns=3, top_k=2, max_new_tokens_per_turn=256, max_total_tokens=4096, passage_max_words=30)
SHORT = SPEC.model_copy(update={"top_k": 1, "passage_max_words": 8})  # short sequences for the training tests


@pytest.fixture(scope="module")
def setup():
    records = list(load_records(hotpotqa_file("train.jsonl"), limit=40))
    questions = [parse_question(r) for r in records]
    retriever = Retriever(build_corpus(questions))
    texts = [q.question + " " + " ".join(p.text for p in q.context) for q in questions]
    tokenizer = train_tiny_tokenizer([*texts, "<think> </think> <search> </search> <answer> </answer>"], 600)
    return records, retriever, tokenizer


def _spans(demo) -> list[tuple[int, list[int]]]:
    """(mask value, ids) runs of a demonstration."""
    out, pos = [], 0
    for value, run in itertools.groupby(demo.loss_mask):
        n = len(list(run))
        out.append((value, demo.token_ids[pos : pos + n]))
        pos += n
    return out


def test_demonstration_is_prompt_search_information_answer_with_rl_mask(setup):
    records, retriever, tokenizer = setup
    demos, read = build_demonstrations(records, tokenizer, retriever, SPEC, limit=8)
    assert 0 < len(demos) <= 8 and read >= len(demos)
    demo = demos[0]
    record = next(r for r in records if str(r["_id"]) == demo.question_id)
    question = parse_question(record)
    prompt = prompt_ids(tokenizer, question.question)
    assert demo.token_ids[: len(prompt)] == prompt and not any(demo.loss_mask[: len(prompt)])
    spans = _spans(demo)
    # prompt, then alternating written turns and injected information blocks, ending with a written answer.
    assert [v for v, _ in spans] == [0] + [1, 0] * len(demo.searches) + [1]
    assert demo.searches[0] == question.question
    for k, query in enumerate(demo.searches):
        written = tokenizer.decode(spans[1 + 2 * k][1])
        assert written.endswith(f"<search> {query} </search>")
        injected = spans[2 + 2 * k][1]
        assert injected == tokenizer.encode(
            information_block(retriever.search(query, SPEC.top_k), SPEC.passage_max_words), add_special_tokens=False
        )
    assert tokenizer.decode(spans[-1][1]).endswith(f"<answer> {question.answers[0]} </answer>")


def test_second_search_looks_up_a_missing_supporting_title(setup):
    records, retriever, tokenizer = setup
    one_hit = SPEC.model_copy(update={"top_k": 1})
    two = [d for d in build_demonstrations(records, tokenizer, retriever, one_hit, limit=40)[0] if len(d.searches) == 2]
    assert two, "with one passage per search some bridge questions need a second search"
    for demo in two:
        record = next(r for r in records if str(r["_id"]) == demo.question_id)
        assert demo.searches[1] in supporting_titles(record)
        first = {p.title for p in retriever.search(demo.searches[0], 1)}
        assert demo.searches[1] not in first


def test_unretrievable_answer_gives_no_demonstration(setup):
    records, retriever, tokenizer = setup
    record = dict(next(r for r in records if r["answer"] not in ("yes", "no")))
    record["answer"] = "zzqx unfindable"
    assert demonstration_for(record, tokenizer, retriever, SPEC) is None
    tight = SPEC.model_copy(update={"max_new_tokens_per_turn": 8})  # the search turn cannot fit
    assert demonstration_for(records[0], tokenizer, retriever, tight) is None


def test_with_one_turn_a_demonstration_answers_at_once_or_not_at_all(setup):
    # A search needs a later turn for the answer; with maxTurns 1 RL can only answer at once, so a
    # demonstration that searched would teach a pattern that always ends unanswered.
    records, retriever, tokenizer = setup
    one_turn = SPEC.model_copy(update={"max_turns": 1})
    demos, _ = build_demonstrations(records, tokenizer, retriever, one_turn, limit=40)
    assert all(not d.searches and sum(1 for v, _ in _spans(d) if v == 1) == 1 for d in demos)
    assert all(d.answer in ("yes", "no") for d in demos)  # only answers that need no passage


def test_masked_nll_counts_only_written_tokens(setup):
    records, retriever, tokenizer = setup
    demos, _ = build_demonstrations(records, tokenizer, retriever, SHORT, limit=2)
    model = tiny_random_model(tokenizer)
    mb = collate([as_sample(d) for d in demos], tokenizer.pad_token_id)
    nll, count = masked_nll(model, mb)
    assert count == sum(sum(d.loss_mask[1:]) for d in demos)
    manual = 0.0
    for d in demos:
        ids = torch.tensor([d.token_ids])
        with torch.no_grad():
            logp = token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])[0]
        manual -= sum(float(logp[j]) for j in range(len(d.token_ids) - 1) if d.loss_mask[j + 1])
    assert float(nll.detach()) == pytest.approx(manual, rel=1e-4)


def test_sft_lowers_the_loss_and_changes_weights(setup):
    records, retriever, tokenizer = setup
    demos, _ = build_demonstrations(records, tokenizer, retriever, SHORT, limit=4)
    model = tiny_random_model(tokenizer)
    before = [p.detach().clone() for p in model.parameters()]
    result = run_sft(
        model,
        demos,
        WarmupSpec(epochs=12, learning_rate=1e-2, batch_size=4),
        pad_token_id=tokenizer.pad_token_id,
        progress=False,
    )
    assert result.steps == 12 and result.examples == 4
    assert result.last_loss < 0.8 * result.first_loss
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_warmup_is_off_by_default_and_configurable():
    assert RLJobSpec().warmup.enabled is False
    spec = RLJobSpec.model_validate({"warmup": {"enabled": True, "learningRate": 1e-4, "batchSize": 2}})
    assert spec.warmup.enabled and spec.warmup.learning_rate == 1e-4 and spec.warmup.batch_size == 2
    with pytest.raises(ValueError):
        RLJobSpec.model_validate({"warmup": {"bogus": 1}})


@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory) -> RLJob:
    texts = [q["question"] for q in load_records(hotpotqa_file("train.jsonl"), limit=30)]
    model_dir = save_tiny_model(tmp_path_factory.mktemp("warm") / "model", [*texts, "<think> </think> <search>"], 400)
    return RLJob.model_validate(
        {
            "spec": {
                "model": {"name": str(model_dir)},
                "data": {
                    "trainPath": str(hotpotqa_file("train.jsonl")),
                    "evalPath": str(hotpotqa_file("dev.jsonl")),
                    "maxTrainQuestions": 30,
                    "corpusFrom": "train",
                },
                "agent": {
                    "maxTurns": 3,
                    "topK": 1,
                    "maxNewTokensPerTurn": 256,
                    "maxTotalTokens": 2048,
                    "passageMaxWords": 12,
                },
                "grpo": {"klCoef": 0.1},
                "warmup": {"enabled": True, "examples": 4, "batchSize": 2, "learningRate": 1e-3, "questionPool": 20},
            }
        }
    )


def test_warmup_for_job_uses_only_train_questions(tiny_job):
    from rljob.engines.models import load_tokenizer
    from rljob.retrieval.retriever import build_retriever_for_spec
    from rljob.trainer.model import load_policy
    from rljob.warmup.sft import job_demonstrations

    retriever, train, evaluation = build_retriever_for_spec(tiny_job.spec.data)
    demos, read = job_demonstrations(tiny_job, load_tokenizer(tiny_job.spec.model), retriever)
    train_ids = {str(r["_id"]) for r in load_records(tiny_job.spec.data.train_path, limit=30)}
    assert len(demos) == 4 and read <= 20 and {d.question_id for d in demos} <= train_ids
    # only from the warm-up's own pool: RL never samples these questions
    pools = job_pools(tiny_job.spec, [q.id for q in train], [q.id for q in evaluation])
    assert {d.question_id for d in demos} <= {train[i].id for i in pools.warmup}
    assert not {d.question_id for d in demos} & {train[i].id for i in pools.rl}
    result = warmup_for_job(tiny_job, load_policy(tiny_job.spec.model), progress=False)
    assert result.examples == 4 and result.steps == 2 and result.records_read == read


def test_an_enabled_warmup_without_demonstrations_is_an_error_not_a_silent_skip(tiny_job, caplog):
    """With turns too short for any demonstration the warm-up did nothing, said nothing, and RL
    started from the base model as if warmed up (and saved it as the KL reference)."""
    from rljob.trainer.model import load_policy
    from rljob.warmup import WarmupError

    cramped = tiny_job.model_copy(deep=True)
    cramped.spec.agent.max_new_tokens_per_turn = 4
    with pytest.raises(WarmupError, match="none of the 20 train questions read gave a demonstration"):
        warmup_for_job(cramped, load_policy(cramped.spec.model), progress=False)
    greedy = tiny_job.model_copy(deep=True)
    greedy.spec.warmup.examples = 1000  # more than its pool of 20 questions can give
    with caplog.at_level("WARNING"):
        result = warmup_for_job(greedy, load_policy(greedy.spec.model), progress=False)
    assert 0 < result.examples < 1000 and "of the 1000 demonstrations wanted" in caplog.text


def test_trainer_hook_warms_up_the_policy_and_its_kl_reference(tiny_job):
    """What `_train` runs on a fresh job before publishing version 0."""
    from rljob.trainer.distributed import Gang
    from rljob.trainer.grpo import GRPOTrainer, frozen_copy
    from rljob.trainer.loop import warm_up
    from rljob.trainer.model import load_policy

    model = load_policy(tiny_job.spec.model)
    trainer = GRPOTrainer(model, frozen_copy(model), tiny_job.spec.grpo)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    warm_up(tiny_job, Gang(), trainer, torch.device("cpu"), None, progress=False)
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    ref = trainer.ref_model.state_dict()
    assert all(torch.equal(ref[k], after[k]) for k in after)


def test_an_answer_counts_as_found_only_in_a_passage_itself():
    """The "Doc 1 (Title: ...)" wrapper made golds like "1", "doc" or "title" always found, so a
    demonstration could teach reciting an answer the evidence never showed."""
    from rljob.data.hotpotqa import Passage
    from rljob.warmup.demonstrations import answer_found

    passages = [Passage("Alpha", "No digits here."), Passage("Beta", "Founded in 1901 by")]
    for gold in ("1", "doc", "title"):
        assert not answer_found(gold, passages, 30)
    assert answer_found("1901", passages, 30) and answer_found("Alpha", passages, 30)
    assert not answer_found("here Beta", passages, 30)  # not across two passages
    assert not answer_found("by", passages, 3)  # only what the trimmed text shows
    assert answer_found("yes", [], 30)


def test_masked_nll_keeps_a_models_own_logit_transform():
    """The body + head shortcut skipped Granite's logits_scaling, so the warm-up trained another
    distribution than the one the model samples from."""
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    shape = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    config = GraniteConfig(**shape, num_attention_heads=4, num_key_value_heads=2, logits_scaling=8.0, pad_token_id=0)
    model = GraniteForCausalLM(config).eval()
    ids, mask = list(range(3, 20)), [0] * 8 + [1] * 9
    mb = collate([Sample(ids, mask, [0.0] * len(ids), 1.0)], 0)
    nll, count = masked_nll(model, mb)
    with torch.no_grad():
        logp = token_logprobs(model(input_ids=mb.input_ids).logits[:, :-1], mb.targets)
    assert count == 9 and float(nll.detach()) == pytest.approx(float(-(logp * mb.mask).sum()), rel=1e-5)
