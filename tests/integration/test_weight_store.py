"""The weight store against a real redis-server (AOF on): publish, sync, crash, corrupt, recover."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import redis
import torch

from rljob.keys import JobKeys
from rljob.weights import (
    VersionConflictError,
    WeightPublisher,
    WeightReader,
    WeightStoreError,
    named_tensors,
    store,
)
from rljob.weights.checksum import bf16_bits
from rljob.weights.codec import EncodedDelta, decode_positions

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")

KEYS = JobKeys("test", "weights")
Bits = dict[str, np.ndarray]


def tiny_llama(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny Llama with tied embeddings, the shape of SmolLM2 (lm_head shares embed_tokens)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config).to(dtype)


class Trainer:
    """fp32 master weights and real AdamW steps on a random-token language-model loss."""

    def __init__(self, lr: float = 1e-4, seed: int = 0) -> None:
        self.model = tiny_llama(seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        ids = torch.randint(0, 256, (2, 12), generator=self.gen)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def bits(self) -> Bits:
        return {name: bf16_bits(p).copy() for name, p in self.model.named_parameters()}


def assert_holds(target, expected: Bits) -> None:
    tensors = named_tensors(target)
    assert set(tensors) == set(expected)
    for name, bits in expected.items():
        assert bf16_bits(tensors[name], exact=True).tobytes() == bits.tobytes(), f"{name} differs"


def publisher_for(client: redis.Redis, **overrides) -> WeightPublisher:
    options = {"rebase_interval": 4, "rebase_fraction": 4.0, "chunk_bytes": 4096} | overrides
    return WeightPublisher(client, KEYS, **options)


def version_keys(client: redis.Redis, version: int) -> list[bytes]:
    return list(client.scan_iter(match=KEYS.prefix.replace("{", "\\{").replace("}", "\\}") + f"weights:v{version}:*"))


@pytest.mark.slow
def test_concurrent_readers_match_the_trainer_bit_for_bit(redis_server, redis_client):
    trainer = Trainer()
    publisher = publisher_for(redis_client)
    snapshots: dict[int, Bits] = {}
    total = 10
    readers = {
        "fp32-model-every-version": (tiny_llama(1), 1, 0),
        "bf16-shadow-every-3rd": ({}, 3, 0),
        "bf16-model-joins-at-5": (tiny_llama(2, torch.bfloat16), 1, 5),
        "fp32-model-first-and-last": (tiny_llama(3), total - 1, 0),
    }

    def follow(target, every: int, start: int) -> list:
        client = redis.Redis.from_url(redis_server.url)
        reader = WeightReader(client, KEYS)
        synced, want = [], start
        while not synced or synced[-1].version < total - 1:
            reader.wait_for_version(want, timeout=60)
            result = reader.sync(target)
            assert_holds(target, snapshots[result.version])
            synced.append(result)
            want = min(result.version + every, total - 1)
        client.close()
        return synced

    with ThreadPoolExecutor(len(readers)) as pool:
        futures = {name: pool.submit(follow, *spec) for name, spec in readers.items()}
        published = []
        for version in range(total):
            snapshots[version] = trainer.bits()
            published.append(publisher.publish(trainer.model))
            trainer.step()
            time.sleep(0.05)
        results = {name: future.result(timeout=120) for name, future in futures.items()}

    assert [p.version for p in published] == list(range(total))
    assert [p.kind for p in published] == ["full", "delta", "delta", "delta"] * 2 + ["full", "delta"]
    assert all(p.bytes < published[0].bytes for p in published if p.kind == "delta")
    every = results["fp32-model-every-version"]
    assert any(not r.took_full and r.versions_applied for r in every), "deltas were never used"
    assert all(r.bytes_fetched < published[0].bytes for r in every if r.versions_applied and not r.took_full)
    joined = results["bf16-model-joins-at-5"][0]
    assert joined.took_full and joined.versions_applied[0] == 4  # the newest full, then its deltas
    last = results["fp32-model-first-and-last"][-1]
    # Its deltas were dropped with the rebase at 8: it takes that full and the delta after it.
    assert last.took_full and last.versions_applied == [8, 9]
    assert store.committed_versions(redis_client, KEYS) == [8, 9]
    assert not version_keys(redis_client, 3)  # retention removed the old chain's chunks


def test_tied_weights_are_published_once_and_stay_tied(redis_client):
    trainer = Trainer(seed=5)
    publisher_for(redis_client).publish(trainer.model)
    names = [entry.name for entry in store.read_manifests(redis_client, KEYS, [0])[0][0].tensors]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    model = tiny_llama(6)
    WeightReader(redis_client, KEYS).sync(model)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, trainer.model.lm_head.weight.to(torch.bfloat16).float())


def test_sync_writes_in_place_and_fetches_nothing_when_current(redis_client):
    trainer = Trainer()
    publisher = publisher_for(redis_client)
    model = tiny_llama(7)
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    reader = WeightReader(redis_client, KEYS)
    for _ in range(3):
        publisher.publish(trainer.model)
        trainer.step()
        result = reader.sync(model)
        assert result.changed
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers
    again = reader.sync(model)
    assert (again.version, again.changed, again.bytes_fetched) == (2, [], 0)


@pytest.mark.parametrize("where", ["between-chunks", "before-commit"])
def test_redis_killed_mid_publish_leaves_readers_on_a_complete_version(redis_server, redis_client, monkeypatch, where):
    trainer = Trainer()
    publisher = publisher_for(redis_client, chunk_bytes=1024)
    targets = [tiny_llama(8), {}]
    readers = [WeightReader(redis_client, KEYS) for _ in targets]
    for _ in range(2):
        before = trainer.bits()
        publisher.publish(trainer.model)
        trainer.step()
    for reader, target in zip(readers, targets, strict=True):
        reader.sync(target)

    if where == "between-chunks":
        write_chunks = store.write_chunks

        def crash(client, keys, version, payload, chunk_bytes, attempt=""):
            write_chunks(client, keys, version, payload[: len(payload) // 2], chunk_bytes, attempt)
            redis_server.kill()
            return write_chunks(client, keys, version, payload, chunk_bytes, attempt)

        monkeypatch.setattr(store, "write_chunks", crash)
    else:
        commit = store.commit

        def crash(client, keys, manifest, **options):
            redis_server.kill()
            return commit(client, keys, manifest, **options)

        monkeypatch.setattr(store, "commit", crash)
    with pytest.raises(redis.ConnectionError):
        publisher.publish(trainer.model)
    monkeypatch.undo()
    redis_server.start()

    assert store.latest_version(redis_client, KEYS) == 1
    assert any(b":chunk:" in key for key in version_keys(redis_client, 2))  # orphans of the crash
    for reader, target in zip(readers, targets, strict=True):
        assert reader.sync(target).version == 1
        assert_holds(target, before)
    fresh = {}
    WeightReader(redis_client, KEYS).sync(fresh)
    assert_holds(fresh, before)

    expected = trainer.bits()
    result = publisher.publish(trainer.model)  # re-reads Redis, clears the orphans, continues
    assert (result.version, result.kind) == (2, "delta")
    for reader, target in zip(readers, targets, strict=True):
        assert reader.sync(target).version == 2
        assert_holds(target, expected)


def test_redis_killed_at_a_random_moment_of_a_publish_loop(redis_server, redis_client):
    """No hook: SIGKILL lands wherever the publisher is; readers must still end on a complete version."""
    trainer = Trainer(lr=1e-3)
    publisher = publisher_for(redis_client, chunk_bytes=512, rebase_interval=3)
    snapshots: dict[int, Bits] = {}
    stop = threading.Event()

    def publish_forever() -> None:
        while not stop.is_set():
            snapshots[publisher.next_version] = trainer.bits()
            try:
                publisher.publish(trainer.model)
            except redis.ConnectionError:
                return
            trainer.step()

    thread = threading.Thread(target=publish_forever)
    thread.start()
    # Kill once a full and a delta have landed (a fixed sleep assumed a machine fast enough to
    # commit two versions in it), then at a random moment of what follows.
    deadline = time.monotonic() + 60
    while (publisher.latest_version or 0) < 1 and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (publisher.latest_version or 0) >= 1, "the publish loop never committed two versions"
    time.sleep(float(np.random.default_rng().uniform(0.0, 0.5)))
    redis_server.kill()
    stop.set()
    thread.join(timeout=30)
    redis_server.start()
    shadow: dict[str, torch.Tensor] = {}
    result = WeightReader(redis_client, KEYS).sync(shadow)
    assert result.version >= 1
    assert_holds(shadow, snapshots[result.version])
    follow_up = publisher.publish(trainer.model)
    assert follow_up.version == result.version + 1


def test_aof_keeps_the_store_and_a_restarted_trainer_continues_the_sequence(redis_server, redis_client):
    trainer = Trainer()
    publisher = publisher_for(redis_client, rebase_interval=10)
    checkpoint = None
    for version in range(4):
        publisher.publish(trainer.model)
        if version == 2:
            checkpoint = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.step()
    expected_v3 = None
    reader, model = WeightReader(redis_client, KEYS), tiny_llama(9)
    reader.sync(model)
    expected_v3 = {name: bf16_bits(p, exact=True).copy() for name, p in model.named_parameters()}

    redis_server.restart()  # SIGKILL then start: only what AOF holds survives
    client = redis.Redis.from_url(redis_server.url)
    shadow: dict[str, torch.Tensor] = {}
    assert WeightReader(client, KEYS).sync(shadow).version == 3
    assert_holds(shadow, expected_v3)

    # The trainer crashed too and restarts from its version-2 checkpoint.
    restarted = Trainer(seed=11)
    restarted.model.load_state_dict(checkpoint)
    restarted.step()
    new_publisher = publisher_for(client, rebase_interval=10)
    assert new_publisher.resume() == 3 and new_publisher.next_version == 4
    result = new_publisher.publish(restarted.model)
    assert (result.version, result.kind) == (4, "delta")  # against the read-back v3, not a full
    assert reader.sync(model).versions_applied == [4]
    assert_holds(model, restarted.bits())
    with pytest.raises(VersionConflictError):
        new_publisher.publish(restarted.model, version=4)
    client.close()


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_damaged_chunk_is_detected_and_recovered(redis_client, damage):
    trainer = Trainer()
    publisher = publisher_for(redis_client, chunk_bytes=1024)
    model, reader = tiny_llama(10), WeightReader(redis_client, KEYS)
    for version in range(3):
        if version == 1:
            at_v1 = trainer.bits()
        publisher.publish(trainer.model)
        trainer.step()
        if version == 1:
            reader.sync(model)
    chunk = store.read_manifests(redis_client, KEYS, [2])[0][0].chunks[0].key
    if damage == "corrupt":
        byte = redis_client.getrange(chunk, 5, 5)
        redis_client.setrange(chunk, 5, bytes([byte[0] ^ 0xFF]))
    else:
        redis_client.delete(chunk)

    with pytest.raises(WeightStoreError, match=f"{damage}.*{chunk}|{chunk}.*{damage}"):
        reader.sync(model)
    assert reader.version == 1
    assert_holds(model, at_v1)  # chunks are verified before anything is written: never half-applied
    assert redis_client.exists(KEYS.weights_rebase)

    expected = trainer.bits()
    result = publisher.publish(trainer.model)
    assert result.kind == "full" and "rebase" in result.reason
    synced = reader.sync(model)
    assert (synced.version, synced.took_full) == (3, True)
    assert_holds(model, expected)
    assert not redis_client.exists(KEYS.weights_rebase)


def test_a_tampered_target_fails_its_checksum_and_is_refetched(redis_client):
    trainer = Trainer(lr=1e-3)
    publisher = publisher_for(redis_client)
    shadow: dict[str, torch.Tensor] = {}
    reader = WeightReader(redis_client, KEYS)
    publisher.publish(trainer.model)
    reader.sync(shadow)
    for tensor in shadow.values():
        tensor.view(-1)[0] += 1.0  # someone wrote into the shadow copy
    trainer.step()
    expected = trainer.bits()
    publisher.publish(trainer.model)
    result = reader.sync(shadow)
    assert result.took_full and result.version == 1
    assert any("ChecksumMismatchError" in e for e in result.recovered_from)
    assert_holds(shadow, expected)


def test_versions_dropped_while_a_reader_fetches_are_recovered(redis_client, monkeypatch):
    trainer = Trainer()
    publisher = publisher_for(redis_client, rebase_interval=3)
    reader, shadow = WeightReader(redis_client, KEYS), {}
    publisher.publish(trainer.model)
    reader.sync(shadow)
    trainer.step()
    publisher.publish(trainer.model)  # v1, a delta the reader plans to fetch
    read_payload = store.read_payload
    raced = []

    def publish_meanwhile(client, manifest):
        if not raced:  # the trainer rebases (v2 full drops v0, v1) between plan and fetch
            raced.append(True)
            trainer.step()
            publisher.publish(trainer.model)
            trainer.step()
            publisher.publish(trainer.model)
        return read_payload(client, manifest)

    monkeypatch.setattr(store, "read_payload", publish_meanwhile)
    result = reader.sync(shadow)
    assert result.took_full and result.version == 3
    assert any("MissingChunkError" in e or "VersionUnavailable" in e for e in result.recovered_from)
    assert_holds(shadow, trainer.bits())


def test_wait_for_version_wakes_on_publish_and_times_out(redis_client):
    trainer = Trainer()
    publisher = publisher_for(redis_client)
    reader = WeightReader(redis_client, KEYS)
    assert reader.latest_version() is None
    with pytest.raises(TimeoutError):
        reader.wait_for_version(0, timeout=0.3)
    timer = threading.Timer(0.3, publisher.publish, args=(trainer.model,))
    timer.start()
    started = time.monotonic()
    assert reader.wait_for_version(0, timeout=10) == 0
    assert time.monotonic() - started < 5
    timer.join()


def test_full_mode_and_rebase_fraction(redis_client):
    trainer = Trainer(lr=1e-3)
    full = publisher_for(redis_client, mode="full")
    assert [full.publish(trainer.model).kind for _ in range(2)] == ["full", "full"]
    keys = JobKeys("test", "other")
    tight = WeightPublisher(redis_client, keys, rebase_interval=100, rebase_fraction=0.05, chunk_bytes=4096)
    kinds = []
    for _ in range(4):
        kinds.append(tight.publish(trainer.model))
        trainer.step()
    assert kinds[0].kind == "full"
    assert any(r.kind == "full" and "chain" in r.reason for r in kinds[1:])


def test_a_tampered_value_the_delta_touches_fails_its_change_sum(redis_client):
    trainer = Trainer(lr=1e-3)
    publisher = publisher_for(redis_client, check_versions=1000)  # no SHA window covers the damage
    shadow: dict[str, torch.Tensor] = {}
    reader = WeightReader(redis_client, KEYS)
    publisher.publish(trainer.model)
    reader.sync(shadow)
    before = trainer.bits()
    trainer.step()
    expected = trainer.bits()
    name = "model.layers.1.mlp.up_proj.weight"
    touched = int(np.flatnonzero(before[name] != expected[name])[0])
    shadow[name].view(-1).view(torch.int16)[touched] ^= 1  # off the base version, where v1 writes
    publisher.publish(trainer.model)
    result = reader.sync(shadow)
    assert result.took_full and result.version == 1
    assert any("ChecksumMismatchError" in e and "changed by sum" in e for e in result.recovered_from)
    assert_holds(shadow, expected)


def test_drift_where_no_delta_touches_is_caught_by_the_rotating_window(redis_client):
    """A value no delta rewrites is still checked end to end within `check_versions` versions."""
    trainer = Trainer(lr=1e-3)
    publisher = publisher_for(redis_client, rebase_interval=100, check_versions=4)
    shadow: dict[str, torch.Tensor] = {}
    reader = WeightReader(redis_client, KEYS)
    publisher.publish(trainer.model)
    reader.sync(shadow)
    name = "model.norm.weight"  # the last tensor: covered by the last of the 4 windows
    with torch.no_grad():
        frozen = dict(trainer.model.named_parameters())[name]
        frozen.requires_grad_(False)  # never changes, so no delta touches it
    shadow[name].view(-1)[3] += 1.0
    caught_at = None
    for version in range(1, 6):
        trainer.step()
        publisher.publish(trainer.model)
        result = reader.sync(shadow)
        assert result.version == version
        if result.recovered_from:
            caught_at = version
            assert result.took_full
            assert any(f"{name} [" in e for e in result.recovered_from)
            break
    assert caught_at is not None and caught_at <= 4
    assert_holds(shadow, trainer.bits())


def test_large_fp32_tensors_are_cast_block_by_block_exactly(redis_client):
    """Tensors bigger than the publisher's cast block, fp32 with values that round both ways."""
    gen = torch.Generator().manual_seed(3)
    weights = {"big": torch.randn(2_300_001, generator=gen) * 0.02, "small": torch.randn(7, 5, generator=gen)}
    publisher = publisher_for(redis_client, chunk_bytes=1 << 20, check_versions=3)
    shadow: dict[str, torch.Tensor] = {}
    reader = WeightReader(redis_client, KEYS)
    for version in range(4):
        expected = {name: bf16_bits(t).copy() for name, t in weights.items()}
        result = publisher.publish(weights)
        assert result.kind == ("full" if version == 0 else "delta")
        assert reader.sync(shadow).version == version
        assert_holds(shadow, expected)
        with torch.no_grad():
            for t in weights.values():
                t.mul_(1.0 + 1e-3 * torch.randn(t.shape, generator=gen))


