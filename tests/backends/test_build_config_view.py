"""The factory's builders take the sections they read, each parameter named as `GyreConfig` names
the section (a `model` is a `ModelConfig`, as `GyreConfig.model` is), so the assembler passes
`cfg.<name>` and a reader sees what a builder depends on; none takes the whole config."""

import inspect
import types
import typing

from gyre.backends import factory
from gyre.config import GyreConfig, TrainConfig
from gyre.loss.config import LossConfig
from gyre.topology import Groups, ParallelConfig

BUILDERS = (factory.check_backends, factory.model_config_of, factory.build_core_actor, factory.build_actor,
            factory.megatron_config_of, factory.build_engine, factory.build_sglang_engine, factory.build_transport,
            factory.build_kv_transport)


def _plain(t):
    """`X | None` -> X."""
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        (t,) = [a for a in typing.get_args(t) if a is not type(None)]
    return t


def test_every_section_parameter_has_the_type_of_the_config_field_it_is_named_after():
    sections = typing.get_type_hints(GyreConfig)
    local = {"LossConfig": LossConfig, "ParallelConfig": ParallelConfig, "Groups": Groups}
    seen = set()
    for fn in BUILDERS:
        hints = typing.get_type_hints(fn, localns=local)
        for name in inspect.signature(fn).parameters:
            assert name not in ("cfg", "config"), f"{fn.__name__} takes the whole config"
            if name in sections:
                assert _plain(hints[name]) is sections[name], (fn.__name__, name, hints[name], sections[name])
                seen.add(name)
    assert seen >= {"model", "backend", "engine", "actor", "loss", "parallel", "transfer", "sglang", "run_dir"}


def test_the_resume_flags_reach_the_builders_as_the_command_line_set_them():
    assert not TrainConfig().resumed().on
    r = TrainConfig(steps=9, resume_from="/ck/step_3", resume_weights_only=True).resumed()
    assert (r.on, r.path, r.weights_only, r.steps) == (True, "/ck/step_3", True, 9)  # resume-from implies resume
    assert TrainConfig(resume=True).resumed().on and TrainConfig(resume=True).resumed().path == ""
