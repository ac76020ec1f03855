"""Batched multi-turn generation with transformers, reusing the KV cache across turns.

A custom decode loop (not `model.generate`) so that the engine controls three things the RL loop
needs: the exact behaviour log-prob of every sampled token, stop strings checked per sample, and the
KV cache kept between turns. After a turn the cache holds, for each sample, every token fed so far
(the last sampled token is never fed). When the next call's contexts extend those rows (the agent
appended the stop token and an <information> block) only the new suffixes are prefilled; rows of
finished samples are dropped with `batch_select_indices`. Suffixes of unequal length are padded on
the left of the chunk, i.e. in the middle of the sequence: the 2-D attention mask marks those holes
and position ids are the running count of real tokens, so results equal an unpadded forward. Rows
whose suffixes differ much in length (a correction beside a passage block) are fed in separate
forwards and their caches merged, so that one long suffix does not pad every row to its length.
Any other call (new questions, a weight update) starts with a fresh prefill, in which samples that
share a context (a question's G samples) share one prefill: the cache rows are copied after it.

On CPU four things keep a decode step near the cost of its arithmetic: the KV cache appends in
place (`kv_cache.GrowingCache`, not a `torch.cat` of the whole cache per token), rows that have
finished are set aside once they are a quarter of the batch and put back for the next turn,
decode attention is two matmuls instead of torch's SDPA kernel (`attention`), and bf16 linear
layers hand oneDNN weights it has already reordered (`packed_linear`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rljob.config import ModelSpec
from rljob.engines.attention import register
from rljob.engines.base import Completion, GenerationEngine, TurnParams, WeightSyncer
from rljob.engines.buckets import length_buckets
from rljob.engines.kv_cache import GrowingCache
from rljob.engines.models import cache_argument, load_model, load_tokenizer
from rljob.engines.packed_linear import pack_linears
from rljob.weights.reader import SyncResult

_STOP_TAIL_TOKENS = 16  # stop strings are short: a tail this long always contains a fresh match
COMPACT_FRACTION = 4  # set finished rows aside once they are a quarter of the rows still fed
DRAW_BLOCK = 256  # tokens per block of the two-level CDF inversion
BUCKET_OVERHEAD = 256  # positions a prefill forward of its own must save to be worth its fixed cost


@dataclass
class _CacheState:
    cache: Any
    mask: torch.Tensor  # (rows, cached length) 1 = real token
    rows: list[list[int]]  # tokens whose keys/values the cache holds, per row


@dataclass
class _Prefill:
    chunks: list[list[int]]  # tokens to feed, one row each (unique contexts on a fresh prefill)
    cache: Any
    mask: torch.Tensor  # (rows of chunks, cached length)
    expand: torch.Tensor | None  # row of chunks each context reads after the prefill, when shared


def _merge(parts: list[tuple[Any, list[int], torch.Tensor]], batch: int) -> tuple[Any, torch.Tensor]:
    """Every part's cache rows and mask back in one batch, in row order; short masks padded with 0."""
    width = max(mask.shape[1] for _, _, mask in parts)
    mask = torch.zeros((batch, width), dtype=parts[0][2].dtype, device=parts[0][2].device)
    for _, rows, part_mask in parts:
        mask[rows, : part_mask.shape[1]] = part_mask
    return GrowingCache.merge([(cache, rows) for cache, rows, _ in parts], batch), mask


@dataclass
class EngineStats:
    shared_prefill_tokens: int = 0  # prompt tokens not prefilled because a group shares its prompt
    decode_row_steps: int = 0  # rows fed in decode steps (finished rows set aside are not)
    compactions: int = 0
    reused_tokens: int = 0
    prefill_forwards: int = 0
    padded_prefill_positions: int = 0  # positions prefilled beyond the chunks' own tokens


def _match_rows(rows: list[list[int]], contexts: list[list[int]]) -> list[int] | None:
    """For each context, the cached row it strictly extends, scanning in order; None if any fails."""
    picked, start = [], 0
    for ctx in contexts:
        for i in range(start, len(rows)):
            row = rows[i]
            if len(ctx) > len(row) and ctx[: len(row)] == row:
                picked.append(i)
                start = i + 1
                break
        else:
            return None
    return picked


