"""Trainer side: publish each new policy version, as a full export or as a delta.

The publisher keeps the bf16 bit patterns it last published (its baseline) and encodes the next
version against them. A new full export (a rebase) is written when there is no baseline, in
`full` mode, every `rebase_interval` versions, when the tensor layout changed, or when the deltas
since the last full would outgrow `rebase_fraction` of it. After a full, older versions are dropped.

Restarts: the publisher rebuilds its baseline by reading the latest committed version back from
Redis (`resume`, run automatically before the first publish and after any failed one). That is
always right, whatever checkpoint the trainer restarted from: the next delta is computed against
what readers actually hold, and versions continue at latest + 1.

Cost of a delta: one pass over the model (fp32 -> bf16 cast fused with the compare against the
baseline, `_delta`), then work in proportion to the changed values only. SHA-256 covers a window
of 1/`check_versions` of the model that rotates with the version number, so every value is checked
end to end at least every `check_versions` versions, at a fixed small cost per version.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import redis
import safetensors.torch
import torch

from rljob.config import WeightSyncSpec
from rljob.keys import JobKeys
from rljob.weights import store
from rljob.weights.apply import named_tensors
from rljob.weights.changes import BlockSource, Changes, find_changes, merge_changes
from rljob.weights.checksum import bf16_bits, bits_checksum, change_sum, format_sum
from rljob.weights.codec import encode
from rljob.weights.manifest import DeltaStream, Manifest, TensorEntry
from rljob.weights.parallel import TensorPool, gc_paused
from rljob.weights.reader import WeightReader
from rljob.weights.store import MissingChunkError, VersionConflictError, WeightStoreError

log = logging.getLogger(__name__)

# fp32 values cast to bf16 per block (the block's bf16 copy stays in cache for the compare).
_CAST_BLOCK = 1 << 20


@dataclass
class PublishResult:
    version: int
    kind: Literal["full", "delta"]
    bytes: int  # payload + manifest written to Redis
    payload_bytes: int
    changed: int  # bf16 values that differ from the previous version
    encode_seconds: float
    reason: str  # why a full was written


def _owned_bits(tensor: torch.Tensor) -> np.ndarray:
    """bf16 patterns in memory the publisher owns (`bf16_bits` is a view of a CPU bf16 tensor)."""
    flat = bf16_bits(tensor)
    if tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu":
        flat = flat.copy()
    return flat


class WeightPublisher:
    def __init__(
        self,
        redis_client: redis.Redis,
        keys: JobKeys,
        *,
        rebase_interval: int,
        rebase_fraction: float,
        chunk_bytes: int,
        mode: Literal["delta", "full"] = "delta",
        check_versions: int = 16,
        threads: int | None = None,
    ) -> None:
        if rebase_interval < 1 or rebase_fraction <= 0 or chunk_bytes < 1 or check_versions < 1:
            raise ValueError(
                "rebase_interval >= 1, rebase_fraction > 0, chunk_bytes >= 1 and check_versions >= 1 are required"
            )
        if mode not in ("delta", "full"):
            raise ValueError(f"mode must be 'delta' or 'full', got {mode!r}")
        self.client = redis_client
        self.keys = keys
        self.rebase_interval = rebase_interval
        self.rebase_fraction = rebase_fraction
        self.chunk_bytes = chunk_bytes
        self.mode = mode
        self.check_versions = check_versions
        self._resumed = False
        # The bf16 patterns last published, owned here and advanced in place by each delta.
        self._baseline: dict[str, np.ndarray] | None = None
        self._pool = TensorPool(threads, "weight-encode")
        self._local = threading.local()  # per-thread reused cast buffer
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._last: Manifest | None = None
        # The stored latest version when its manifest could not be read back (numbering goes on).
        self._unreadable_latest: int | None = None

    @classmethod
    def from_spec(cls, redis_client: redis.Redis, keys: JobKeys, spec: WeightSyncSpec) -> WeightPublisher:
        """Build from the job config's `weightSync` section."""
        knobs = spec.model_dump(include={"rebase_interval", "rebase_fraction", "chunk_bytes", "mode"})
        return cls(redis_client, keys, **knobs)

    @property
    def latest_version(self) -> int | None:
        return self._unreadable_latest if self._last is None else self._last.version

    @property
    def next_version(self) -> int:
        if not self._resumed:
            self.resume()
        latest = self.latest_version
        return 0 if latest is None else latest + 1

    def resume(self) -> int | None:
        """Continue from what Redis holds: read the latest version back as the baseline.

        Also clears leftovers of an interrupted publish. Returns the latest version, or None.
        """
        store.drop_orphans(self.client, self.keys)
        store.apply_retention(self.client, self.keys)
        self._baseline, self._shapes, self._last, self._unreadable_latest = None, {}, None, None
        latest = store.latest_version(self.client, self.keys)
        if latest is not None:
            shadow: dict[str, torch.Tensor] = {}
            reader = WeightReader(self.client, self.keys, threads=self._pool.threads)
            try:
                result = reader.sync(shadow)
            except WeightStoreError as exc:
                # The stored chain is unreadable: continue the numbering, start over with a full
                # (with no baseline, the next publish is one).
                log.warning("weight publisher could not read version %d back (%s); next is a full", latest, exc)
                self._unreadable_latest = latest
            else:
                self._baseline = {name: bf16_bits(t).copy() for name, t in shadow.items()}
                self._shapes = {name: tuple(t.shape) for name, t in shadow.items()}
                self._last = store.read_manifests(self.client, self.keys, [result.version])[0][0]
                log.info("weight publisher resumed at version %d (%s)", result.version, self._last.kind)
            finally:
                reader.close()  # a one-off reader: do not leave its threads behind
        self._resumed = True
        return self.latest_version

    def publish(
        self, named_params: Mapping[str, torch.Tensor] | torch.nn.Module, version: int | None = None
    ) -> PublishResult:
        """Publish the given weights (fp32 rounded to nearest bf16, or bf16) as the next version."""
        if not self._resumed:
            self.resume()
        latest = self.latest_version
        if version is None:
            version = 0 if latest is None else latest + 1
        elif latest is not None and version <= latest:
            raise VersionConflictError(f"version {version} is not newer than the published {latest}")
        try:
            with gc_paused():
                return self._publish(named_params, version)
        except BaseException:
            # The baseline may be advanced past what Redis holds, or the commit may or may not have
            # landed: re-read Redis before the next publish.
            self._resumed = False
            raise

    def _publish(self, named_params: Mapping[str, torch.Tensor] | torch.nn.Module, version: int) -> PublishResult:
        tensors = named_tensors(named_params)
        shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
        started = time.perf_counter()
        reason = self._full_reason(shapes)
        if reason:
            bits = {name: _owned_bits(tensor) for name, tensor in tensors.items()}
            changed = 0
            if self._baseline is not None and shapes == self._shapes:
                changed = sum(int(np.count_nonzero(self._baseline[n] != bits[n])) for n in bits)
        else:
            payload, manifest = self._delta(version, tensors)  # the baseline now holds this version
            bits, changed = self._baseline, manifest.changed
            if manifest.chain_bytes > self.rebase_fraction * manifest.full_bytes:
                reason = f"delta chain {manifest.chain_bytes} B > {self.rebase_fraction} x full {manifest.full_bytes} B"
        if reason:
            payload, manifest = self._full(version, bits, shapes, changed)
        result = self._commit(payload, manifest, reason, time.perf_counter() - started)
        self._baseline, self._shapes = bits, shapes
        return result

    def _commit(
        self, payload: bytes, manifest: Manifest, reason: str, encode_seconds: float, *, replace: bool = False
    ) -> PublishResult:
        """Write the chunks under a fresh publish id, then commit (see store.commit); a refused
        commit takes its chunks away again, and so does a replaced manifest once the commit landed.
        After a full, the rebase request is answered and older versions are dropped."""
        manifest.publish_id = uuid.uuid4().hex[:12]  # its own chunk keys, and the version's identity
        manifest.chunks = store.write_chunks(
            self.client, self.keys, manifest.version, payload, self.chunk_bytes, manifest.publish_id
        )
        try:
            manifest_bytes = store.commit(self.client, self.keys, manifest, replace=replace)
        except VersionConflictError:
            if store.latest_with_id(self.client, self.keys) != (manifest.version, manifest.publish_id):
                self._drop_chunks(manifest)
                raise
            # Our own commit, run again by the client's retry after its reply was lost.
            log.warning("weight version %d had committed before its reply was lost", manifest.version)
            manifest_bytes = len(manifest.model_dump_json().encode())
        except MissingChunkError:
            self._drop_chunks(manifest)
            raise
        if replace:
            self._drop_chunks(self._last)
        self._last = manifest
        if manifest.kind == "full":
            self.client.delete(self.keys.weights_rebase)
            try:  # the version has landed whatever happens here: log, and the next full retries
                store.apply_retention(self.client, self.keys)
            except (WeightStoreError, redis.RedisError) as exc:
                log.warning("weight retention failed after a commit (the next full retries): %s", exc)
        return PublishResult(
            version=manifest.version,
            kind=manifest.kind,
            bytes=len(payload) + manifest_bytes,
            payload_bytes=len(payload),
            changed=manifest.changed,
            encode_seconds=encode_seconds,
            reason=reason,
        )

    def _drop_chunks(self, manifest: Manifest | None) -> None:
        """Chunks no manifest names any more: a refused commit's, or those of the manifest a re-export
        replaced (a reader still fetching them retries on the full)."""
        if manifest is not None and manifest.chunks:
            self.client.delete(*[ref.key for ref in manifest.chunks])

    def answer_rebase(self) -> PublishResult | None:
        """When a reader asked for a rebase (it cannot apply what is stored: a chunk that stays
        corrupt in Redis, say), re-export the latest version as a full under its own number and
        return what was written; else None.

        For a trainer waiting on rollouts: no new version comes before they arrive, and the readers
        that asked produce none until they can load the latest one, so waiting for the next publish
        would wait forever. The same number, because the values are the same and the trainer's
        policy-version arithmetic counts versions; the new publish id tells readers it changed.
        """
        requested = self.client.get(self.keys.weights_rebase)
        if requested is None:
            return None
        if not self._resumed:
            self.resume()
        if self._baseline is None or self._last is None:
            return None  # nothing readable to re-export: the next publish is a full anyway
        payload, manifest = self._full(self._last.version, self._baseline, self._shapes, changed=0)
        result = self._commit(payload, manifest, "a reader asked for a rebase", 0.0, replace=True)
        log.warning(
            "re-exported weight version %d as a full: a reader asked (%s)",
            result.version,
            requested.decode(errors="replace")[:200],
        )
        return result

    def _new_bits(self, tensor: torch.Tensor) -> np.ndarray | BlockSource:
        """The tensor's bf16 patterns, flat: a view of a CPU bf16 tensor; for a CPU fp32 tensor a
        function that casts one block at a time into a small reused buffer (round to nearest even,
        as `bf16_bits`), so the cast output never leaves the cache; otherwise a whole-tensor cast
        into a reused buffer (valid until the next call)."""
        t = tensor.detach()
        if t.device.type == "cpu" and t.is_contiguous():
            flat = t.reshape(-1)
            if t.dtype == torch.bfloat16:
                return flat.view(torch.int16).numpy().view(np.uint16)
            if t.dtype == torch.float32:
                block = self._scratch_of(min(flat.numel(), _CAST_BLOCK))
                block_bf16 = torch.from_numpy(block.view(np.int16)).view(torch.bfloat16)

                def cast(start: int, stop: int) -> np.ndarray:
                    block_bf16[: stop - start].copy_(flat[start:stop])
                    return block[: stop - start]

                return cast
        out = self._scratch_of(t.numel())
        torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).view(t.shape).copy_(t)
        return out

    def _scratch_of(self, n: int) -> np.ndarray:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.size < n:
            scratch = self._local.scratch = np.empty(n, dtype=np.uint16)
        return scratch[:n]

    def _find_one(self, name: str, tensor: torch.Tensor, window: tuple[int, int] | None) -> tuple[Changes, str]:
        """One tensor: its changes against the baseline, written into it on the way, and the
        SHA-256 of its check window of the advanced baseline (empty without a window)."""
        assert self._baseline is not None
        base = self._baseline[name]
        changes = find_changes(base, self._new_bits(tensor), advance=True)
        return changes, bits_checksum(base[window[0] : window[1]]) if window else ""

    def _delta(self, version: int, tensors: dict[str, torch.Tensor]) -> tuple[bytes, Manifest]:
        """The version as one change stream over all tensors laid end to end (model order); the
        baseline is advanced to it on the way.

        Finding the changes is the pass over the model, per tensor on the pool's threads (numpy and
        torch release the GIL for the block work); largest first, for an even split. Then the
        change sum and the codec's two streams run as three jobs on the pool.
        """
        last = self._last
        assert last is not None
        names = list(tensors)
        windows = self._check_windows(version, {name: tensor.numel() for name, tensor in tensors.items()})
        order = sorted(names, key=lambda name: -tensors[name].numel())
        found = self._pool.map(
            lambda n: self._find_one(n, tensors[n], windows.get(n)), order, cost=lambda n: tensors[n].numel()
        )
        by_name = dict(zip(order, found, strict=True))
        merged, numel = merge_changes([by_name[name][0] for name in names], [tensors[name].numel() for name in names])
        total = self._pool.submit(lambda: change_sum(merged.positions, merged.old, merged.new))
        stream = encode(merged, numel, self._pool)
        entries = [
            TensorEntry(
                name=name,
                shape=list(tensors[name].shape),
                checksum=by_name[name][1],
                check_range=list(windows[name]) if name in windows else None,
                changed=by_name[name][0].count,
            )
            for name in names
        ]
        payload = stream.payload()
        manifest = Manifest(
            version=version,
            kind="delta",
            base_version=last.version,
            base_publish_id=last.publish_id,
            full_version=last.full_version,
            chain_length=last.chain_length + 1,
            chain_bytes=(last.chain_bytes if last.kind == "delta" else 0) + len(payload),
            full_bytes=last.full_bytes,
            payload_bytes=len(payload),
            numel=numel,
            changed=merged.count,
            created_at=time.time(),
            chunks=[],
            tensors=entries,
            stream=DeltaStream(**stream.meta()),
            change_sum=format_sum(total.result()),
        )
        return payload, manifest

    def close(self) -> None:
        """Stop the encoding threads (idempotent; a later publish starts them again)."""
        self._pool.close()

    def _check_windows(self, version: int, sizes: dict[str, int]) -> dict[str, tuple[int, int]]:
        """Element range of each tensor this version checks by SHA-256: window `version % K` of K
        equal slices of the model laid end to end."""
        total = sum(sizes.values())
        window = version % self.check_versions
        low, high = window * total // self.check_versions, (window + 1) * total // self.check_versions
        ranges, offset = {}, 0
        for name, size in sizes.items():
            start, stop = max(low, offset), min(high, offset + size)
            if start < stop:
                ranges[name] = (start - offset, stop - offset)
            offset += size
        return ranges

    def _full_reason(self, shapes: dict[str, tuple[int, ...]]) -> str:
        if self.mode == "full":
            return "mode is full"
        if self._baseline is None or self._last is None:
            return "no baseline (first version, or the stored one is unreadable)"
        if shapes != self._shapes:
            return "tensor layout changed"
        if self._last.chain_length + 1 >= self.rebase_interval:
            return f"rebase interval {self.rebase_interval} reached"
        requested = self.client.get(self.keys.weights_rebase)
        if requested is not None:
            return f"a reader asked for a rebase: {requested.decode(errors='replace')[:300]}"
        return ""

    def _full(
        self, version: int, bits: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]], changed: int
    ) -> tuple[bytes, Manifest]:
        """A full export of `bits` (safetensors), every tensor checked by SHA-256."""
        as_bf16 = {
            name: torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16).reshape(shapes[name])
            for name, flat in bits.items()
        }
        payload = safetensors.torch.save(as_bf16)
        checksums = self._pool.map(bits_checksum, bits.values(), cost=lambda flat: flat.size)
        entries = [
            TensorEntry(name=name, shape=list(shapes[name]), checksum=checksum)
            for name, checksum in zip(bits, checksums, strict=True)
        ]
        manifest = Manifest(
            version=version,
            kind="full",
            full_version=version,
            full_bytes=len(payload),
            payload_bytes=len(payload),
            numel=sum(int(flat.size) for flat in bits.values()),
            changed=changed,
            created_at=time.time(),
            chunks=[],
            tensors=entries,
        )
        return payload, manifest
