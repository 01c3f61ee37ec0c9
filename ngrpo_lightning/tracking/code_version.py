"""Which code a run ran: the package's version and, from a git checkout, its commit.

Comparing runs across sessions needs certainty they ran the same code; each MLflow run is tagged (:func:`code_tags`)."""

from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path

import ngrpo_lightning

PACKAGE = Path(ngrpo_lightning.__file__).resolve().parent


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(PACKAGE), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):  # no git, or it hung
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@cache
def code_tags() -> dict[str, str]:
    """``{"ngrpo.version", "mlflow.source.git.commit", "ngrpo.git_dirty"}`` (the last two only from
    a git checkout; ``git_dirty``: tracked files differ from the commit), computed once per process."""
    tags = {"ngrpo.version": ngrpo_lightning.__version__}
    # the package's own files must be tracked there, or a wheel in a venv inside another repository takes its commit
    commit = _git("rev-parse", "HEAD") if _git("ls-files", "--error-unmatch", "__init__.py") is not None else None
    if commit:
        tags["mlflow.source.git.commit"] = commit
        changed = _git("status", "--porcelain", "--untracked-files=no")
        tags["ngrpo.git_dirty"] = "true" if changed else "false"
    return tags
