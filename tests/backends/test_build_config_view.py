"""The factory's `cfg` is typed by read-only views (gyre/backends/config.py `BuildConfig`), so the
backends never import `gyre.config` (above them). The views must stay true to the real config: every
field they name exists on `GyreConfig`'s sections, with the type they promise."""

import typing

from gyre.backends import config as bc
from gyre.config import GyreConfig
from gyre.loss.config import LossConfig


def _props(view):
    """name -> the type each property of `view` promises."""
    return {name: typing.get_type_hints(v.fget, globalns=vars(bc), localns={"LossConfig": LossConfig})["return"]
            for name, v in vars(view).items() if isinstance(v, property)}


def test_every_field_the_factory_reads_is_on_the_job_config_with_its_type():
    cfg = GyreConfig()
    views = {bc.BuildConfig: cfg, bc.TrainView: cfg.train, bc.ParallelView: cfg.parallel, bc.KvMigrationView: cfg.proxy}
    checked = 0
    for view, obj in views.items():
        for name, typ in _props(view).items():
            assert hasattr(obj, name), f"{view.__name__}.{name} is not on {type(obj).__name__}"
            value = getattr(obj, name)
            if typ in views:  # a nested view: checked as its own entry above
                assert views[typ] is value, (view.__name__, name)
            elif isinstance(typ, type):
                assert isinstance(value, typ), (view.__name__, name, type(value), typ)
            checked += 1
    assert checked >= 20  # the views are not empty


def test_the_factory_signatures_take_the_view_not_any():
    from gyre.backends import factory
    for fn in (factory.check_backends, factory.build_core_actor, factory.build_actor, factory.build_engine,
               factory.build_transport, factory.build_kv_transport):
        assert fn.__annotations__["cfg"] in ("BuildConfig", bc.BuildConfig), fn.__name__
