"""Loading a policy (a Hugging Face id or folder, the packaged SmolLM2, tiny test models) and its LoRA adapters."""

import importlib
import warnings

# names that lived here before 0.2.0: they keep working for one release, warning of their new home (CHANGELOG.md)
_MOVED = {
    "load_policy": ("ngrpo_lightning.models.loading", "ngrpo_lightning.load_policy"),
    "load_tokenizer": ("ngrpo_lightning.models.loading", "ngrpo_lightning.load_tokenizer"),
}


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module 'ngrpo_lightning.models' has no attribute {name!r}")
    module, home = _MOVED[name]
    warnings.warn(
        f"ngrpo_lightning.models.{name} moved: use {home} (this path goes in the release after 0.2.0)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), name)