def test_a_version_is_one_stream_over_all_tensors(redis_client):
    """The manifest carries one coded stream and one change sum; per-tensor entries keep the names,
    shapes, change counts and check windows."""
    trainer = Trainer(lr=1e-3)
    publisher = publisher_for(redis_client)
    publisher.publish(trainer.model)
    before = trainer.bits()
    trainer.step()
    result = publisher.publish(trainer.model)
    manifest = store.read_manifests(redis_client, KEYS, [result.version])[0][0]
    after = trainer.bits()
    assert manifest.format == 6 and manifest.kind == "delta"
    assert manifest.stream is not None and manifest.stream.count == manifest.changed == result.changed > 0
    assert manifest.stream.numel == manifest.numel == sum(b.size for b in after.values())
    assert re.fullmatch(r"[0-9a-f]{16}", manifest.change_sum or "")
    expected, offset = [], 0
    for entry in manifest.tensors:
        assert entry.changed == int(np.count_nonzero(before[entry.name] != after[entry.name]))
        expected.append(np.flatnonzero(before[entry.name] != after[entry.name]) + offset)
        offset += before[entry.name].size
    enc = EncodedDelta.from_meta(manifest.stream.model_dump(), store.read_payload(redis_client, manifest))
    assert np.array_equal(decode_positions(enc), np.concatenate(expected))


