"""The controller ⇄ worker protocol (gyre/runtime/messages.py): every command has exactly one
worker handler, every report exactly one controller handler, messages survive the control
plane's pickling, and a message nobody handles fails loudly."""

import dataclasses
import inspect
import pickle
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from gyre.runtime.control import CONTROLLER, ControlPlane
from gyre.runtime import messages
from gyre.runtime.controller import Controller
from gyre.runtime.messages import Command, Report, UnknownMessage
from gyre.runtime.worker import CellWorker
from gyre.scheduler import Work


def _defined(base: type) -> set[type]:
    """The concrete message classes messages.py defines under `base` (found by introspection, so
    a new message without a handler fails the tests below)."""
    return {obj for _, obj in inspect.getmembers(messages, inspect.isclass)
            if issubclass(obj, base) and obj is not base and obj.__module__ == messages.__name__}


def test_every_message_is_a_frozen_dataclass_listed_once():
    commands, reports = _defined(Command), _defined(Report)
    assert commands and reports and not commands & reports
    assert set(messages.COMMANDS) == commands and len(messages.COMMANDS) == len(commands)
    assert set(messages.REPORTS) == reports and len(messages.REPORTS) == len(reports)
    for cls in commands | reports:
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls


@pytest.mark.parametrize("owner, base", [(CellWorker, Command), (Controller, Report)])
def test_every_message_type_has_exactly_one_handler(owner, base):
    table = owner.HANDLERS
    assert set(table) == _defined(base)  # a dict: at most one handler per type
    for cls, handler in table.items():
        assert getattr(owner, handler.__name__) is handler, f"{cls.__name__}: {handler.__name__} is not {owner.__name__}'s"
        assert handler.__name__.startswith("_on_")
        # The handler's signature names the message type, so a grep for it finds the handler.
        assert inspect.signature(handler).parameters["msg"].annotation == cls.__name__, handler.__name__
    assert len({h.__name__ for h in table.values()}) == len(table)


def test_every_scheduler_decision_has_exactly_one_controller_handler():
    from typing import get_args

    from gyre.scheduler.events import Decision

    assert set(Controller.DECISIONS) == set(get_args(Decision))
    for cls, handler in Controller.DECISIONS.items():
        assert getattr(Controller, handler.__name__) is handler
        assert inspect.signature(handler).parameters["d"].annotation == cls.__name__, handler.__name__
    with pytest.raises(UnknownMessage, match="no handler for Work"):
        Controller.__new__(Controller)._apply([Work(0, 0, 0)])  # a work grant is not a decision


def _samples() -> list:
    m = messages
    me = dict(cell=1, rank=3)
    return [
        m.ToTrain(), m.TrainWork(step=2, group=5, item=1, key="ms/2/5/1/3", version=2),
        m.Reduce(step=2, k=2, final=False, stay=True, grad_scale=8 / 7),
        m.Reduce(step=3, k=1, final=True, grad_scale=None),
        m.ToRollout(version=4), m.Load(version=4), m.Stop(), m.Stop(failed=True),
        m.Transition(**me, src="rollout", dst="draining", t=12.5), m.Joined(**me, version=3), m.RequestWork(**me),
        m.WorkDone(**me, step=2, group=5, item=1, metrics={"loss": 0.25, "compute_s": 0.1}),
        m.StepDone(cell=0, rank=0, step=2, stats={"grad_norm": 1.5}), m.RolledBack(**me, version=4),
        m.Loaded(cell=None, rank=6, version=4),
        m.Stopped(**me),
        m.Failed(**me, command="Reduce", error="RuntimeError: boom"),
        m.Interrupted(**me, signal="SIGTERM"),
    ]


def test_every_command_names_the_report_that_answers_it_as_a_type():
    replies = {cls: cls.reply for cls in messages.COMMANDS}
    assert replies == {messages.ToTrain: messages.Joined, messages.TrainWork: messages.WorkDone,
                       messages.Reduce: messages.StepDone, messages.ToRollout: messages.RolledBack,
                       messages.Load: messages.Loaded, messages.Stop: messages.Stopped}
    assert all(r in messages.REPORTS for r in replies.values())
    assert "reply" not in {f.name for cls in messages.COMMANDS for f in dataclasses.fields(cls)}  # not sent


def test_samples_cover_every_message_type():
    assert {type(s) for s in _samples()} == _defined(Command) | _defined(Report)


@pytest.mark.parametrize("msg", _samples(), ids=lambda m: type(m).__name__)
def test_messages_round_trip_through_pickle_and_the_control_plane(msg):
    assert pickle.loads(pickle.dumps(msg)) == msg
    store = dist.HashStore()
    ControlPlane(store, 0).send(CONTROLLER, msg)
    got = ControlPlane(store, CONTROLLER).try_recv()
    assert got == msg and type(got) is type(msg)


def test_messages_are_immutable_and_keyword_only():
    msg = messages.Load(version=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.version = 2
    with pytest.raises(TypeError):
        messages.Load(1)
    assert messages.Reduce(step=0, k=1, final=True, grad_scale=1.0).stay is False
    assert messages.Stop().failed is False


def test_the_worker_rejects_an_unknown_command():
    worker = CellWorker(SimpleNamespace(cell=0, rank=4, position=0), None, None, None, None, make_actor=None)
    with pytest.raises(UnknownMessage, match=r"rank 4's worker: no handler for dict .*Reduce"):
        worker.handle({"cmd": "reduce", "step": 0})  # the old dict protocol is gone
    with pytest.raises(UnknownMessage, match="no handler for Loaded"):
        worker.handle(messages.Loaded(cell=0, rank=4, version=1))  # a report is not a command


def test_the_controller_rejects_an_unknown_report():
    controller = Controller.__new__(Controller)  # dispatch needs no run state
    with pytest.raises(UnknownMessage, match="controller: no handler for Stop"):
        controller._on_message(messages.Stop())
    with pytest.raises(UnknownMessage, match="no handler for dict"):
        controller._on_message({"kind": "stopped", "rank": 0})
