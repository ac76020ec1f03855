"""Redis I/O of the weight store: chunks, manifests, the `latest` pointer, retention.

Layout (all under the job's `JobKeys` prefix):
  weights:v{N}:{A}:chunk:{i}  payload bytes of version N written by publish attempt A (a random
                           id), split below `chunk_bytes`; the manifest names them
  weights:v{N}:manifest    JSON `Manifest`, written last
  weights:versions         sorted set of committed versions (score = version)
  weights:latest           the newest committed version
  weights:latest_id        its manifest's publish id (set with `latest`)
  weights:events           pub/sub channel; each commit publishes the version number

Writing a version: chunks first (any order, any number of round trips), then one Lua script sets
the manifest, adds the version, moves `latest` and publishes, atomically, and only if the version
is newer than `latest`, a delta's base is `latest`, and every chunk the manifest names is there.
So a second publisher (an old trainer pod still alive during a gang restart) can neither
overwrite a committed version's chunks (its own have their own keys) nor commit a delta on a
version the store no longer holds. A crash before the script leaves orphan chunks that no manifest
names, invisible to readers and removed by the next publisher's `drop_orphans`, which re-checks
each key's version atomically, so it never removes a version committed in the meantime.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator

import redis
from pydantic import ValidationError

from rljob.keys import JobKeys
from rljob.weights.checksum import chunk_crc
from rljob.weights.manifest import MANIFEST_FORMAT, ChunkRef, Manifest

# Chunks per round trip: bounded so one request stays well below Redis' client buffer limits.
_BATCH_BYTES = 64 * 1024 * 1024

# KEYS: latest, manifest, versions, events, latest_id, then the version's chunk keys.
# ARGV: version, manifest JSON, base version of a delta ('' for a full), publish id, 'replace' to
# re-export the latest version under its own number ('' otherwise), and the publish id of a delta's
# base ('' for a full).
# The chunks are checked for in slices: Lua's unpack takes at most about 8000 values.
_COMMIT = """
local current = redis.call('GET', KEYS[1])
if ARGV[5] == 'replace' then
  if not current or tonumber(current) ~= tonumber(ARGV[1]) then
    return redis.error_reply('STALE version ' .. ARGV[1] .. ' to replace is not latest ' .. (current or 'none'))
  end
elseif current and tonumber(current) >= tonumber(ARGV[1]) then
  return redis.error_reply('STALE version ' .. ARGV[1] .. ' is not newer than latest ' .. current)
end
if ARGV[3] ~= '' and (not current or tonumber(current) ~= tonumber(ARGV[3])) then
  return redis.error_reply('BASE delta ' .. ARGV[1] .. ' builds on ' .. ARGV[3] .. ', but latest is ' ..
    (current or 'none'))
end
if ARGV[3] ~= '' and redis.call('GET', KEYS[5]) ~= ARGV[6] then
  return redis.error_reply('BASE delta ' .. ARGV[1] .. ' builds on publish ' .. ARGV[6] .. ' of version ' ..
    ARGV[3] .. ', which the store no longer holds')
