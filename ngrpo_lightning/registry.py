"""Named components, one rule for all of them: explorers, objectives, advantage estimators and
rollout engines are each a :class:`Registry` (a ``dict`` from config name to class or function).

    ENGINES = Registry("engine", key="rollout.engine")

    @ENGINES.register("my_engine")
    class MyEngine(RolloutEngine): ...

    ENGINES.resolve("my_engine")   # -> MyEngine; an unknown name names the key and the allowed names

A name registered twice by different objects is refused (it would silently replace the first);
the same object again (or a re-imported class) is allowed. Pure Python: every layer may import it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

from ngrpo_lightning.checks import check_choice

__all__ = ["Registry", "import_path"]

T = TypeVar("T")


class Registry(dict):
    """``name -> component`` for one ``kind`` of component, selected by the config ``key``."""

    def __init__(self, kind: str, key: str):
        super().__init__()
        self.kind, self.key = kind, key

    def register(self, name: str, **attributes) -> Callable[[T], T]:
        """Decorator: selectable as ``<key>=<name>``; sets ``registered_name = name`` and ``attributes``."""

        def wrap(component: T) -> T:
            old = self.get(name)
            if old is not None and _identity(old) != _identity(component):
                raise ValueError(f"{self.kind} name {name!r} is already registered by {_identity(old)}")
            for attr, value in {"registered_name": name, **attributes}.items():
                setattr(component, attr, value)
            self[name] = component
            return component

        return wrap

    def resolve(self, name: str, key: str | None = None):
        """The component registered as ``name``; ``ValueError`` naming ``key`` (default: the
        registry's) and the allowed names otherwise."""
        return self[check_choice(key or self.key, name, self)]


def _identity(component) -> str:
    return f"{component.__module__}.{component.__qualname__}"


def import_path(path: str, key: str):
    """The object class path ``pkg.mod.Cls`` names (config ``key``), else ``ValueError`` naming key, path, failure."""
    module, _, attr = path.rpartition(".") if isinstance(path, str) else ("", "", "")
    if not module or not attr:
        raise ValueError(f"{key}={path!r} is not a class path: give it as <module>.<name>, e.g. my_pkg.MyClass")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as err:
        raise ValueError(
            f"{key}={path!r} cannot be imported: {err} (the module must be importable: a file in the "
            "current directory, an installed package, or on PYTHONPATH)"
        ) from err
    except AttributeError as err:
        raise ValueError(f"{key}={path!r} cannot be imported: module {module!r} has no {attr!r}") from err
