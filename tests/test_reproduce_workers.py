"""goat_jax/reproduce/workers.py: the harness's job processes for ``--jobs J``.

The targets are standard-library functions (a child process imports nothing of goat-jax or JAX
for them), so each test costs a few process starts; the harness's own use, trainers saving on
SIGTERM, is tested in test_reproduce_harness.py.
"""

import operator
import os
import threading
import time

import pytest

from goat_jax.reproduce import workers


def test_each_job_runs_in_a_process_of_its_own_and_its_result_comes_back_by_key():
    pool = workers.JobProcesses(2, os.getpid)
    for key in "abcd":
        pool.submit(key)
    outcomes = list(pool.outcomes())
    assert sorted(o.key for o in outcomes) == list("abcd")
    assert all(o.error is None for o in outcomes)
    pids = {o.result for o in outcomes}
    assert len(pids) == 4 and os.getpid() not in pids  # a fresh process per job, never this one


def test_a_failing_job_comes_back_as_its_error_and_the_others_go_on():
    pool = workers.JobProcesses(2, operator.truediv)
    pool.submit("zero", 1, 0)
    pool.submit("half", 1, 2)
    pool.submit("third", 1, 3)
    outcomes = {o.key: o for o in pool.outcomes()}
    assert isinstance(outcomes["zero"].error, ZeroDivisionError)
    assert outcomes["half"] == ("half", 0.5, None)
    assert outcomes["third"] == ("third", 1 / 3, None)


def test_a_result_that_cannot_be_sent_back_is_an_error_naming_it():
    pool = workers.JobProcesses(1, threading.Lock)  # a lock does not pickle
    pool.submit("lock")
    (outcome,) = list(pool.outcomes())
    assert outcome.result is None
    assert isinstance(outcome.error, RuntimeError) and "could not be sent back" in str(outcome.error)


def test_jobs_may_be_submitted_while_the_outcomes_come():
    pool = workers.JobProcesses(2, operator.add)
    pool.submit("first", 1, 1)
    seen = []
    for outcome in pool.outcomes():
        seen.append(outcome)
        if outcome.key == "first":
            pool.submit("second", outcome.result, 10)
    assert seen == [("first", 2, None), ("second", 12, None)]


def test_stop_sigterms_the_running_jobs_and_starts_no_queued_one():
    """The case that hung the harness under ProcessPoolExecutor: more jobs queued than slots,
    then a stop. The two running jobs end by the SIGTERM (exit code -15: nothing here handles
    it), the three queued ones never start, and the iteration ends at once, not after the sleeps."""
    stop = threading.Event()
    pool = workers.JobProcesses(2, time.sleep, stop=stop)
    for i in range(5):
        pool.submit(i, 120)
    threading.Timer(2.0, stop.set).start()
    t0 = time.time()
    outcomes = list(pool.outcomes())
    assert time.time() - t0 < 60
    assert sorted(o.key for o in outcomes) == [0, 1]
    for outcome in outcomes:
        assert isinstance(outcome.error, workers.WorkerDied)
        assert "code -15" in str(outcome.error)


def test_leaving_the_loop_early_stops_and_reaps_the_running_jobs():
    pool = workers.JobProcesses(2, time.sleep)
    pool.submit("quick", 0)
    pool.submit("slow", 120)
    t0 = time.time()
    with pytest.raises(KeyError):
        for outcome in pool.outcomes():
            raise KeyError(outcome.key)  # the caller fails on the first outcome
    assert time.time() - t0 < 60  # the slow job was sent SIGTERM and reaped, not waited for
    assert pool.stop.is_set()
    assert not [o for o in pool.outcomes()]  # nothing left running or queued


def test_no_slots_is_refused_by_name():
    with pytest.raises(ValueError, match="slots=0"):
        workers.JobProcesses(0, os.getpid)