@pytest.mark.parametrize("written", [5, 99])
def test_a_manifest_from_another_release_gives_a_clear_error(redis_client, written):
    publisher = publisher_for(redis_client)
    publisher.publish({"w": torch.ones(4)})
    raw = json.loads(redis_client.get(KEYS.weights_manifest(0)))
    raw |= {"format": written, "a_field_from_another_release": 1}
    redis_client.set(KEYS.weights_manifest(0), json.dumps(raw))
    with pytest.raises(store.ManifestFormatError, match=f"format {written}; this reader reads 6: run the same rljob"):
        WeightReader(redis_client, KEYS).sync({})
    redis_client.set(KEYS.weights_manifest(0), b"{not json")
    with pytest.raises(store.ManifestFormatError, match="manifest of weight version 0 is invalid"):
        WeightReader(redis_client, KEYS).sync({})


def test_a_second_publisher_of_the_same_version_cannot_damage_the_first(redis_client):
    # An old trainer pod still publishing during a gang restart: both at version 0, both publish
    # version 1. The loser's chunks have their own keys, so the winner's stay intact.
    first, second = Trainer(seed=0), Trainer(seed=1)
    a = publisher_for(redis_client)
    a.publish(first.model)
    b = publisher_for(redis_client)
    b.resume()
    first.step()
    second.step()
    a.publish(first.model)
    with pytest.raises(VersionConflictError, match="STALE"):
        b.publish(second.model, version=1)
    shadow = {}
    result = WeightReader(redis_client, KEYS).sync(shadow)
    assert result.version == 1 and not result.recovered_from
    assert_holds(shadow, first.bits())
    # The loser removed its own chunks; nothing but the winner's is left under version 1.
    named = {ref.key for ref in store.read_manifests(redis_client, KEYS, [1])[0][0].chunks}
    assert {k.decode() for k in version_keys(redis_client, 1) if b":chunk:" in k} == named