end
if #KEYS > 5 then
  local present = 0
  for first = 6, #KEYS, 1000 do
    present = present + redis.call('EXISTS', unpack(KEYS, first, math.min(first + 999, #KEYS)))
  end
  if present ~= #KEYS - 5 then
    return redis.error_reply('CHUNKS ' .. (#KEYS - 5 - present) .. ' of the ' .. (#KEYS - 5) ..
      ' chunks of version ' .. ARGV[1] .. ' are missing')
  end
end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[1], ARGV[1])
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[5], ARGV[4])
redis.call('PUBLISH', KEYS[4], ARGV[1])
return 1
"""


class WeightStoreError(RuntimeError):
    """Base of the weight store's errors."""


class ManifestFormatError(WeightStoreError):
    """A manifest this reader cannot read (another format, or damaged)."""


class MissingChunkError(WeightStoreError):
    """A chunk a manifest names is gone (evicted by retention, or lost)."""


class CorruptChunkError(WeightStoreError):
    """A chunk's bytes do not match the CRC in its manifest."""


class ChecksumMismatchError(WeightStoreError):
    """A tensor's bf16 checksum after applying a version differs from the manifest."""


class VersionUnavailableError(WeightStoreError):
    """A version is not (or no longer) in the store."""


class NoWeightsPublishedError(WeightStoreError):
    """Nothing has been published for this job yet."""


class VersionConflictError(WeightStoreError):
    """A publish would not move `latest` forward."""


def latest_version(client: redis.Redis, keys: JobKeys) -> int | None:
    return latest_with_id(client, keys)[0]


def latest_with_id(client: redis.Redis, keys: JobKeys) -> tuple[int | None, str]:
    """The newest committed version and its publish id, in one round trip."""
    version, publish_id = client.mget([keys.weights_latest, keys.weights_latest_id])
    text = publish_id.decode() if isinstance(publish_id, bytes) else (publish_id or "")
    return None if version is None else int(version), text


def committed_versions(client: redis.Redis, keys: JobKeys, low: int = 0, high: int | None = None) -> list[int]:
    top = "+inf" if high is None else high
    return [int(v) for v in client.zrangebyscore(keys.weights_versions, low, top)]


def read_manifests(
    client: redis.Redis, keys: JobKeys, versions: list[int], *, skip_missing: bool = False
) -> list[tuple[Manifest, int]]:
    """Manifests (with their JSON size) of `versions`; a missing one raises, or with `skip_missing`
    is left out."""
    out = []
    raws = client.mget([keys.weights_manifest(v) for v in versions]) if versions else []
    for version, raw in zip(versions, raws, strict=True):
        if raw is not None:
            out.append((_parse_manifest(raw, version), len(raw)))
        elif not skip_missing:
            raise VersionUnavailableError(f"manifest of weight version {version} is missing from {keys.prefix}")
    return out


def _parse_manifest(raw: bytes, version: int) -> Manifest:
    """A manifest, or a clear error when another rljob release wrote it."""
    try:
        return Manifest.model_validate_json(raw)
    except ValidationError as exc:
        try:
            written = int(json.loads(raw).get("format", 0))
        except (ValueError, TypeError, AttributeError):
            written = MANIFEST_FORMAT  # not a manifest at all: damaged
        if written != MANIFEST_FORMAT:
            raise ManifestFormatError(
                f"weight version {version} was written in manifest format {written}; this reader reads "
                f"{MANIFEST_FORMAT}: run the same rljob version in the trainer and the rollout workers"
            ) from exc
        raise ManifestFormatError(f"manifest of weight version {version} is invalid: {exc}") from exc


def _batches(refs: list[ChunkRef]) -> Iterator[range]:
    """Indices of `refs` in runs of about `_BATCH_BYTES`, one round trip each."""
    start = pending = 0
    for index, ref in enumerate(refs):
        pending += ref.length
        if pending >= _BATCH_BYTES:
            yield range(start, index + 1)
            start, pending = index + 1, 0
    if start < len(refs):
        yield range(start, len(refs))


def write_chunks(
    client: redis.Redis, keys: JobKeys, version: int, payload: bytes, chunk_bytes: int, attempt: str = ""
) -> list[ChunkRef]:
    """Split `payload` into chunks of at most `chunk_bytes` and SET them under this publish
    attempt's keys; returns their refs."""
    view = memoryview(payload)
    parts = [view[start : start + chunk_bytes] for start in range(0, len(payload), chunk_bytes)]
    refs = [
        ChunkRef(key=keys.weights_chunk(version, index, attempt), length=len(part), crc=chunk_crc(part))
        for index, part in enumerate(parts)
    ]
    for batch in _batches(refs):
        pipe = client.pipeline(transaction=False)
        for index in batch:
            pipe.set(refs[index].key, parts[index].tobytes())
        pipe.execute()
    return refs


def read_payload(client: redis.Redis, manifest: Manifest) -> bytes:
    """The version's payload, every chunk checked against its manifest CRC before use."""
    refs = manifest.chunks
    parts: list[bytes] = []
    for batch in _batches(refs):
        for index, value in zip(batch, client.mget([refs[index].key for index in batch]), strict=True):
            ref = refs[index]
            chunk = f"weight version {manifest.version}: chunk {index} ({ref.key})"
            if value is None:
                raise MissingChunkError(f"{chunk} is missing")
            if len(value) != ref.length or chunk_crc(value) != ref.crc:
                raise CorruptChunkError(
                    f"{chunk} is corrupt ({len(value)} bytes, crc {chunk_crc(value):#010x}; manifest says "
                    f"{ref.length} bytes, crc {ref.crc:#010x})"
                )
            parts.append(value)
    return b"".join(parts)


def commit(client: redis.Redis, keys: JobKeys, manifest: Manifest, *, replace: bool = False) -> int:
    """Atomically publish a manifest whose chunks are written; returns its size in bytes.

    Refused (nothing changes) when the version is not newer than `latest` or a delta's base is not
    `latest`, by number or by publish id (VersionConflictError), or when a chunk it
    names is gone (MissingChunkError). With `replace`, the manifest takes the place of the latest
    version's own (same number, a full of the same values: a re-export) and must be for exactly
    that version."""
    raw = manifest.model_dump_json().encode()
    base = "" if manifest.kind == "full" or manifest.base_version is None else str(manifest.base_version)
    chunk_keys = [ref.key for ref in manifest.chunks]
    try:
        client.eval(
            _COMMIT,
            5 + len(chunk_keys),
            keys.weights_latest,
            keys.weights_manifest(manifest.version),
            keys.weights_versions,
            keys.weights_events,
            keys.weights_latest_id,
            *chunk_keys,
            manifest.version,
            raw,
            base,
            manifest.publish_id,
            "replace" if replace else "",
            manifest.base_publish_id if base else "",
        )
    except redis.ResponseError as exc:
        message = str(exc)
        if message.startswith(("STALE", "BASE")):
            raise VersionConflictError(message) from exc
        if message.startswith("CHUNKS"):
            raise MissingChunkError(message) from exc
        raise WeightStoreError(f"Redis refused the commit of weight version {manifest.version}: {message}") from exc
    return len(raw)


def drop_versions(client: redis.Redis, keys: JobKeys, versions: Iterable[int]) -> int:
    """Delete versions (manifest, chunks, membership); returns how many were dropped."""
    versions = list(versions)
    present = read_manifests(client, keys, versions, skip_missing=True)
    chunks = {manifest.version: manifest.chunks for manifest, _ in present}
    pipe = client.pipeline(transaction=False)
    for version in versions:
        pipe.zrem(keys.weights_versions, version)
        pipe.delete(keys.weights_manifest(version))
        for ref in chunks.get(version, []):
            pipe.delete(ref.key)
    pipe.execute()
    return len(versions)


def apply_retention(client: redis.Redis, keys: JobKeys) -> int:
    """Keep the newest full export and the deltas after it; drop every older version, and any
    version whose manifest is gone (evicted or lost: nobody can read it)."""
    versions = committed_versions(client, keys)
    if not versions:
        return 0
    present = read_manifests(client, keys, versions, skip_missing=True)
    readable = {manifest.version for manifest, _ in present}
    fulls = [manifest.version for manifest, _ in present if manifest.kind == "full"]
    newest_full = max(fulls) if fulls else None
    doomed = [v for v in versions if v not in readable or (newest_full is not None and v < newest_full)]
    return drop_versions(client, keys, doomed)


_VERSION_KEY = re.compile(r":weights:v(\d+):")

# KEYS: the versions set, then for each candidate its key and its version's manifest key;
# ARGV: each candidate's version. A candidate goes if its version is not committed at that moment,
# or (a chunk of a publisher that lost the race for a committed number) that version's manifest
# does not name it.
_DROP_ORPHANS = """
local dropped = 0
for i = 1, #ARGV do
  local key, manifest_key = KEYS[2 * i], KEYS[2 * i + 1]
  local doomed = not redis.call('ZSCORE', KEYS[1], ARGV[i])
  if not doomed then
    local manifest = redis.call('GET', manifest_key)
    doomed = manifest and string.find(key, ':chunk:', 1, true) and not string.find(manifest, key, 1, true)
  end
  if doomed then
    dropped = dropped + redis.call('DEL', key)
  end
end
return dropped
"""


def drop_orphans(client: redis.Redis, keys: JobKeys) -> int:
    """Delete the keys no committed manifest stands for: chunks and manifests of versions never
    committed (a crashed publish) and chunks of a committed number that its manifest does not name
    (a publisher that lost the race for it and died before cleaning up). Each key is re-checked
    inside one script, so a version another publisher commits meanwhile keeps its keys."""
    committed = set(committed_versions(client, keys))
    present = read_manifests(client, keys, sorted(committed), skip_missing=True)
    named = {ref.key for manifest, _ in present for ref in manifest.chunks}
    pattern = re.sub(r"([\[\]*?\\])", r"\\\1", keys.prefix) + "weights:v*"
    candidates: list[tuple[str, int]] = []
    for key in client.scan_iter(match=pattern, count=1000):
        text = key.decode() if isinstance(key, bytes) else key
        found = _VERSION_KEY.search(text)
        if not found:
            continue
        version = int(found.group(1))
        if version not in committed or (":chunk:" in text and text not in named):
            candidates.append((text, version))
    return delete_orphans(client, keys, candidates)


def delete_orphans(client: redis.Redis, keys: JobKeys, candidates: list[tuple[str, int]]) -> int:
    """Delete the (key, version) candidates that are still orphans (see `_DROP_ORPHANS`)."""
    dropped = 0
    for start in range(0, len(candidates), 500):
        batch = candidates[start : start + 500]
        names = [name for key, version in batch for name in (key, keys.weights_manifest(version))]
        dropped += int(
            client.eval(
                _DROP_ORPHANS, 1 + len(names), keys.weights_versions, *names, *[version for _, version in batch]
            )
        )
    return dropped
