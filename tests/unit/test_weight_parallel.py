"""The per-tensor thread pool, and that threads change nothing a version holds."""

from __future__ import annotations

import threading

import pytest
import torch

from rljob.weights.parallel import TensorPool, balanced_batches, cgroup_cpu_limit, default_threads

OPENMP = "parallel backend: OpenMP" in torch.__config__.parallel_info()


def test_pool_maps_in_order_on_several_threads():
    pool = TensorPool(3)
    seen: set[str] = set()

    def work(x: int) -> int:
        seen.add(threading.current_thread().name)
        return x * x

    try:
        assert pool.map(work, range(200)) == [x * x for x in range(200)]
    finally:
        pool.close()
    assert any(name.startswith("weights") for name in seen)


@pytest.mark.skipif(not OPENMP, reason="torch here is not built with OpenMP (CI's is)")
def test_pool_threads_run_torch_on_one_thread_and_leave_the_process_default_alone():
    """Each pool thread is one core's worth: torch's ops in it must not start a team of every
    core. Nothing else in the process may change: not the caller, not threads started later."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    pool = TensorPool(2)
    try:
        inside = pool.map(lambda _: torch.get_num_threads(), range(8))
        later: list[int] = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert inside == [1] * 8
        assert torch.get_num_threads() == 2 and later == [2]
        # The work itself is unchanged: a cast in a pool thread equals the caller's.
        x = torch.randn(1 << 17)
        expected = x.to(torch.bfloat16)
        assert pool.map(lambda _: torch.equal(x.to(torch.bfloat16), expected), range(2)) == [True, True]
    finally:
        pool.close()
        torch.set_num_threads(before)


def test_items_run_in_a_few_contiguous_batches_of_about_equal_cost():
    items = list(range(272))
    batches = balanced_batches(items, lambda x: 1000 if x == 0 else 1 + x % 7, 8)
    assert [x for batch in batches for x in batch] == items, "contiguous and in order"
    assert len(batches) <= 8 and batches[0] == [0], "the one heavy item is a batch of its own"
    costs = [sum(1 + x % 7 for x in batch) for batch in batches[1:]]
    assert max(costs) <= 2.5 * min(costs)
    assert balanced_batches([1, 2, 3], None, 8) == [[1], [2], [3]]
    # One pool task per batch, not per item.
    pool = TensorPool(2)
    try:
        assert pool.map(lambda x: x + 1, items, cost=lambda x: 1) == [x + 1 for x in items]  # starts the pool
        executor = pool._pool
        submitted: list[int] = []
        real = executor.map
        executor.map = lambda fn, batches: (submitted.append(len(batches)), real(fn, batches))[1]
        assert pool.map(lambda x: -x, items) == [-x for x in items]
        assert submitted == [8]
    finally:
        pool.close()


def test_pool_reraises_the_first_error_and_runs_inline_with_one_thread():
    def boom(x: int) -> int:
        if x == 3:
            raise ValueError("bad tensor 3")
        return x

    with pytest.raises(ValueError, match="bad tensor 3"):
        TensorPool(2).map(boom, range(10))
    names = TensorPool(1).map(lambda _: threading.current_thread().name, range(3))
    assert set(names) == {threading.current_thread().name}
    with pytest.raises(ValueError):
        TensorPool(0)


@pytest.mark.parametrize("threads", [1, 2])
def test_submit_runs_beside_the_caller_and_delivers_errors_by_result(threads):
    pool = TensorPool(threads)
    try:
        release = threading.Event()
        if threads > 1:  # on a pool thread: the caller goes on while it waits
            pending = pool.submit(lambda: (release.wait(5), threading.current_thread().name)[1])
            assert not pending.done()
            release.set()
            assert pending.result(5).startswith("weights")
        else:  # inline: already finished
            assert pool.submit(lambda: 7).result(0) == 7
        failed = pool.submit(lambda: 1 // 0)
        with pytest.raises(ZeroDivisionError):
            failed.result(5)
    finally:
        pool.close()


def test_cgroup_quota_caps_the_default(tmp_path, monkeypatch):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")
    assert cgroup_cpu_limit(cpu_max) == 1.5
    cpu_max.write_text("max 100000\n")
    assert cgroup_cpu_limit(cpu_max) is None
    assert cgroup_cpu_limit(tmp_path / "absent") is None
    monkeypatch.setattr("rljob.weights.parallel.cgroup_cpu_limit", lambda: 1.0)
    assert default_threads() == 1


def test_threads_do_not_change_the_published_bytes(redis_client):
    """The same versions published with 1 and 4 threads are byte-identical (manifest order too)."""
    from rljob.keys import JobKeys
    from rljob.weights import WeightPublisher, WeightReader, store

    torch.manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(37 + 50 * i, 19) for i in range(12)}
    weights["norm"] = torch.randn(3)
    payloads = {}
    for threads in (1, 4):
        keys = JobKeys("test", f"threads{threads}")
        publisher = WeightPublisher(
            redis_client, keys, rebase_interval=100, rebase_fraction=4.0, chunk_bytes=4096, threads=threads
        )
        current = {n: t.clone() for n, t in weights.items()}
        gen = torch.Generator().manual_seed(1)
        shadow: dict[str, torch.Tensor] = {}
        reader = WeightReader(redis_client, keys, threads=threads)
        for _ in range(4):
            publisher.publish(current)
            reader.sync(shadow)
            for n, t in current.items():
                assert torch.equal(shadow[n].view(torch.int16), t.to(torch.bfloat16).view(torch.int16)), n
            for t in current.values():
                t.add_(torch.randn(t.shape, generator=gen) * 0.02)
        manifests = store.read_manifests(redis_client, keys, store.committed_versions(redis_client, keys))
        payloads[threads] = [
            (
                [e.model_dump(exclude={"checksum"}) | {"c": e.checksum} for e in m.tensors],
                store.read_payload(redis_client, m),
            )
            for m, _ in manifests
        ]
        publisher.close()
        reader.close()
    assert payloads[1] == payloads[4]


def test_gc_paused_defers_collection_and_restores_the_previous_state():
    import gc

    from rljob.weights.parallel import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()