def test_orphan_removal_never_takes_a_version_committed_meanwhile(redis_client):
    # drop_orphans lists keys of uncommitted versions, then deletes them; a version another
    # publisher commits in between must keep its manifest and chunks (it wedged every reader).
    trainer = Trainer()
    a = publisher_for(redis_client)
    a.publish(trainer.model)
    trainer.step()
    a.publish(trainer.model)  # v1
    stale = [(key, 1) for key in version_keys(redis_client, 1)]  # as a racing drop_orphans saw them
    assert store.delete_orphans(redis_client, KEYS, stale) == 0
    assert store.delete_orphans(redis_client, KEYS, [(KEYS.weights_chunk(7, 0, "x"), 7)]) == 0  # none there
    redis_client.set(KEYS.weights_chunk(7, 0, "x"), b"orphan")
    assert store.delete_orphans(redis_client, KEYS, [(KEYS.weights_chunk(7, 0, "x"), 7)]) == 1
    redis_client.set(KEYS.weights_chunk(1, 0, "loser"), b"a loser's chunk of a committed number")
    assert store.drop_orphans(redis_client, KEYS) == 1
    shadow = {}
    assert WeightReader(redis_client, KEYS).sync(shadow).version == 1
    assert_holds(shadow, trainer.bits())


def test_a_delta_on_a_version_the_store_lost_is_refused_and_the_publisher_recovers(redis_client):
    # Redis lost the last commit (AOF fsyncs every second): a publisher still holding it in memory
    # must not commit a delta on it, which no fresh reader could ever build.
    trainer = Trainer()
    publisher = publisher_for(redis_client)
    publisher.publish(trainer.model)
    trainer.step()
    publisher.publish(trainer.model)  # v1, then lost:
    lose_the_last_commit(redis_client)
    trainer.step()
    with pytest.raises(VersionConflictError, match="BASE"):
        publisher.publish(trainer.model, version=2)
    assert store.committed_versions(redis_client, KEYS) == [0]
    publisher.publish(trainer.model)  # re-reads the store: a delta on version 0
    shadow = {}
    result = WeightReader(redis_client, KEYS).sync(shadow)
    assert result.version == 1 and not result.recovered_from
    assert_holds(shadow, trainer.bits())