def draw_from(weights: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from the categorical proportional to `weights` (rows, vocab), by inverting
    its CDF in two levels: pick a block of `DRAW_BLOCK` tokens by the cumulative block sums, then a
    token inside it. Returns the tokens and each row's total weight (the normaliser of its log-probs).

    Equivalent to `torch.multinomial(weights, 1)`, which on CPU costs a large share of a decode step
    over a 49k-way vocabulary; so does one cumulative sum over the whole vocabulary, while the block
    sums vectorise. Each search lands on the first position whose CDF exceeds a draw that is kept
    inside its block's mass, so never on a zero-weight token.
    """
    rows, vocab = weights.shape
    blocks = -(-vocab // DRAW_BLOCK)
    if blocks * DRAW_BLOCK != vocab:
        weights = torch.nn.functional.pad(weights, (0, blocks * DRAW_BLOCK - vocab))
    by_block = weights.view(rows, blocks, DRAW_BLOCK)
    cdf = by_block.sum(-1).cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand((rows, 1), generator=generator, dtype=cdf.dtype, device=weights.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(cdf, u, right=True)
    inner = by_block[torch.arange(rows, device=weights.device), block[:, 0]].cumsum(-1)
    # where the draw falls inside its block, on the block's own running sum (rounded unlike cdf's)
    rest = (u - cdf.gather(-1, block) + inner[:, -1:]).clamp_(min=0.0)
    rest = torch.minimum(rest, torch.nextafter(inner[:, -1:], torch.zeros_like(rest)))
    within = torch.searchsorted(inner, rest, right=True)[:, 0]
    return block[:, 0] * DRAW_BLOCK + within, total[:, 0]


def sample_tokens(
    logits: torch.Tensor, params: TurnParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, log-probs) from (batch, vocab) logits under the distribution described in base.

    Sampling works in place on one fp32 copy of the logits (scaled, shifted by the row maximum,
    exponentiated): a decode step allocates one vocabulary-wide buffer per row, not one per
    operation, and the log-prob of the drawn token needs no log-softmax over the vocabulary.
    """
    if params.greedy or params.temperature == 0.0:
        logp = torch.log_softmax(logits.float(), dim=-1)
        tokens = logp.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]
    scaled = logits.to(torch.float32, copy=True).div_(params.temperature)
    if params.top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the token crossing top_p
        scaled.masked_fill_(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    weights = scaled.sub_(scaled.amax(-1, keepdim=True)).exp_()
    tokens, total = draw_from(weights, generator)
    return tokens, weights.gather(-1, tokens[:, None])[:, 0].log() - total.log()


class HFEngine(GenerationEngine):
    """transformers causal LM on CPU or CUDA; one batched forward per decode step for all samples."""

    def __init__(self, model: Any, tokenizer: Any, device: str = "cpu", seed: int = 0, reuse_cache: bool = True):
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.reuse_cache = reuse_cache
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = eos_ids
        self._cache_arg = cache_argument(model)
        self.stats = EngineStats()
        self._state: _CacheState | None = None
        config = getattr(self.model, "config", None)
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        # The in-place cache holds plain full-attention layers; sliding-window or hybrid models keep
        # transformers' own cache (and no compaction).
        self._growing_cache = layer_types == {"full_attention"}
        if self.device.type == "cpu" and getattr(config, "_attn_implementation", None) == "sdpa":
            self.model.set_attn_implementation(register())
        if self.device.type == "cpu":
            pack_linears(self.model)

    @classmethod
    def from_spec(cls, spec: ModelSpec, device: str = "cpu", seed: int = 0, **kwargs: Any) -> HFEngine:
        return cls(load_model(spec, device), load_tokenizer(spec), device=device, seed=seed, **kwargs)

    def reset_cache(self) -> None:
        self._state = None

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_arg: cache},
        )
        return out.logits[:, -1, :], getattr(out, self._cache_arg)

    def _prefill_inputs(self, contexts: list[list[int]]) -> _Prefill:
        state, self._state = self._state, None
        if state is not None and self.reuse_cache:
            picked = _match_rows(state.rows, contexts)
            if picked is not None:
                if picked != list(range(len(state.rows))):
                    state.cache.batch_select_indices(torch.tensor(picked, device=self.device))
                suffixes = [ctx[len(state.rows[i]) :] for ctx, i in zip(contexts, picked, strict=True)]
                self.stats.reused_tokens += sum(len(state.rows[i]) for i in picked)
                return _Prefill(suffixes, state.cache, state.mask[picked], None)
        # A fresh prefill: the G samples of a question share one context, prefilled once and then
        # copied G times in the cache (its keys and values do not depend on which copy reads them).
        unique: dict[tuple[int, ...], int] = {}
        inverse = [unique.setdefault(tuple(ctx), len(unique)) for ctx in contexts]
        chunks = [list(ctx) for ctx in unique]
        empty = torch.zeros((len(chunks), 0), dtype=torch.long, device=self.device)
        expand = None if len(chunks) == len(contexts) else torch.tensor(inverse, device=self.device)
        self.stats.shared_prefill_tokens += sum(len(c) for c in contexts) - sum(len(c) for c in chunks)
        return _Prefill(chunks, GrowingCache() if self._growing_cache else None, empty, expand)

    def _feed(self, chunks: list[list[int]], mask: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """One forward over `chunks`, left-padded to the longest: (last logits, cache, mask)."""
        width = max(len(c) for c in chunks)
        ids = torch.full((len(chunks), width), self.pad_id, dtype=torch.long, device=self.device)
        chunk_mask = torch.zeros((len(chunks), width), dtype=torch.long, device=self.device)
        for b, chunk in enumerate(chunks):
            ids[b, width - len(chunk) :] = torch.tensor(chunk, device=self.device)
            chunk_mask[b, width - len(chunk) :] = 1
        mask = torch.cat([mask, chunk_mask], dim=1)
        self.stats.prefill_forwards += 1
        self.stats.padded_prefill_positions += len(chunks) * width - sum(len(c) for c in chunks)
        logits, cache = self._forward(ids, mask, cache)
        return logits, cache, mask

    def _prefill(self, prefill: _Prefill) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """Feed every row its chunk. Rows whose chunks differ much in length go in separate
        forwards (`length_buckets`), each cache part then merged back in row order; a short row
        of a bucket is followed by a hole, which the mask marks as it marks padding."""
        lengths = [len(c) for c in prefill.chunks]
        buckets = length_buckets(lengths, BUCKET_OVERHEAD) if isinstance(prefill.cache, GrowingCache) else []
        if len(buckets) <= 1:
            return self._feed(prefill.chunks, prefill.mask, prefill.cache)
        cache, rest = prefill.cache, list(range(len(lengths)))
        parts, logits = [], None
        for bucket in buckets[:-1]:
            taken = set(bucket)
            part = cache.split_off([rest.index(r) for r in bucket]) if cache.rows else GrowingCache()
            rest = [r for r in rest if r not in taken]
            parts.append((part, bucket))
        parts.append((cache, rest))  # the rows left, in row order
        merged = []
        for part, rows in parts:
            out, part, mask = self._feed([prefill.chunks[r] for r in rows], prefill.mask[rows], part)
            logits = out.new_empty((len(lengths), out.shape[1])) if logits is None else logits
            logits[rows] = out
            merged.append((part, rows, mask))
        cache, mask = _merge(merged, len(lengths))
        return logits, cache, mask

    @torch.inference_mode()
    def generate(self, contexts: list[list[int]], params: TurnParams) -> list[Completion]:
        batch = len(contexts)
        if batch == 0:
            return []
        if any(n < 1 for n in params.max_new_tokens) or len(params.max_new_tokens) != batch:
            raise ValueError("max_new_tokens needs one positive budget per context")
        prefill = self._prefill_inputs(contexts)
        logits, cache, mask = self._prefill(prefill)
        if prefill.expand is not None:
            cache.batch_select_indices(prefill.expand)
            logits, mask = logits[prefill.expand], mask[prefill.expand]

        generated: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        finish: list[str | None] = [None] * batch
        stops: list[str | None] = [None] * batch
        live = list(range(batch))  # the rows the cache holds, in its order
        parked: list[tuple[Any, list[int], torch.Tensor]] = []  # finished rows set aside: (cache, rows, mask)
        for _ in range(max(params.max_new_tokens)):
            tokens, token_lps = sample_tokens(logits, params, self.generator)
            next_ids, alive = tokens.tolist(), []
            for j, (b, lp) in enumerate(zip(live, token_lps.tolist(), strict=True)):
                if finish[b] is not None:
                    next_ids[j] = self.pad_id
                    alive.append(0)
                    continue
                generated[b].append(next_ids[j])
                logprobs[b].append(lp)
                finish[b], stops[b] = self._finished(generated[b], params, params.max_new_tokens[b])
                alive.append(int(finish[b] is None))
                if finish[b] is not None:
                    next_ids[j] = self.pad_id
            if not any(alive):
                break
            done = [j for j, a in enumerate(alive) if not a]
            if isinstance(cache, GrowingCache) and len(done) * COMPACT_FRACTION >= len(live):
                # Stop computing finished rows: set them aside with their mask, keep the others.
                parked.append((cache.split_off(done), [live[j] for j in done], mask[done]))
                keep = [j for j, a in enumerate(alive) if a]
                live, mask = [live[j] for j in keep], mask[keep]
                next_ids = [next_ids[j] for j in keep]
                alive = [1] * len(keep)
                self.stats.compactions += 1
            self.stats.decode_row_steps += len(live)
            mask = torch.cat([mask, torch.tensor(alive, device=self.device)[:, None]], dim=1)
            logits, cache = self._forward(torch.tensor(next_ids, device=self.device)[:, None], mask, cache)

        if parked:
            cache, mask = _merge([*parked, (cache, live, mask)], batch)
        # Every row's last sampled token was never fed: the cache holds context + generated[:-1].
        self._state = _CacheState(cache, mask, [ctx + gen[:-1] for ctx, gen in zip(contexts, generated, strict=True)])
        return [
            Completion(gen, lps, self.tokenizer.decode(gen, skip_special_tokens=True), fin or "length", stop)
            for gen, lps, fin, stop in zip(generated, logprobs, finish, stops, strict=True)
        ]

    def _finished(self, generated: list[int], params: TurnParams, budget: int) -> tuple[str | None, str | None]:
        if generated[-1] in self.eos_ids:
            return "eos", None
        if params.stop:
            tail = self.tokenizer.decode(generated[-_STOP_TAIL_TOKENS:], skip_special_tokens=True)
            for stop in params.stop:
                if stop in tail:
                    return "stop", stop
        if len(generated) >= budget:
            return "length", None
        return None, None

    def sync_weights(self, reader: WeightSyncer) -> SyncResult:
        outcome = reader.sync(self.model)
        if outcome.version != self.policy_version or outcome.changed:
            self._state = None  # keys/values computed by the old weights are stale
        self.policy_version = outcome.version
        return outcome
