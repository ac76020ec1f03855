"""The publisher's find pass in torch (the path GPU trainers take), run here on CPU tensors: it must
find exactly what the host pass finds, and a publisher using it must write the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rljob.keys import JobKeys
from rljob.weights import WeightPublisher, WeightReader, store
from rljob.weights import publisher as publisher_module
from rljob.weights.changes import find_changes
from rljob.weights.checksum import bf16_bits
from rljob.weights.device_find import device_baseline, find_changes_torch, mirror_fits

SPECIALS = np.array(
    [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38, -3.4e38, 1.0, -1.0, 1.00390625, 1.001953125],
    dtype=np.float32,
)


def fp32_with_specials(size: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(size) * 0.02).astype(np.float32)
    picked = rng.random(size) < 0.2
    values[picked] = rng.choice(SPECIALS, size=int(picked.sum()))
    return torch.from_numpy(values)


@pytest.mark.parametrize("size", [0, 1, 5, 4096, 10_007])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
@pytest.mark.parametrize("block", [7, 1 << 26])
def test_torch_find_matches_the_host_find_and_advances_its_baseline(size, density, block):
    source = fp32_with_specials(size, seed=size)
    new_bits = bf16_bits(source).copy()  # torch's round to nearest even, as the host path casts
    rng = np.random.default_rng(size + 1)
    old_bits = new_bits.copy()
    picked = rng.random(size) < density
    old_bits[picked] ^= rng.integers(1, 2**16, size=int(picked.sum()), dtype=np.uint32).astype(np.uint16)
    expected = find_changes(old_bits.copy(), new_bits)
    expected_old_copy = old_bits.copy()

    baseline = device_baseline(old_bits, torch.device("cpu"))
    found = find_changes_torch(baseline, source, block=block)
    assert found.positions.dtype == np.int64 and found.old.dtype == found.new.dtype == np.uint16
    assert np.array_equal(found.positions, expected.positions)
    assert np.array_equal(found.old, expected.old) and np.array_equal(found.new, expected.new)
    assert np.array_equal(baseline.numpy().view(np.uint16), new_bits), "the baseline must now hold the new bits"
    assert np.array_equal(old_bits, expected_old_copy), "the host array it was copied from is not touched"


def test_bf16_and_zero_dim_sources():
    source = torch.tensor(0.5, dtype=torch.bfloat16)
    baseline = device_baseline(np.array([0x3F00 ^ 1], dtype=np.uint16), torch.device("cpu"))  # 0.5 is 0x3F00
    found = find_changes_torch(baseline, source)
    assert list(found.positions) == [0] and list(found.new) == [0x3F00] and list(found.old) == [0x3F01]
    assert find_changes_torch(baseline, source).count == 0


def test_mismatches_are_refused():
    baseline = torch.zeros(4, dtype=torch.int16)
    with pytest.raises(ValueError, match="shape mismatch"):
        find_changes_torch(baseline, torch.zeros(5))
    with pytest.raises(ValueError, match="flat int16"):
        find_changes_torch(baseline.view(2, 2), torch.zeros(4))
    with pytest.raises(ValueError, match="flat int16"):
        find_changes_torch(baseline.float(), torch.zeros(4))


def test_mirror_fits_on_cpu_never_on_devices_without_memory_info():
    assert mirror_fits(torch.device("cpu"), 1 << 40)
    assert not mirror_fits(torch.device("meta"), 1)


def test_a_publisher_finding_changes_in_torch_writes_the_same_bytes(redis_client, monkeypatch):
    """find_on="tensor" (the GPU path) and "host" publish byte-identical versions, across a rebase
    and a resume (which replace the baseline, so the device copies must be made again)."""
    calls = {"n": 0}
    real = publisher_module.find_changes_torch

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(publisher_module, "find_changes_torch", counting)
    torch.manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(37 + 50 * i, 19) * 0.02 for i in range(6)}
    weights["norm"] = torch.ones(3)
    payloads = {}
    for find_on in ("host", "tensor"):
        keys = JobKeys("test", f"find-{find_on}")
        pub = WeightPublisher(redis_client, keys, rebase_interval=3, rebase_fraction=4.0, chunk_bytes=4096,
                              find_on=find_on)  # fmt: skip
        reader = WeightReader(redis_client, keys)
        current = {n: t.clone() for n, t in weights.items()}
        gen = torch.Generator().manual_seed(1)
        shadow: dict[str, torch.Tensor] = {}
        calls["n"] = 0
        written = []
        for step in range(8):
            if step == 5:
                pub.resume()  # as after a failed publish: the baseline is read back from Redis
            version = pub.publish(current).version
            manifest = store.read_manifests(redis_client, keys, [version])[0][0]
            written.append((manifest.kind, manifest.change_sum, store.read_payload(redis_client, manifest)))
            reader.sync(shadow)
            for n, t in current.items():
                assert torch.equal(shadow[n].view(torch.int16), t.to(torch.bfloat16).view(torch.int16)), (find_on, n)
            for t in current.values():
                t.add_(torch.randn(t.shape, generator=gen) * 1e-4)
        assert (calls["n"] > 0) == (find_on == "tensor")
        payloads[find_on] = written
        pub.close()
        reader.close()
    assert [kind for kind, _, _ in payloads["host"]] == ["full", "delta", "delta"] * 2 + ["full", "delta"]
    assert payloads["host"] == payloads["tensor"]


def test_find_on_is_validated(redis_client):
    with pytest.raises(ValueError, match="find_on"):
        WeightPublisher(redis_client, JobKeys("test", "x"), rebase_interval=2, rebase_fraction=1.0, chunk_bytes=64,
                        find_on="gpu")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_masters_are_compared_on_the_device(redis_client):
    torch.manual_seed(0)
    master = {f"w{i}": (torch.randn(1000 + i, 33) * 0.02).cuda() for i in range(3)}
    keys = JobKeys("test", "cuda-find")
    pub = WeightPublisher(redis_client, keys, rebase_interval=100, rebase_fraction=4.0, chunk_bytes=1 << 16)
    reader = WeightReader(redis_client, keys)
    shadow: dict[str, torch.Tensor] = {}
    for _ in range(4):
        pub.publish(master)
        reader.sync(shadow)
        for n, t in master.items():
            assert torch.equal(shadow[n].view(torch.int16), t.to(torch.bfloat16).cpu().view(torch.int16)), n
        for t in master.values():
            t.add_(torch.randn_like(t) * 1e-4)
    assert pub._mirrors and all(m is not None and m.is_cuda for m in pub._mirrors.values())
