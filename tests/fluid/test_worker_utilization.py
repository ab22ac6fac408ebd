"""A worker's utilization counts the time its threads wanted a core, not just got one."""

import multiprocessing
import os
import time

import pytest

from hydro_fluid.executors.worker import runnable_seconds


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _hog() -> None:
    while True:
        pass


def test_runnable_seconds_counts_busy_time_and_not_sleep():
    wall0, run0 = time.perf_counter(), runnable_seconds()
    _spin(0.3)
    busy = (runnable_seconds() - run0) / (time.perf_counter() - wall0)
    wall0, run0 = time.perf_counter(), runnable_seconds()
    time.sleep(0.3)
    idle = (runnable_seconds() - run0) / (time.perf_counter() - wall0)
    assert busy >= 0.9
    assert idle <= 0.5


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_a_compute_bound_worker_sharing_its_core_still_reads_busy():
    # A real second process spins on the same core: CPU time then reads about half of the
    # wall time, though this process wanted the core all along.
    before = os.sched_getaffinity(0)
    core = min(before)
    hog = multiprocessing.get_context("fork").Process(target=_hog, daemon=True)
    os.sched_setaffinity(0, {core})
    try:
        hog.start()
        time.sleep(0.1)
        wall0, cpu0, run0 = time.perf_counter(), time.process_time(), runnable_seconds()
        _spin(0.6)
        wall = time.perf_counter() - wall0
        cpu = (time.process_time() - cpu0) / wall
        runnable = (runnable_seconds() - run0) / wall
    finally:
        hog.kill()
        hog.join()
        os.sched_setaffinity(0, before)
    assert cpu <= 0.75
    assert runnable >= 0.9
