"""The debounced runner: newest request wins, one worker, cancel, wait, synchronous runs."""

from __future__ import annotations

import threading
import time

from memsave_nb.ui.runner import Runner


def test_debounce_runs_only_the_last_request():
    runner = Runner(debounce_s=0.1, leading=False)
    ran = []
    for i in range(5):
        runner.submit(lambda ev, i=i: ran.append(i))
    assert runner.busy
    assert runner.wait(5)
    assert ran == [4] and not runner.busy


def test_leading_edge_starts_at_once_then_coalesces_the_burst():
    runner = Runner(debounce_s=0.2)
    ran, started = [], threading.Event()

    def first(ev):
        started.set()
        ev.wait(5)
        ran.append(("first", ev.is_set()))

    t0 = time.monotonic()
    runner.submit(first)
    assert started.wait(5) and time.monotonic() - t0 < 0.15  # no debounce after a quiet spell
    for i in range(3):
        runner.submit(lambda ev, i=i: ran.append(i))
    assert runner.wait(5)
    assert ran == [("first", True), 2]  # the burst cancelled the first and ran only its last


def test_a_new_request_cancels_the_running_job_then_runs():
    runner = Runner(debounce_s=0)
    started, events, ran = threading.Event(), [], []

    def slow(ev):
        events.append(ev)
        started.set()
        ev.wait(5)
        ran.append("slow" if not ev.is_set() else "slow-cancelled")

    runner.submit(slow)
    assert started.wait(5)
    runner.submit(lambda ev: ran.append("fast"))
    assert runner.wait(5)
    assert ran == ["slow-cancelled", "fast"]


def test_cancel_and_jobs_on_a_worker_thread():
    runner = Runner(debounce_s=0)
    started, threads = threading.Event(), []

    def job(ev):
        threads.append(threading.current_thread())
        started.set()
        ev.wait(5)

    runner.submit(job)
    assert started.wait(5)
    assert runner.running and runner.cancel()
    assert runner.wait(5)
    assert threads[0] is not threading.main_thread()
    assert not runner.cancel()  # nothing left


def test_run_sync_waits_for_the_worker_and_runs_here():
    runner = Runner(debounce_s=0.05)
    runner.submit(lambda ev: time.sleep(0.05))
    where = runner.run_sync(lambda ev: threading.current_thread())
    assert where is threading.main_thread() and not runner.busy


def test_a_job_that_raises_does_not_kill_the_runner():
    runner = Runner(debounce_s=0)
    runner.submit(lambda ev: 1 / 0)
    assert runner.wait(5)
    assert isinstance(runner.last_exception, ZeroDivisionError)
    ok = []
    runner.submit(lambda ev: ok.append(1))
    assert runner.wait(5) and ok == [1]
