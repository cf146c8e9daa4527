import os
import sys

import pytest
import torch

# Test modules import their shared helpers from the package tests/support/ as `support`
# (never from each other: tests/test_layering.py). The ranks that meshtrain.testing forks
# or spawns inherit this sys.path, so they import it too.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def one_thread():
    """One intra-op thread: on a small shared CPU box more threads only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
