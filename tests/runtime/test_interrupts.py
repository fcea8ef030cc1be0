"""Signals on a rank: the first SIGINT/SIGTERM is reported once; the same signal again within a
moment (Ctrl-C reaches a rank from the terminal and from torchrun) changes nothing; a second one
later, or the shutdown limit, forces the exit with 128 + the first signal."""

import signal
import time

import pytest

from gyre.runtime.control import Interrupts


def _interrupts(timeout_s=60.0):
    told, forced = [], []
    it = Interrupts(rank=3, timeout_s=timeout_s, repeat_s=0.2, force=forced.append)
    it.notify = told.append
    return it, told, forced


def test_the_first_signal_is_reported_once_and_a_quick_repeat_is_the_same_interrupt():
    it, told, forced = _interrupts()
    it.handle(signal.SIGTERM)
    it.handle(signal.SIGTERM)
    it.handle(signal.SIGINT)
    assert told == ["SIGTERM"] and forced == []


def test_a_second_signal_later_forces_the_exit():
    it, told, forced = _interrupts()
    it.handle(signal.SIGINT)
    time.sleep(0.3)
    it.handle(signal.SIGINT)
    assert told == ["SIGINT"] and forced == [128 + signal.SIGINT]


def test_the_shutdown_limit_forces_the_exit():
    it, told, forced = _interrupts(timeout_s=0.2)
    it.handle(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while not forced and time.monotonic() < deadline:
        time.sleep(0.02)
    assert forced == [128 + signal.SIGTERM]


def test_before_the_control_plane_exists_a_signal_interrupts_as_python_would():
    it = Interrupts(rank=0, timeout_s=1.0, force=lambda code: None)
    with pytest.raises(KeyboardInterrupt):
        it.handle(signal.SIGINT)