def test_a_version_whose_chunks_vanished_before_commit_is_not_committed(redis_client, monkeypatch):
    # A concurrent drop_orphans (or anything else) removed a chunk between write and commit.
    trainer = Trainer()
    publisher = publisher_for(redis_client)
    publisher.publish(trainer.model)
    commit = store.commit

    def lose_a_chunk(client, keys, manifest, **options):
        client.delete(manifest.chunks[0].key)
        return commit(client, keys, manifest, **options)

    monkeypatch.setattr(store, "commit", lose_a_chunk)
    trainer.step()
    with pytest.raises(store.MissingChunkError, match="CHUNKS 1 of the"):
        publisher.publish(trainer.model)
    monkeypatch.undo()
    assert store.committed_versions(redis_client, KEYS) == [0]
    publisher.publish(trainer.model)
    shadow = {}
    assert WeightReader(redis_client, KEYS).sync(shadow).version == 1
    assert_holds(shadow, trainer.bits())


@pytest.mark.parametrize("model", ["empty", "zero-element tensor"])
def test_degenerate_models_publish_and_sync(redis_client, model):
    # A second publish of an empty model, or of one with a zero-element tensor, raised.
    weights = {} if model == "empty" else {"w": torch.ones(4, 3), "none": torch.zeros(0, 5)}
    publisher = publisher_for(redis_client)
    reader, shadow = WeightReader(redis_client, KEYS), {}
    for step in range(3):
        if "w" in weights:
            weights["w"] += 1.0
        result = publisher.publish(weights)
        assert result.version == step
        assert reader.sync(shadow).version == step
        assert_holds(shadow, {name: bf16_bits(t).copy() for name, t in weights.items()})


