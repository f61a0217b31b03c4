"""The LM head's product: equal forms, the fastest one kept per small row count on a CPU (timed by a clock)."""
from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from swarmnet.head_matmul import SPLIT, TUNED_MIN_WEIGHTS, HeadMatmul, SplitProduct
from swarmnet.product_forms import TUNED_ROWS, linear, paired, transposed

HIDDEN = 256
VOCAB = TUNED_MIN_WEIGHTS // HIDDEN  # the smallest head that is timed


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))


def rows(count: int) -> torch.Tensor:
    return torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(count)) * 3


def durations(*seconds: float) -> Callable[[], float]:
    """A clock under which the forms, timed in turn, take these seconds each (F.linear first)."""
    def ticks() -> Iterator[float]:
        now = 0.0
        while True:
            for spent in seconds:
                yield now
                now += spent
                yield now
    return ticks().__next__


def no_clock() -> float:
    raise AssertionError("this product must not be timed")


@pytest.mark.parametrize("count", range(1, TUNED_ROWS + 3))
def test_both_forms_are_the_same_product(weight: torch.Tensor, count: int) -> None:
    x = rows(count)
    want = F.linear(x.double(), weight.double())
    for form in (linear, transposed, *((paired,) if count == 1 else ())):
        got = form(x, weight)
        assert got.shape == (count, VOCAB) and got.is_contiguous()  # as F.linear's: read row by row after
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_faster_form_is_kept_for_its_row_count_and_reused_without_timing(weight: torch.Tensor) -> None:
    matmul = HeadMatmul(weight, clock=durations(0.010, 0.004), cores=1)
    x = rows(3)
    assert torch.equal(matmul(x), transposed(x, weight))
    assert matmul.choices == {3: "transposed"}
    matmul.clock = no_clock  # a row count met before is not timed again
    assert torch.equal(matmul(x), transposed(x, weight))


def test_one_row_keeps_its_paired_product_where_that_is_faster(weight: torch.Tensor) -> None:
    matmul = HeadMatmul(weight, clock=durations(0.010, 0.006), cores=1)  # F.linear, then the paired product, in turn
    x = rows(1)
    assert torch.equal(matmul(x), paired(x, weight))
    assert matmul.choices == {1: "paired"}


def test_f_linear_is_kept_unless_the_other_form_is_clearly_faster(weight: torch.Tensor) -> None:
    matmul = HeadMatmul(weight, clock=durations(0.010, 0.0095), cores=1)  # 5 % faster: within timing noise
    x = rows(2)
    assert torch.equal(matmul(x), linear(x, weight))
    assert matmul.choices == {2: "linear"}
    matmul.clock = durations(0.004, 0.010)
    assert torch.equal(matmul(rows(5)), linear(rows(5), weight)) and matmul.choices[5] == "linear"


def test_each_small_row_count_is_timed_on_its_own(weight: torch.Tensor) -> None:
    matmul = HeadMatmul(weight, clock=durations(0.010, 0.004), cores=1)
    matmul(rows(2))
    matmul.clock = durations(0.004, 0.010)
    matmul(rows(7))
    assert matmul.choices == {2: "transposed", 7: "linear"}


def test_more_rows_than_tuned_or_a_small_head_use_f_linear_untimed(weight: torch.Tensor) -> None:
    big = HeadMatmul(weight, clock=no_clock, cores=1)
    x = rows(TUNED_ROWS + 1)
    assert torch.equal(big(x), F.linear(x, weight)) and big.choices == {}
    small_weight = weight[: VOCAB // 2]
    small = HeadMatmul(small_weight, clock=no_clock)
    assert not small.tuned
    assert torch.equal(small(rows(2)), F.linear(rows(2), small_weight)) and small.choices == {}


def test_a_row_count_timed_by_another_thread_while_this_one_waited_is_not_timed_again(weight: torch.Tensor) -> None:
    matmul = HeadMatmul(weight, clock=durations(0.010, 0.004), cores=1)
    x = rows(4)
    results: list[torch.Tensor] = []
    with matmul._lock:  # another lane's thread is timing 4 rows; this call found no choice and waits for the lock
        waiting = threading.Thread(target=lambda: results.append(matmul._time_forms(x)))
        waiting.start()
        matmul.choices[4] = "transposed"  # what that thread kept
        matmul.clock = no_clock
    waiting.join(timeout=30)
    assert torch.equal(results[0], transposed(x, weight)) and matmul.choices == {4: "transposed"}


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("count", [1, 2, 5, TUNED_ROWS])
def test_the_split_product_is_the_same_product(weight: torch.Tensor, parts: int, count: int) -> None:
    x = rows(count)
    want = F.linear(x.double(), weight.double())
    got = SplitProduct(weight, parts)(x)
    assert got.shape == (count, VOCAB) and got.is_contiguous()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_on_several_cores_the_split_product_is_kept_where_it_is_fastest(weight: torch.Tensor) -> None:
    matmul = HeadMatmul(weight, clock=durations(0.010, 0.009, 0.005), cores=2)  # F.linear, paired, split in turn
    threads: set[str] = set()
    real_slice = matmul.split._slice if matmul.split else None
    assert real_slice is not None

    def watched(x: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        threads.add(threading.current_thread().name)
        return real_slice(x, part)

    matmul.split._slice = watched  # type: ignore[union-attr,method-assign]
    x = rows(1)
    assert torch.allclose(matmul(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert matmul.choices == {1: SPLIT}
    matmul.clock = no_clock
    threads.clear()
    assert torch.allclose(matmul(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert threads and all(name.startswith("head-split") for name in threads)  # the second slice on the pool's thread


def test_one_core_times_no_split_product(weight: torch.Tensor) -> None:
    one = HeadMatmul(weight, clock=durations(0.010, 0.004), cores=1)
    assert one.split is None
    one(rows(2))
    assert one.choices == {2: "transposed"}
    assert HeadMatmul(weight[: VOCAB // 2], cores=4).split is None  # a head too small to time is not split either


@pytest.mark.swarm  # it forks a process
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_a_process_forked_after_a_split_product_computes_its_own(weight: torch.Tensor) -> None:
    # Given a split product that ran (its pool's thread started) before the process forked, as a prefork worker does
    split = SplitProduct(weight, 2)
    x = rows(1)
    want = split(x)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its product must not wait on the parent's thread, which it does not have
        try:
            os.write(write, b"ok" if torch.allclose(split(x), want) else b"no")
        finally:
            os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 30)
        assert ready, "the forked process's split product hung"
        assert os.read(read, 2) == b"ok"
    finally:
        os.close(read)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
