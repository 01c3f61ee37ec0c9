"""Composing a run's configuration: ``conf/`` + command-line overrides -> one ``DictConfig``.

Every command composes here (``conf/{config,eval,diagnose}.yaml``). On top of Hydra: ``explorer._target_=pkg.Cls``
selects a user class, ``model=<HF id | directory | file.ckpt>`` where a command takes any model, and errors are one
:class:`ConfigError` line naming the key (and valid keys near an unknown one). Imports only Hydra and OmegaConf."""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ngrpo_lightning import schema

__all__ = ["GROUPS", "ConfigError", "compose", "config_dir", "group_options"]

GROUPS = ("model", "data", "explorer", "objective", "trainer", "logger", "experiment")


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key."""


def named_error(err: Exception, key: str) -> ConfigError:
    """``err`` as a :class:`ConfigError` naming ``key`` once (:mod:`ngrpo_lightning.checks`' messages start with it)."""
    msg = str(err).strip('"')
    return ConfigError(msg if msg.startswith(key) else f"{key}: {msg}")


DEFAULT_TRACKING_URI = "sqlite:///mlruns/mlflow.db"  # conf/logger/mlflow.yaml's: where runs log by default


def config_dir() -> Path:
    """The ``conf/`` folder: ``ngrpo_lightning/conf`` in a wheel, the top-level ``conf/`` in a checkout."""
    here = Path(__file__).parent
    for path in (here / "conf", here.parent / "conf"):
        if (path / "config.yaml").is_file():
            return path
    raise FileNotFoundError(f"ngrpo-lightning's config folder is missing ({here / 'conf'}): reinstall the package")


def cache_dir() -> Path:
    """Where what is built once is kept: ``$NGRPO_CACHE`` or ``~/.cache/ngrpo-lightning``."""
    return Path(os.environ.get("NGRPO_CACHE") or "~/.cache/ngrpo-lightning").expanduser()


def group_options(group: str) -> list[str]:
    """The options of a config group (``group_options("explorer")`` -> ``["custom", "gaussian", ...]``)."""
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def compose(
    overrides: list[str], config_name: str = "config", *, model_paths: bool = False, allow_missing: bool = False
) -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with command-line overrides, resolved. ``model_paths``: ``model=<value>``
    that is not a ``conf/model`` option means ``model=hf model.name_or_path=<value>``. Raises :class:`ConfigError`
    naming the key (``allow_missing``: missing values stay ``???``)."""
    overrides = normalize_overrides(overrides, model_paths=model_paths)
    try:
        cfg = _hydra_compose(config_name, overrides)
        OmegaConf.resolve(cfg)
        missing = sorted(OmegaConf.missing_keys(cfg))
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(explain_compose_error(err, overrides, config_name)) from err
    if missing and not allow_missing:
        raise ConfigError(f"config key {missing[0]} has no value: set it on the command line, e.g. {missing[0]}=...")
    return cfg


def _hydra_compose(config_name: str, overrides: list[str]) -> DictConfig:
    schema.register()
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        return hydra_compose(config_name=config_name, overrides=overrides)


def normalize_overrides(overrides: list[str], *, model_paths: bool = False) -> list[str]:
    """``explorer._target_=pkg.Cls explorer.x=1`` switches the group to ``custom`` with the other keys
    as additions; with ``model_paths``, ``model=<not an option>`` becomes ``model=hf model.name_or_path=...``."""
    out, custom = list(overrides), set()
    for o in overrides:
        m = re.match(r"^\+?(explorer|objective)\._target_=", o)
        if m:
            custom.add(m.group(1))
    for group in custom:
        out = [f"+{o}" if o.startswith(f"{group}.") and not o.startswith(f"{group}._target_=") else o for o in out]
        out = [o.lstrip("+") if o.lstrip("+").startswith(f"{group}._target_=") else o for o in out]
        out = [o for o in out if not o.startswith(f"{group}=")] + [f"{group}=custom"]
    out = [quote_path_value(o) for o in out]
    if model_paths:
        models, expanded = group_options("model"), []
        dtype_given = any(o.lstrip("+").startswith("model.dtype=") for o in out)
        for o in out:
            key, _, value = o.partition("=")
            if key == "model" and value and value not in models:
                expanded += ["model=hf", f"model.name_or_path={value}"]
                saved = None if dtype_given else saved_dtype(value.strip("'\""))
                expanded += [f"model.dtype={saved}"] if saved else []  # a model on disk: as it was saved
            else:
                expanded.append(o)
        out = expanded
    return out


def saved_dtype(path: str) -> str | None:
    """The dtype a model folder's ``config.json`` records, where ``model.dtype`` takes it; else ``None``."""
    config = Path(path).expanduser() / "config.json"
    if not config.is_file():
        return None
    try:
        saved = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    dtype = saved.get("dtype") or saved.get("torch_dtype")
    return dtype if dtype in ("float32", "bfloat16", "float16") else None


def quote_path_value(override: str) -> str:
    """``key=<an existing path with '=' or ','>`` quoted for Hydra's grammar: ``key='<path>'``."""
    key, sep, value = override.partition("=")
    if not sep or value[:1] in ("'", '"') or not any(c in value for c in "=,") or not Path(value).exists():
        return override
    return f"{key}='{value.replace(chr(92), chr(92) * 2).replace(chr(39), chr(92) + chr(39))}'"


def explain_compose_error(err: Exception, overrides: list[str], config_name: str = "config") -> str:
    """Hydra's message plus the valid keys near an unknown one, or the expected type (:mod:`ngrpo_lightning.schema`)."""
    msg = str(err).strip()
    cause = err.__cause__
    typed = re.match(
        r"Value '(.*)' (?:of type '\w+' could not be converted to (\w+)|is not a valid (bool))", str(cause or "")
    )
    key = re.search(r"full_key: (\S+)", str(cause or ""))
    if typed and key:
        expected = typed[2] or typed[3]
        kind = {"Float": "a number", "Integer": "an integer", "bool": "true or false"}.get(expected, expected)
        value = typed[1] if re.fullmatch(r"-?\d+(\.\d*)?(e-?\d+)?", typed[1]) else repr(typed[1])  # 2, 'abc'
        return f"{key[1]}={value} must be {kind}"
    m = re.search(r"Could not override '([^']+)'", msg) or re.search(r"Key '([^']+)' is not in struct", msg)
    if m:
        key = m.group(1)
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        try:
            base = _hydra_compose(
                config_name, [o for o in overrides if "=" in o and o.split("=", 1)[0].lstrip("+") in GROUPS]
            )
            node = OmegaConf.select(base, parent) if parent else base
            while parent and not isinstance(node, DictConfig):  # a group that is not there (host.*): its nearest one
                parent = parent.rsplit(".", 1)[0] if "." in parent else ""
                node = OmegaConf.select(base, parent) if parent else base
            if isinstance(node, DictConfig):
                where = f" of {parent}" if parent else ""
                return f"unknown config key {key!r}; valid keys{where}: {sorted(node.keys())}"
        except (HydraException, OmegaConfBaseException):  # fall back to Hydra's own message
            pass
    lines = msg.splitlines()
    special = [
        o for o in overrides if any(c in o.partition("=")[2] for c in "=,") and o.partition("=")[2][:1] not in "'\""
    ]
    if "Error when parsing" in msg or "mismatched input" in msg or "extraneous input" in msg:
        if special:  # a value with '=' or ',' that is not an existing path (quoted then): say how to quote it
            key, _, value = special[0].partition("=")
            return (
                f"{lines[0]}: {key}={value} holds '=' or ',', which overrides read as syntax; quote it: {key}='{value}'"
            )
    if msg.startswith("Ambiguous value for argument"):  # a sweep's comma list in a single run
        return f"{lines[0]}: a comma-separated list sweeps its values, which needs -m (ngrpo train -m ...)"
    if "LexerNoViableAltException" in msg and len(lines) > 1:  # a character the grammar has no token for
        override, at = lines[0].split(": ", 1)[-1], lines[1].find("^")  # the caret marks it in lines[0]
        bad = f"{lines[0][at]!r} " if 0 <= at < len(lines[0]) else ""
        return (
            f"cannot read the override {override}: the character {bad}must be inside quotes "
            "(key='value', or a list's items, key=['a','b']): unquoted values are Hydra's grammar"
        )
    if "Available options" not in msg:
        return lines[0]
    options = msg.split("\nConfig search path:")[0].strip()  # where Hydra looked: its internals, not the user's
    asked = re.search(r"Could not find '(\w+)/([\w.]+\.\w+)'", msg)  # explorer=my_mod.MyExplorer: a class path
    if asked and asked[1] in ("explorer", "objective"):
        options += f"\n{asked[2]} looks like a class path: give it as {asked[1]}._target_={asked[2]}"
    elif wanted := re.search(r"Could not find '([\w/]+)/([^'/]+)'", msg):  # a typo: the nearest option, first
        listed = [line.strip() for line in options.splitlines() if line.startswith("\t")]
        near = difflib.get_close_matches(wanted[2], listed, n=1, cutoff=0.6)
        if near:
            options = f"{lines[0]}: did you mean {wanted[1]}={near[0]}?\n" + options.split("\n", 1)[1]
    return options
