import os
import sys

import pytest
import torch

# Test modules import shared fixtures from each other (e.g. the equivalence config).
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def one_thread():
    """One intra-op thread: on a small shared CPU box more threads only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
