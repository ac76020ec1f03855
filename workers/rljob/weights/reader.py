"""Rollout side: bring a model's weights to the newest published version, in place.

A reader remembers which version its target holds. `sync` fetches only the versions after it
(the deltas), or the newest full export when the reader is new, too far behind (the deltas it
lacks outweigh a full), or its deltas were dropped by retention. Every chunk is CRC-checked before
anything is applied. After a full, every tensor is checked by SHA-256. A delta (one stream over all
tensors laid end to end) is decoded once and written straight into the target's memory, touching
only the changed values, and checked by its change sum (which also fails when the target did not
hold the base version where the delta touches it) and by SHA-256 over the manifest's rotating
window (drift elsewhere is caught within `check_versions` versions). On any failure the reader
forgets its version and refetches, taking the newest full. One reader serves one target.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field

import redis
import safetensors.torch
import torch

from rljob.keys import JobKeys
from rljob.weights import store
from rljob.weights.apply import apply_stream, named_tensors, write_full
from rljob.weights.checksum import format_sum, tensor_checksum
from rljob.weights.codec import DeltaFormatError, EncodedDelta
from rljob.weights.manifest import Manifest
from rljob.weights.parallel import TensorPool, gc_paused
from rljob.weights.store import (
    ChecksumMismatchError,
    NoWeightsPublishedError,
    VersionUnavailableError,
    WeightStoreError,
)

log = logging.getLogger(__name__)

Target = torch.nn.Module | MutableMapping[str, torch.Tensor]

# Errors after which refetching (from the newest full) can help.
RECOVERABLE = (
    store.MissingChunkError,
    store.CorruptChunkError,
    ChecksumMismatchError,
    VersionUnavailableError,
    DeltaFormatError,
)


class WeightLayoutError(WeightStoreError):
    """The target's tensor names or shapes do not match the published ones (not recoverable)."""


@dataclass
class SyncResult:
    version: int
    changed: list[str] = field(default_factory=list)
    bytes_fetched: int = 0
    took_full: bool = False
    versions_applied: list[int] = field(default_factory=list)
    recovered_from: list[str] = field(default_factory=list)  # errors met and recovered from


