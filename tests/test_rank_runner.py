"""meshtrain.testing.run_ranks names the rank that caused a failure, not a peer that lost it."""

import os
import signal

import pytest
import torch
import torch.distributed as dist

from meshtrain.testing import run_ranks


def _fail_on_rank_1(how: str) -> int:
    if dist.get_rank() == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError("rank 1's own error")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that is gone
    return 0


def test_the_failing_rank_is_reported_not_the_peer_that_lost_it():
    with pytest.raises(RuntimeError, match="rank 1 failed:(.|\n)*rank 1's own error"):
        run_ranks(_fail_on_rank_1, 2, "raise")


def test_a_rank_killed_without_a_report_is_named_with_its_signal():
    with pytest.raises(RuntimeError, match=r"rank 1 died without a report \(signal SIGKILL"):
        run_ranks(_fail_on_rank_1, 2, "kill")
