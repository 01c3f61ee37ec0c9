"""What a run's explorer and objective ran with, recorded so that the run can be run again.

The config holds only what was given, not the defaults a class of your own filled in, so the settings are read back from
the built objects (:func:`settings`) and logged as MLflow params and as ``components.json``. A class defined outside
this package has its source logged too (``code/<module>.py``), its SHA-256 as the tag ``ngrpo.code.<module>``."""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

PACKAGE = "ngrpo_lightning"
SIMPLE = (bool, int, float, str, type(None))


def settings(component) -> dict:
    """``__init__`` arguments ``component`` keeps as same-named attributes: numbers, text, bools, None, lists/tuples."""
    try:
        names = [
            name
            for name, p in inspect.signature(type(component).__init__).parameters.items()
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return {}
    out = {}
    for name in names:
        value = getattr(component, name, inspect.Parameter.empty)
        if isinstance(value, SIMPLE):
            out[name] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, SIMPLE) for v in value):
            out[name] = list(value)
    return out


def is_user_class(component) -> bool:
    """Whether ``component``'s class is defined outside this package (a user's own)."""
    module = type(component).__module__
    return module != PACKAGE and not module.startswith(PACKAGE + ".")


def describe(components: dict) -> dict:
    """``{"explorer": {"class": "pkg.Cls", "settings": {...}}, ...}`` of named components."""
    return {
        role: {"class": f"{type(c).__module__}.{type(c).__qualname__}", "settings": settings(c)}
        for role, c in components.items()
    }


def source_files(components: dict) -> dict[str, Path]:
    """``{module name: its source file}`` of the components whose classes are a user's own."""
    out = {}
    for component in components.values():
        if not is_user_class(component):
            continue
        try:
            path = inspect.getsourcefile(type(component))
        except TypeError:  # defined where no file is (an interactive session)
            path = None
        if path:
            out[type(component).__module__] = Path(path)
    return out


def log_components(logger, components: dict, config_params: dict) -> None:
    """Log ``components``' settings as params (keys the config lacks), ``components.json``, and the
    source of every user class with its hash as a tag (see the module docstring)."""
    described = describe(components)
    params = {
        f"{role}.{name}": value
        for role, info in described.items()
        for name, value in info["settings"].items()
        if f"{role}.{name}" not in config_params
    }
    if params:
        logger.log_hyperparams(params)
    logger.experiment.log_dict(logger.run_id, described, "components.json")
    for module, path in source_files(components).items():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        logger.experiment.set_tag(logger.run_id, f"ngrpo.code.{module}", digest)
        logger.experiment.log_artifact(logger.run_id, str(path), "code")


def user_experiment_name(cfg) -> str | None:
    """``<explorer>-<objective>`` for a user's class's run in the default experiment (apart from its runs), or None."""
    parts = []
    user = False
    for role in ("explorer", "objective"):
        node = cfg.get(role) or {}
        target = node.get("_target_")
        if target and not str(target).startswith(PACKAGE + "."):
            user = True
            parts.append(str(target).rsplit(".", 1)[-1])
        else:
            parts.append(str(node.get("name") or str(target or role).rsplit(".", 1)[-1]))
    return "-".join(parts) if user else None