def test_a_reader_holding_a_version_redis_lost_does_not_take_its_namesake_for_it(redis_client):
    # Redis lost its last commit (v1; AOF fsyncs every second) after a reader applied it, and the
    # restarted trainer published a different v1. The number alone said "up to date".
    trainer = Trainer()
    publisher = publisher_for(redis_client)
    publisher.publish(trainer.model)
    trainer.step()
    publisher.publish(trainer.model)
    reader, shadow = WeightReader(redis_client, KEYS), {}
    assert reader.sync(shadow).version == 1
    v0_id = store.read_manifests(redis_client, KEYS, [0])[0][0].publish_id
    store.drop_versions(redis_client, KEYS, [1])  # what the restarted Redis no longer has
    redis_client.mset({KEYS.weights_latest: 0, KEYS.weights_latest_id: v0_id})
    restarted = Trainer(seed=5)  # resumed from an older checkpoint: other weights
    publisher_for(redis_client).publish(restarted.model)
    result = reader.sync(shadow)
    assert result.version == 1 and result.versions_applied
    assert_holds(shadow, restarted.bits())


def test_a_chunk_that_stays_corrupt_is_answered_by_a_re_export_of_the_same_version(redis_client):
    # The newest delta's chunk is corrupt in Redis itself: refetching reads the same bytes, so the
    # reader gives up and asks for a rebase. The trainer, waiting for rollouts, publishes nothing
    # new: answer_rebase re-exports the latest version as a full under its own number.
    trainer = Trainer()
    publisher = publisher_for(redis_client, chunk_bytes=1024)
    model, reader = tiny_llama(10), WeightReader(redis_client, KEYS)
    publisher.publish(trainer.model)
    reader.sync(model)
    trainer.step()
    publisher.publish(trainer.model)  # v1, a delta
    expected = trainer.bits()
    assert publisher.answer_rebase() is None  # nobody asked
    chunk = store.read_manifests(redis_client, KEYS, [1])[0][0].chunks[0].key
    redis_client.setrange(chunk, 3, bytes([redis_client.getrange(chunk, 3, 3)[0] ^ 0xFF]))
    with pytest.raises(WeightStoreError, match="asked the publisher for a new full export"):
        reader.sync(model)
    old_id = store.latest_with_id(redis_client, KEYS)[1]

    answered = publisher.answer_rebase()
    assert answered is not None and (answered.version, answered.kind) == (1, "full")
    latest, latest_id = store.latest_with_id(redis_client, KEYS)
    assert latest == 1 and latest_id != old_id and not redis_client.exists(KEYS.weights_rebase)
    assert not redis_client.exists(chunk)  # the replaced delta's chunks are gone
    assert store.committed_versions(redis_client, KEYS) == [1]  # retention: the full at 1 and nothing older
    synced = reader.sync(model)
    assert (synced.version, synced.took_full) == (1, True)
    assert_holds(model, expected)
    trainer.step()
    result = publisher.publish(trainer.model)  # and the sequence goes on from the re-export
    assert (result.version, result.kind) == (2, "delta")
    assert reader.sync(model).versions_applied == [2]
    assert_holds(model, trainer.bits())