class WeightReader:
    MAX_ATTEMPTS = 3  # syncs tried before asking the publisher for a new full export

    def __init__(self, redis_client: redis.Redis, keys: JobKeys, *, threads: int | None = None) -> None:
        self.client = redis_client
        self.keys = keys
        self._pool = TensorPool(threads, "weight-apply")
        self.version: int | None = None  # version the target holds, None when unknown
        self.publish_id = ""  # that version's publish id (a number alone can name two versions)

    def latest_version(self) -> int | None:
        return store.latest_version(self.client, self.keys)

    def needs_sync(self) -> bool:
        """Whether a version is published that the target does not hold (in one round trip): another
        number, or the same number under another publish id (after Redis lost its last commit)."""
        latest, latest_id = store.latest_with_id(self.client, self.keys)
        return latest is not None and (self.version != latest or self.publish_id != latest_id)

    def wait_for_version(self, min_version: int, timeout: float) -> int:
        """Block until a version >= `min_version` is committed; returns it. Survives Redis restarts."""
        deadline = time.monotonic() + timeout
        pubsub = None
        try:
            while True:
                try:
                    latest = self.latest_version()
                    if latest is not None and latest >= min_version:
                        return latest
                    if pubsub is None:
                        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                        pubsub.subscribe(self.keys.weights_events)
                        continue  # re-check: a version may have landed before the subscription
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    # Bounded wait: polling `latest` too covers messages missed across reconnects.
                    pubsub.get_message(timeout=min(remaining, 1.0))
                except (redis.ConnectionError, redis.TimeoutError):
                    if pubsub is not None:
                        pubsub.close()
                        pubsub = None
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(0.1)
        finally:
            if pubsub is not None:
                pubsub.close()
        try:
            latest = self.latest_version()
        except redis.RedisError:
            latest = None
        raise TimeoutError(f"no weight version >= {min_version} within {timeout:.1f}s (latest {latest})")

    def sync(self, target: Target) -> SyncResult:
        """Bring `target` to the newest committed version; returns what was done."""
        errors: list[str] = []
        for attempt in range(self.MAX_ATTEMPTS):
            try:
                with gc_paused():
                    result = self._sync_once(target, force_full=attempt > 0)
            except RECOVERABLE as exc:
                log.warning("weight sync attempt %d failed, refetching from the newest full: %s", attempt + 1, exc)
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            result.recovered_from = errors
            return result
        message = f"weight sync failed after {self.MAX_ATTEMPTS} attempts: {'; '.join(errors)}"
        try:  # what is stored cannot be applied: ask the publisher for a new full export
            self.client.set(self.keys.weights_rebase, message[:2000])
        except redis.RedisError as exc:
            log.warning("could not request a rebase: %s", exc)
        raise WeightStoreError(message + " (asked the publisher for a new full export)")

    # ------------------------------------------------------------------ planning

    def _sync_once(self, target: Target, force_full: bool) -> SyncResult:
        latest, latest_id = store.latest_with_id(self.client, self.keys)
        if latest is None:
            raise NoWeightsPublishedError(f"no weights published under {self.keys.prefix}")
        if self.version == latest and self.publish_id != latest_id:
            # Redis lost the version we hold (its last commit) and a publisher wrote another under
            # the same number: what we hold is no base for anything stored.
            log.warning("weight version %d in the store is not the one this reader holds; taking a full", latest)
            self.version = None
        if self.version == latest and not force_full:
            return SyncResult(version=latest)
        chain, read = None, []
        if self.version is not None and not force_full:
            # Only the versions after ours; one whose manifest is gone makes a gap the chain check sees.
            versions = store.committed_versions(self.client, self.keys, self.version + 1, latest)
            read = store.read_manifests(self.client, self.keys, versions, skip_missing=True)
            chain = self._delta_chain(read, latest)
        if chain is None:
            chain = self._from_newest_full(read, latest)
        result = SyncResult(version=latest, bytes_fetched=sum(size for _, size in read))
        changed: dict[str, None] = {}
        for manifest in chain:
            payload = store.read_payload(self.client, manifest)  # every chunk checked before any write
            self.version, self.publish_id = None, ""  # the target is in between versions until verified
            if manifest.kind == "full":
                names = self._apply_full(target, manifest, payload)
                result.took_full = True
            else:
                names = self._apply_delta(target, manifest, payload)
            changed.update(dict.fromkeys(names))
            result.bytes_fetched += manifest.payload_bytes
            result.versions_applied.append(manifest.version)
            self.version, self.publish_id = manifest.version, manifest.publish_id
        result.changed = list(changed)
        return result

    def _delta_chain(self, manifests: list[tuple[Manifest, int]], latest: int) -> list[Manifest] | None:
        """The deltas from the held version to `latest`, or None when a full is the way."""
        if self.version is None or not manifests:
            return None
        chain, base, base_id = [], self.version, self.publish_id
        for manifest, _ in manifests:
            if manifest.kind != "delta" or manifest.base_version != base:
                return None  # a rebase happened, or a gap: the deltas we need are not there
            if manifest.base_publish_id != base_id:
                # Built on another publish of that number (Redis lost the one we hold): no base here.
                log.warning(
                    "weight delta %d builds on another publish of version %d; taking a full", manifest.version, base
                )
                return None
            chain.append(manifest)
            base, base_id = manifest.version, manifest.publish_id
        if base != latest:
            return None
        # Too far behind: the deltas weigh more than the full they build on.
        if sum(m.payload_bytes for m in chain) >= chain[-1].full_bytes:
            return None
        return chain

    def _from_newest_full(self, read: list[tuple[Manifest, int]], latest: int) -> list[Manifest]:
        """The newest full and the deltas after it up to `latest`, reading only those manifests
        (older versions are none of a reader's business, and one of them may be gone). `read` holds
        the manifests read so far; those read here are added to it."""
        by_version = {m.version: m for m, _ in read}

        def fetch(versions: list[int]) -> None:
            for manifest, size in store.read_manifests(self.client, self.keys, sorted(set(versions) - set(by_version))):
                by_version[manifest.version] = manifest
                read.append((manifest, size))

        fetch([latest])
        full_version = by_version[latest].full_version
        fetch([full_version, *store.committed_versions(self.client, self.keys, full_version, latest)])
        chain = [by_version[v] for v in sorted(by_version) if full_version <= v <= latest]
        for prev, nxt in itertools.pairwise(chain):
            if nxt.base_version != prev.version or nxt.base_publish_id != prev.publish_id:
                raise VersionUnavailableError(
                    f"delta {nxt.version} builds on {nxt.base_version} (publish {nxt.base_publish_id or '?'}), "
                    f"but the store has {prev.version} (publish {prev.publish_id or '?'})"
                )
        if chain[0].kind != "full":
            raise VersionUnavailableError(f"version {full_version} named as a full export is a {chain[0].kind}")
        return chain

    # ------------------------------------------------------------------ applying

    def _apply_full(self, target: Target, manifest: Manifest, payload: bytes) -> list[str]:
        published = safetensors.torch.load(payload)
        names = [entry.name for entry in manifest.tensors]
        tensors = named_tensors(target)
        missing, extra = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
        if isinstance(target, torch.nn.Module) and (missing or extra):
            raise WeightLayoutError(
                f"model and weight version {manifest.version} disagree: missing in model {missing[:5]}, "
                f"not published {extra[:5]}"
            )
        for name in names:
            if name in tensors:
                self._check_shape(tensors[name], published[name].shape, name)
                write_full(tensors[name], published[name])
            else:  # a dict target (a shadow) takes a new name as a bf16 copy
                target[name] = tensors[name] = published[name].clone()
        verify_checksums(tensors, manifest, names, self._pool)
        return names

    def _apply_delta(self, target: Target, manifest: Manifest, payload: bytes) -> list[str]:
        """One stream over all tensors laid end to end, checked by one change sum."""
        assert manifest.stream is not None
        tensors = named_tensors(target)
        entries = manifest.tensors
        for entry in entries:
            if entry.changed and entry.name not in tensors:
                raise WeightLayoutError(f"weight version {manifest.version} updates {entry.name}, absent here")
            if entry.name in tensors:
                self._check_shape(tensors[entry.name], entry.shape, entry.name)
        enc = EncodedDelta.from_meta(manifest.stream.model_dump(), payload)
        sizes = [math.prod(entry.shape) for entry in entries]
        actual, touched = apply_stream([tensors.get(entry.name) for entry in entries], sizes, enc, self._pool)
        if format_sum(actual) != manifest.change_sum:  # a target off its base, or a wrong decode
            raise ChecksumMismatchError(
                f"weight version {manifest.version} changed by sum {format_sum(actual)}, manifest says "
                f"{manifest.change_sum} (the target was not at version {manifest.base_version}, or the delta "
                "decoded wrongly)"
            )
        verify_checksums(tensors, manifest, [entry.name for entry in entries if entry.checksum], self._pool)
        return [entries[i].name for i in touched]

    @staticmethod
    def _check_shape(tensor: torch.Tensor, shape: tuple[int, ...] | torch.Size, name: str) -> None:
        if tuple(tensor.shape) != tuple(shape):
            raise WeightLayoutError(f"{name}: target shape {tuple(tensor.shape)}, published {tuple(shape)}")

    def close(self) -> None:
        """Stop the apply threads (idempotent; a later sync starts them again)."""
        self._pool.close()


def verify_checksums(
    tensors: dict[str, torch.Tensor], manifest: Manifest, names: list[str], pool: TensorPool | None = None
) -> None:
    """SHA-256 of each named tensor (over its `check_range`, or whole) against the manifest."""
    entries = {entry.name: entry for entry in manifest.tensors}
    for name in names:
        if name not in tensors:
            raise WeightLayoutError(f"weight version {manifest.version} checks {name}, absent here")

    def check(name: str) -> None:
        entry = entries[name]
        start, stop = entry.check_range if entry.check_range is not None else (0, None)
        actual = tensor_checksum(tensors[name], start, stop)
        if actual != entry.checksum:
            where = "" if entry.check_range is None else f"[{start}:{stop}] "
            raise ChecksumMismatchError(
                f"weight version {manifest.version}: {name} {where}has checksum {actual}, "
                f"manifest says {entry.checksum}"
            )

    def size(name: str) -> int:
        window = entries[name].check_range
        return window[1] - window[0] if window is not None else tensors[name].numel()

    (pool or TensorPool(1)).map(check, names, cost=size)
