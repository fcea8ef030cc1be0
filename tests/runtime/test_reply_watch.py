"""The controller's watch over commands owed an answer: a rank that says nothing for the timeout
is named, with the command it owes; a rank that keeps reporting is not."""

import pytest

from gyre.runtime.control import ReplyWatch
from gyre.runtime.messages import Command, Joined, Load, Reduce, StepDone, Stop, ToTrain, TrainWork, Transition, WorkDone


def test_a_silent_rank_is_named_with_the_command_it_owes():
    w = ReplyWatch()
    w.expect(0, Reduce, now=0.0)
    w.expect(2, Load, now=1.0)
    w.heard(0, StepDone, now=3.0)
    assert w.silent(now=10.0, timeout=10.0) is None
    assert w.silent(now=11.5, timeout=10.0) == (2, Load, 10.5)
    assert w.owed(2) == [Load] and w.owed(0) == []


def test_answers_settle_the_oldest_debt_of_their_type_and_any_report_is_a_sign_of_life():
    w = ReplyWatch()
    w.expect(1, ToTrain, now=0.0)
    w.expect(1, TrainWork, now=0.0)
    w.expect(1, TrainWork, now=0.0)
    w.heard(1, Joined, now=1.0)
    w.heard(1, WorkDone, now=8.0)
    assert w.owed(1) == [TrainWork]
    w.heard(1, Transition, now=15.0)  # busy but alive
    assert w.silent(now=20.0, timeout=10.0) is None
    assert w.silent(now=26.0, timeout=10.0) == (1, TrainWork, 11.0)


def test_the_longest_silent_rank_is_named_and_a_forgotten_rank_owes_nothing():
    w = ReplyWatch()
    w.expect(1, Stop, now=0.0)
    w.expect(3, Stop, now=5.0)
    assert w.silent(now=30.0, timeout=10.0)[0] == 1
    w.forget(1)
    assert w.silent(now=30.0, timeout=10.0)[0] == 3


def test_a_command_nobody_answers_cannot_be_expected_and_a_wrong_report_settles_nothing():
    w = ReplyWatch()
    with pytest.raises(ValueError, match="Command is not answered"):
        w.expect(0, Command, now=0.0)
    w.expect(0, Reduce, now=0.0)
    w.heard(0, WorkDone, now=1.0)  # alive, but Reduce is answered by StepDone only
    assert w.owed(0) == [Reduce]
