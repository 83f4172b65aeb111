"""Stop signals (`run/preemption.py`): the flag, the signal's name, a second Ctrl-C exits at once.

A real Ctrl-C mid-run, its checkpoint and the resume are in `test_train_signals.py`."""
from __future__ import annotations

import os
import signal

from gagar_jax.run.preemption import SIGINT_EXIT, Preemption


def test_first_ctrl_c_sets_the_flag_a_second_exits_130_saying_so(capfd):
    exits = []
    # What was there before: Python's default handler, or SIG_IGN where the suite itself runs
    # as a background job (a shell starts those with SIGINT ignored).
    before = signal.getsignal(signal.SIGINT)
    with Preemption(exit_now=exits.append) as stop:
        assert signal.getsignal(signal.SIGINT) == stop.handle
        assert not stop.requested and not stop.agreed(1)
        os.kill(os.getpid(), signal.SIGINT)          # delivered before kill returns
        assert stop.requested and stop.agreed(1) and stop.signal_name == "SIGINT"
        assert exits == []
        assert "Ctrl-C: checkpointing after the current step" in capfd.readouterr().err
        os.kill(os.getpid(), signal.SIGINT)
        assert exits == [SIGINT_EXIT] == [130]
        assert "second Ctrl-C: exiting now without a checkpoint" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGINT) == before                      # restored


def test_sigterm_first_is_named_and_a_later_ctrl_c_exits_at_once():
    exits = []
    with Preemption(exit_now=exits.append) as stop:
        stop.handle(signal.SIGTERM)
        stop.handle(signal.SIGTERM)       # a repeated SIGTERM only keeps the flag
        assert stop.requested and stop.signal_name == "SIGTERM" and exits == []
        stop.handle(signal.SIGINT)        # Ctrl-C after a stop is already under way
        assert exits == [130] and stop.signal_name == "SIGTERM"
