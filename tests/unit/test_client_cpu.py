"""The load generator's CPU accounting: /proc figures for a process tree, and a window's share
per request."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from client.bench import summarize
from client.cpu import CpuWindow, cpu_used, descendants, process_cpu_seconds, tree_cpu_by_pid

BURN = ("import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"
        "print('done', flush=True)\ntime.sleep(30)")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_childs_cpu_counts_in_its_parents_tree() -> None:
    child = subprocess.Popen([sys.executable, "-c", BURN], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "done"
        assert child.pid in descendants(os.getpid())
        child_cpu = process_cpu_seconds(child.pid)
        assert child_cpu is not None and child_cpu >= 0.25
        itself, below = tree_cpu_by_pid([os.getpid()])
        assert list(itself) == [os.getpid()] and child.pid in below
        assert itself[os.getpid()] == pytest.approx(process_cpu_seconds(os.getpid()), abs=0.05)
        assert below[child.pid] >= 0.25
    finally:
        child.kill()
        child.wait()
    assert process_cpu_seconds(child.pid) is None  # gone: no figure, and nothing raised


def test_a_window_measures_own_watched_and_childrens_cpu() -> None:
    child = subprocess.Popen([sys.executable, "-c", BURN], stdout=subprocess.PIPE, text=True)
    try:
        window = CpuWindow([os.getpid()])  # watching this test process: the child is its child
        window.begin()
        end = time.process_time() + 0.1
        while time.process_time() < end:
            pass
        assert child.stdout is not None and child.stdout.readline().strip() == "done"
        window.end()
    finally:
        child.kill()
        child.wait()
    assert window.own_s is not None and 0.1 <= window.own_s < 1.0
    assert window.watched_s is not None and 0.05 <= window.watched_s < 1.0  # /proc counts in 10 ms ticks
    assert window.children_s is not None and window.children_s >= 0.2  # the child's burn, less start-up


def test_cpu_used_is_unknown_once_a_process_of_the_first_sample_has_ended() -> None:
    assert cpu_used({1: 1.0, 2: 2.0}, {1: 1.5, 2: 2.25, 3: 0.25}) == pytest.approx(1.0)  # 3 is new
    assert cpu_used({1: 1.0, 2: 2.0}, {1: 1.5}) is None
    assert cpu_used({}, {}) == 0.0


def test_a_window_over_a_process_that_ends_within_it_reports_no_figure() -> None:
    child = subprocess.Popen([sys.executable, "-c", BURN], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "done"
        window = CpuWindow([child.pid])
        window.begin()
    finally:
        child.kill()
        child.wait()
    window.end()
    assert window.own_s is not None and window.own_s >= 0.0
    assert window.watched_s is None  # was 0 - 0.3 s before: a negative CPU per request


def test_cpu_is_shared_out_over_the_windows_calls() -> None:
    window = CpuWindow()
    window.own_s, window.watched_s = 0.004, None
    result = summarize("closed", 4, 0.0, 1, 1.0, [(0.001, "OK", None), (0.002, "OK", None), (0.003, "OK", None),
                                                   (0.004, "UNAVAILABLE", None)], window)
    assert result.client_cpu_us == pytest.approx(1000.0)
    assert result.server_cpu_us is None and result.server_children_cpu_us is None
    assert summarize("closed", 1, 0.0, 1, 1.0, []).client_cpu_us is None


def test_server_time_and_answers_within_a_bound() -> None:
    """The server's own time is summarized from the OK answers that told it; --within-ms counts OK
    answers within the bound by either clock (a refused call never counts, however fast)."""
    samples = [(0.004, "OK", 0.001), (0.012, "OK", 0.009), (0.030, "OK", 0.011), (0.002, "RESOURCE_EXHAUSTED", None),
               (0.005, "OK", None)]
    result = summarize("open", 0, 5.0, 1, 2.0, samples, within_ms=10.0)
    assert result.server_p50_ms == pytest.approx(9.0)
    assert result.server_p99_ms == pytest.approx(11.0)
    assert result.within_per_s == pytest.approx(1.0)  # 4 and 5 ms, over 2 s
    assert result.server_within_per_s == pytest.approx(1.0)  # 1 and 9 ms
    assert summarize("open", 0, 5.0, 1, 2.0, samples).within_per_s is None