def sparse_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(16384, generator=generator) for i in range(4)}


def bumped(weights: dict[str, torch.Tensor], low: int, high: int) -> dict[str, torch.Tensor]:
    """A copy with the values at model-wide positions [low, high) moved: a change so sparse that
    neither the change sum (only where a delta writes) nor one SHA-256 window sees the rest."""
    out = {name: t.clone() for name, t in weights.items()}
    for position in range(low, high):
        out[f"t{position // 16384}"][position % 16384] += 1.0
    return out


def bits_of(weights: dict[str, torch.Tensor]) -> Bits:
    return {name: bf16_bits(t).copy() for name, t in weights.items()}


def lose_the_last_commit(client: redis.Redis) -> None:
    """What a Redis restarted from an AOF without its last second holds: version 0 as latest."""
    v0_id = store.read_manifests(client, KEYS, [0])[0][0].publish_id
    store.drop_versions(client, KEYS, [1])
    client.mset({KEYS.weights_latest: 0, KEYS.weights_latest_id: v0_id})


def test_a_reader_holding_a_lost_version_does_not_apply_the_next_delta_onto_it(redis_client):
    # The reader holds v1 (X); Redis loses it; the restarted trainer publishes another v1 (Y) and a
    # v2 on Y. By number alone, v2 "builds on" what the reader holds: it applied it onto X and
    # reported v2, with values nobody published (a manifest names its base's publish id).
    options = {"rebase_interval": 100, "rebase_fraction": 100.0}
    first, weights = publisher_for(redis_client, **options), sparse_weights()
    first.publish(weights)
    first.publish(bumped(weights, 20000, 20100))  # X
    reader, shadow = WeightReader(redis_client, KEYS), {}
    assert reader.sync(shadow).version == 1
    lose_the_last_commit(redis_client)
    restarted = publisher_for(redis_client, **options)
    other = bumped(weights, 30000, 30100)
    restarted.publish(other)  # Y
    newest = bumped(other, 40000, 40100)
    assert restarted.publish(newest).kind == "delta"
    result = reader.sync(shadow)
    assert_holds(shadow, bits_of(newest))
    assert (result.version, result.took_full) == (2, True) and not reader.needs_sync()
    manifest = store.read_manifests(redis_client, KEYS, [2])[0][0]
    assert manifest.base_publish_id == store.read_manifests(redis_client, KEYS, [1])[0][0].publish_id


def test_the_old_trainer_cannot_commit_a_delta_on_its_lost_version(redis_client):
    # Redis lost v1 (X); the restarted trainer republished v1 (Y); the old trainer, still alive
    # with X as its baseline, published v2 as a delta on "1": the commit compared numbers only, and
    # every reader ended on a v2 that was neither trainer's model.
    options = {"rebase_interval": 100, "rebase_fraction": 100.0}
    old, weights = publisher_for(redis_client, **options), sparse_weights()
    old.publish(weights)
    lost = bumped(weights, 20000, 20100)
    old.publish(lost)
    lose_the_last_commit(redis_client)
    publisher_for(redis_client, **options).publish(bumped(weights, 30000, 30100))  # Y
    mine = bumped(lost, 50000, 50100)
    with pytest.raises(VersionConflictError, match=r"publish \w+ of version 1, which the store no longer holds"):
        old.publish(mine)
    assert store.committed_versions(redis_client, KEYS) == [0, 1]
    assert old.publish(mine).version == 2  # re-reads the store first: a delta on the stored v1
    shadow = {}
    assert WeightReader(redis_client, KEYS).sync(shadow).version == 2
    assert_holds(shadow, bits_of(mine))


