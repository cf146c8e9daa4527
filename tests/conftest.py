import contextlib
import fcntl
import os
import sys
import tempfile

import pytest
import torch

# Test modules import their shared helpers from the package tests/support/ as `support`
# (never from each other: tests/test_layering.py). The ranks that meshtrain.testing forks
# or spawns inherit this sys.path, so they import it too.
sys.path.insert(0, os.path.dirname(__file__))

# Under pytest-xdist (the README runs `-n 2` on 2 cores) each worker computes on one
# thread, and so does every process it starts: intra-op threads of two workers spinning
# against each other make small steps many times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@contextlib.contextmanager
def _turn(run: str, alone: bool):
    """A readers-writer lock between the xdist workers of one run (two flocks): a test
    shares the room, an `alone` test has it to itself, and once one waits for it no new
    test enters (the gate), so it never starves."""
    base = os.path.join(tempfile.gettempdir(), f"meshtrain-tests-{run}")
    with open(base + ".gate", "a") as gate, open(base + ".room", "a") as room:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown of each test inside its turn (module fixtures included)."""
    run = getattr(item.config, "workerinput", {}).get("testrunuid")
    if run is None:  # one process: nothing runs beside a test
        yield
        return
    with _turn(run, item.get_closest_marker("alone") is not None):
        yield


@pytest.fixture
def one_thread():
    """One intra-op thread: on a small shared CPU box more threads only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
