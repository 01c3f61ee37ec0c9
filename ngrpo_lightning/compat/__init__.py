"""Every place this package reaches into another library's internals, one module per library.

Reads and writes with no public API (a module's own parameter dictionary on a hot path, a Lightning checkpoint
callback's save methods, vLLM's model runner wrapped to run the explorers) live here and nowhere else
(``tests/test_compat.py`` checks), so a new release of a library breaks in one named place, with a clear message.
Each module states the versions it was tested on (``TESTED``, :class:`Library`); outside them its first use warns
once, and a missing internal raises :class:`CompatError` naming the library, the installed and tested versions and
what is missing. This package imports none of the libraries: a module is imported by the code that uses its library.
"""

from __future__ import annotations

import warnings
from importlib import metadata

from packaging.specifiers import SpecifierSet

__all__ = ["CompatError", "Library", "UntestedVersionWarning"]


class CompatError(RuntimeError):
    """An internal of another library that this package relies on is missing (an untested release)."""


class UntestedVersionWarning(UserWarning):
    """A library is installed in a version its compat module was not tested on."""


class Library:
    """A library whose internals a compat module reads, and the versions it was tested on.

    Args:
        name: the library as users know it (``torch``).
        tested: its distributions (``pip`` names) -> tested versions (``">=2.13,<2.14"``); the first installed is read.
        version: the installed version where no distribution tells it (the standard library: the interpreter's).
    """

    def __init__(self, name: str, tested: dict[str, str], version: str | None = None):
        self.name, self.tested = name, dict(tested)
        self.distribution, self.version = next(iter(self.tested)), version
        if version is None:
            for distribution in self.tested:
                try:
                    self.distribution, self.version = distribution, metadata.version(distribution)
                    break
                except metadata.PackageNotFoundError:
                    continue
        self.warned = False

    def tested_text(self) -> str:
        return " or ".join(f"{d}{spec}" for d, spec in self.tested.items())

    def is_tested(self) -> bool:
        """Whether the installed version is one tested (``True`` where none is installed)."""
        spec = SpecifierSet(self.tested[self.distribution])
        return self.version is None or spec.contains(self.version, prereleases=True)

    def warn_if_untested(self) -> None:
        """Warn once when the installed version is not one tested (a compat module calls this as it is imported)."""
        if not self.warned and not self.is_tested():
            self.warned = True
            warnings.warn(
                f"{self.distribution} {self.version} is installed; ngrpo-lightning reads internals of "
                f"{self.name} tested on {self.tested_text()} only (ngrpo_lightning.compat): if a run fails, "
                "install a tested version",
                UntestedVersionWarning,
                stacklevel=3,
            )

    def error(self, what: str) -> CompatError:
        """The error for a missing internal ``what`` (``"Tensor._version"``), to raise from the failed access."""
        installed = "not installed" if self.version is None else f"{self.distribution} {self.version} is installed"
        return CompatError(
            f"{self.name} has no {what}: ngrpo-lightning relies on it and was tested on {self.tested_text()} "
            f"({installed}). Install a tested version of {self.name}"
        )

    def attribute(self, obj, name: str):
        """``getattr(obj, name)``, or :class:`CompatError` naming ``type(obj).name`` where it is missing."""
        try:
            return getattr(obj, name)
        except AttributeError as err:
            raise self.error(f"{type(obj).__name__}.{name}") from err
