"""instrumented_alloc.sinks.NonBlockingSink's extensions for a producer that owns its drop policy (the flight
recorder's writer runs behind them): put, lazy wake-ups, idle work, flush callbacks, a deferred start. The
adapter's own contract (refusals counted by the bus, failures, a close that cannot finish) is exercised with a
real allocator in tests/test_fault_matrix.py."""

from __future__ import annotations

import logging
import threading
import time

from instrumented_alloc.sinks import NonBlockingSink


def wait_for(cond, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_put_queues_the_item_itself_and_a_full_queue_refuses_without_a_log(caplog):
    caplog.set_level(logging.WARNING)
    gate, got = threading.Event(), []

    def sink(item):
        gate.wait(5)
        got.append(item)

    nb = NonBlockingSink(sink, queue_size=2, name="t")
    first, second, third = [1], [2], [3]
    assert nb.put(first)
    assert wait_for(lambda: nb.pending == 0)  # the worker holds the first item
    assert nb.put(second) and nb.put(third)
    assert nb.put([4]) is False  # full: the caller counts the refusal
    assert not caplog.records
    gate.set()
    assert nb.flush(5)
    assert got == [first, second, third] and got[0] is first
    assert nb.close()
    assert nb.put([5]) is False


def test_below_wake_at_the_worker_looks_every_poll_and_urgent_wakes_it_at_once():
    got = []
    nb = NonBlockingSink(got.append, queue_size=100, name="t", wake_at=50, poll=0.05)
    nb.put("a")
    assert wait_for(lambda: got == ["a"], 2.0)  # found at the next look
    nb2 = NonBlockingSink(got.append, queue_size=100, name="t2", wake_at=50, poll=30.0)
    assert wait_for(lambda: nb2._thread.is_alive())
    time.sleep(0.05)  # the worker is asleep for its 30 s poll
    t0 = time.monotonic()
    nb2.put("b", urgent=True)
    assert wait_for(lambda: "b" in got, 2.0) and time.monotonic() - t0 < 2.0
    for i in range(50):  # the wake_at-th item wakes it too
        nb2.put(i)
    assert wait_for(lambda: 49 in got, 2.0)
    assert nb.close() and nb2.close()


def test_idle_runs_when_the_queue_ran_empty_and_again_after_the_seconds_it_asks():
    calls = []

    def idle():
        calls.append(time.monotonic())
        return 0.05 if len(calls) == 1 else None  # once more after 50 ms, then not until more work

    nb = NonBlockingSink(lambda item: None, name="t", idle=idle)
    time.sleep(0.1)
    assert calls == []  # no work yet: nothing to do when idle
    nb.put("a")
    assert wait_for(lambda: len(calls) == 2)
    assert calls[1] - calls[0] >= 0.04
    time.sleep(0.15)
    assert len(calls) == 2
    nb.put("b")
    assert wait_for(lambda: len(calls) == 3)
    assert nb.close()


def test_flush_runs_on_flush_on_the_worker_after_every_earlier_item_and_returns_its_answer():
    seen, answer = [], [True]

    def on_flush():
        seen.append(("flush", threading.current_thread().name))
        return answer[0]

    nb = NonBlockingSink(lambda item: seen.append(item), name="t", on_flush=on_flush, wake_at=10, poll=10.0)
    nb.put(1)
    nb.put(2)
    assert nb.flush(5) is True
    assert seen == [1, 2, ("flush", "nonblocking-sink:t")]
    answer[0] = False
    assert nb.flush(5) is False
    assert nb.close()


def test_a_deferred_start_holds_the_items_and_a_close_before_it_discards_them_by_weight():
    got = []
    nb = NonBlockingSink(got.append, name="t", start=False)
    nb.put("a")
    time.sleep(0.05)
    assert got == [] and nb.pending == 1
    nb.start()
    assert nb.flush(5) and got == ["a"]
    assert nb.close()

    nb2 = NonBlockingSink(got.append, name="t2", start=False, weight=lambda item: 10)
    nb2.put("b")
    nb2.put("c")
    assert nb2.close(0.1) is False
    assert nb2.discarded_events == 20 and got == ["a"]
