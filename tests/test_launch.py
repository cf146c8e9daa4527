"""The self-launcher: results by rank, and the first failing rank's own error."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from meshtrain.data.errors import DataError
from meshtrain.run.launch import RankFailed, launch
from meshtrain.run.stopping import NOTE_DIR


def _rank_and_world(x):
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), x


def _bad_data_on_rank_1():
    if os.environ["RANK"] == "1":
        raise DataError("data/x.bin: token id 300 >= model.vocab_size=258")
    time.sleep(30)  # the launcher stops this rank once rank 1 has failed


def _crash_on_rank_1_then_peer_errors():
    if os.environ["RANK"] == "1":
        raise RuntimeError("the real cause, on rank 1")
    # What the other ranks see afterwards: after rank 1 has failed, however late it started.
    while not Path(os.environ[NOTE_DIR], "rank1.json").exists():
        time.sleep(0.05)
    raise ConnectionError("connection closed by peer")


def test_results_come_back_by_rank_and_the_callers_signal_handlers_stay():
    """torch's elastic agent installs its handlers of SIGTERM, SIGINT, SIGHUP and SIGQUIT
    and leaves them: a Python caller would then get its SignalException for a SIGHUP."""
    sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    before = {s: signal.getsignal(s) for s in sigs}
    assert launch(_rank_and_world, ("x",), 2) == [(0, 2, "x"), (1, 2, "x")]
    assert {s: signal.getsignal(s) for s in sigs} == before


def test_a_rank_with_bad_input_raises_that_error_here():
    with pytest.raises(DataError, match="token id 300"):
        launch(_bad_data_on_rank_1, (), 2)


def test_the_first_failure_is_reported_not_the_peers_reaction():
    with pytest.raises(RankFailed) as e:
        launch(_crash_on_rank_1_then_peer_errors, (), 2)
    assert e.value.report["rank"] == 1 and "the real cause" in str(e.value)
    assert "RuntimeError" in e.value.report["traceback"]