def test_a_lost_manifest_of_an_old_version_jams_neither_readers_nor_the_publisher(redis_client):
    # A retained version's manifest vanished (evicted under an allkeys-* maxmemory policy, or
    # lost) while its number stayed in the versions set. Retention read every manifest strictly
    # and raised after the full had committed, on every publish from then on; and a reader taking
    # a full read every manifest from version 0, so it failed on it even after a new full.
    weights = sparse_weights()
    publisher = publisher_for(redis_client, rebase_interval=8, rebase_fraction=100.0)
    for step in range(3):  # v0 full, v1 and v2 deltas
        weights = bumped(weights, step, step + 1)
        publisher.publish(weights)
    redis_client.delete(KEYS.weights_manifest(1))
    with pytest.raises(WeightStoreError, match="asked the publisher for a new full export"):
        WeightReader(redis_client, KEYS).sync({})  # v2 cannot be reached without v1: rightly so
    weights = bumped(weights, 100, 101)
    result = publisher.publish(weights)  # the full the reader asked for; retention raised here
    assert (result.version, result.kind) == (3, "full")
    assert store.committed_versions(redis_client, KEYS) == [3]
    redis_client.zadd(KEYS.weights_versions, {"1": 1})  # as if retention had not run: still listed
    weights = bumped(weights, 200, 201)
    assert publisher.publish(weights).version == 4
    fresh = {}
    assert WeightReader(redis_client, KEYS).sync(fresh).version == 4  # reads only 3 and 4
    assert_holds(fresh, bits_of(weights))


def test_a_lost_manifest_of_the_latest_version_lets_a_new_publisher_go_on_with_a_full(redis_client):
    weights = sparse_weights()
    publisher_for(redis_client).publish(weights)
    weights = bumped(weights, 0, 10)
    publisher_for(redis_client).publish(weights)
    redis_client.delete(KEYS.weights_manifest(1))
    restarted = publisher_for(redis_client)
    assert restarted.resume() == 1  # the numbering goes on past the unreadable version
    weights = bumped(weights, 10, 20)
    result = restarted.publish(weights)
    assert (result.version, result.kind) == (2, "full")
    shadow = {}
    assert WeightReader(redis_client, KEYS).sync(shadow).version == 2
    assert_holds(shadow, bits_of(weights))


def test_a_version_of_more_chunks_than_lua_unpacks_at_once_commits(redis_client):
    # The commit script checked its chunks with one EXISTS over all of them: past about 8000 keys
    # Lua's unpack fails, so a large model (or a small chunk size) could never publish, and the
    # error came out as a raw redis.ResponseError.
    weights = {"w": torch.randn(4_200_000, generator=torch.Generator().manual_seed(0))}  # 8.4 MB of bf16
    publisher = publisher_for(redis_client, chunk_bytes=1024)
    result = publisher.publish(weights)
    assert result.kind == "full" and len(store.read_manifests(redis_client, KEYS, [0])[0][0].chunks) > 8000
    shadow = {}
    assert WeightReader(redis_client, KEYS).sync(shadow).version == 0
    assert_holds(shadow, bits_of(weights))


def test_a_commit_whose_reply_was_lost_and_that_ran_again_counts_as_landed(redis_client, monkeypatch):
    # The workers' client retries a command across a Redis restart; a commit that landed but whose
    # reply was lost runs again and is refused as not newer than latest, which is itself.
    publisher, weights = publisher_for(redis_client), sparse_weights()
    publisher.publish(weights)
    commit = store.commit

    def reply_lost(client, keys, manifest, **options):
        commit(client, keys, manifest, **options)
        return commit(client, keys, manifest, **options)  # the retry

    monkeypatch.setattr(store, "commit", reply_lost)
    weights = bumped(weights, 0, 10)
    result = publisher.publish(weights)
    assert (result.version, result.kind) == (1, "delta")
    monkeypatch.undo()
    shadow = {}
    assert WeightReader(redis_client, KEYS).sync(shadow).version == 1
    assert_holds(shadow, bits_of(weights))
    weights = bumped(weights, 10, 20)
    assert publisher.publish(weights).version == 2  # its state went on as if the reply had come


def test_the_workers_client_waits_out_a_redis_restart(redis_server) -> None:
    from rljob.redis_client import connect, outage_budget_s

    assert 30 <= outage_budget_s() <= 120
    client = connect(redis_server.url)
    client.config_set("appendfsync", "always")
    client.set("k", "v")
    redis_server.kill()
    restarter = threading.Timer(1.5, redis_server.start)
    restarter.start()
    started = time.monotonic()
    assert client.get("k") == b"v"  # issued while the server is down
    assert time.monotonic() - started >= 1.0
    restarter.join()
    client.close()
