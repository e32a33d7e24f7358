"""Configurable components: each component class owns one config dataclass, and the config builds it.

This is torchtitan's ``Configurable`` pattern in Hydra's clothes. A component (a model, a data
module, a schedule, the checkpointer …) takes its config object as its first argument plus the
runtime objects only the builder has (the data's features, the device, the step count)::

    class DeepFM(nn.Module):
        def __init__(self, config: DeepFMConfig, *, features: FeatureSpec, dense_device: torch.device) -> None: …

and the config dataclass, which declares every parameter once with its default, docstring and
``__post_init__`` validation, names the class in ``_target_`` and builds it::

    model = run.model.build(features=data.features, dense_device=device)

``_target_`` stays a plain dotted path in YAML, so a user plugs in a class from outside the package
(``model._target_: mypkg.TinyModel``) with its own config dataclass: :func:`typed` finds that schema
from the class's ``config`` annotation, so the user's keys are validated exactly like ours.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from hydra.utils import get_class
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recsys_runner.errors import ConfigError, UserError

C = TypeVar("C")


@dataclass(kw_only=True)
class Configurable:
    """Base of every component config: ``_target_`` names the class the config builds."""

    _target_: str = MISSING
    """Dotted path of the component class; its constructor takes this config first (``Cls(config, **runtime)``)."""

    def component_class(self) -> type:
        """The class ``_target_`` names, or :class:`ConfigError` saying what could not be imported."""
        return locate_class(self._target_)

    # Each base config (``ModelConfig``, ``DataConfig``, ``SchedulerConfig`` …) defines ``build`` with the
    # runtime arguments and the return type of its kind of component, as ``self.component_class()(self, …)``;
    # there is no untyped ``build(**runtime)`` here for them to narrow.


def locate_class(target: str) -> type:
    """Import the class a ``_target_`` names; :class:`ConfigError` (with the fix) when it cannot."""
    try:
        return get_class(target)
    except Exception as e:  # ImportError, AttributeError or ValueError, wrapped differently by Hydra versions
        raise ConfigError(
            f"_target_: {target!r} cannot be imported ({str(e).splitlines()[0]}). Fix: a dotted path to a class on "
            f"the Python path, e.g. recsys_runner.models.deepfm.DeepFM (for your own class, its module must be importable)"
        ) from None


def config_class(component: type) -> type | None:
    """The config dataclass ``component`` declares: the annotation of its constructor's ``config`` parameter."""
    try:
        parameter = inspect.signature(component, eval_str=True).parameters.get("config")
    except (NameError, TypeError, ValueError):  # an annotation that does not resolve, or no signature: undeclared
        return None
    hint = parameter.annotation if parameter is not None else None
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def typed(node: DictConfig, base: type, where: str) -> DictConfig:
    """``node`` typed by its component's config dataclass, which must subclass ``base``.

    A node composed from one of our YAML files already has its schema (``/schema/<group>/<name>``).
    A node written by a user for their own ``_target_`` is a plain mapping: its schema is the
    ``config`` annotation of the class it names (:func:`config_class`), merged under it so that its
    defaults fill in, its types convert and an unknown key fails like one of ours. Interpolations
    (``${optim.lr}``) are kept: the result goes back into the tree where ``node`` was.

    Raises:
        ConfigError: no ``_target_``, a class that cannot be imported, declares no config
            dataclass, or one that does not subclass ``base``; or a value its schema rejects.
    """
    current = OmegaConf.get_type(node)
    if current is not None and dataclasses.is_dataclass(current):
        if not issubclass(current, base):
            raise ConfigError(f"{where} is a {current.__name__}, which is not a {base.__name__}")
        return node
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    if not isinstance(target, str):
        raise ConfigError(f"{where} has no _target_. Fix: choose an option ({where.split('.')[0]}=<name>) or set {where}._target_ "
                          f"to your own class, whose constructor takes a {base.__name__} subclass as `config`")
    schema = config_class(locate_class(target))
    if schema is None or not issubclass(schema, base):
        raise ConfigError(
            f"{where}._target_={target} does not declare its config: its constructor must take `config: <a dataclass "
            f"subclassing {base.__module__}.{base.__name__}>` first (docs/architecture.md, 'Adding a model')"
        )
    try:
        result = OmegaConf.structured(schema)
        OmegaConf.set_struct(result, False)  # keep an unknown key, for check_known_keys to name with the closest valid one
        result = OmegaConf.merge(result, node)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: {str(e).splitlines()[0]} (schema {schema.__module__}.{schema.__name__})") from None
    assert isinstance(result, DictConfig)
    return result


def make(cls: type[C], fields: Mapping[str, Any] | None = None, /, **kw: Any) -> C:
    """``cls`` from plain values, converted as in a YAML file (nested dicts become nested dataclasses).

    For building a config in Python (tests, notebooks, the data converter) without writing each
    nested dataclass by hand: ``make(CsvDataConfig, path="a.csv", sparse=[{"name": "item"}])``.
    A ``__post_init__`` error stays itself; a type error becomes :class:`ConfigError`.
    """
    try:
        values: dict[str, Any] = {**(fields or {}), **kw}
        node = OmegaConf.merge(OmegaConf.structured(cls), values)
        obj = OmegaConf.to_object(node)
    except UserError:
        raise
    except OmegaConfBaseException as e:
        if isinstance(e.__cause__, UserError):
            raise e.__cause__ from None
        raise ConfigError(f"{cls.__name__}: {str(e).splitlines()[0]}") from None
    assert isinstance(obj, cls)
    return obj
