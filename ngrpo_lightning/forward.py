"""Deprecated: moved to :mod:`ngrpo_lightning.training.forward` in 0.2.0; this module keeps the
old import path working for one release, with a ``DeprecationWarning`` (CHANGELOG.md)."""

import warnings

from ngrpo_lightning.training.forward import response_logprobs

warnings.warn(
    "ngrpo_lightning.forward moved: import response_logprobs from ngrpo_lightning.training.forward "
    "(this path goes in the release after 0.2.0)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["response_logprobs"]
