"""Which code a run ran: the package's version and, from a git checkout, its commit.

A comparison across sessions (a sweep resumed a week later, seeds added to a study) is only as
good as the certainty that its runs ran the same code. Every MLflow run is tagged with it:
``ngrpo.version``, and where the package is imported from a git checkout,
``mlflow.source.git.commit`` (the tag MLflow's UI shows) and ``ngrpo.git_dirty`` (``true`` when
tracked files differ from that commit). Installed from a wheel, only the version is known.
"""

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
    a git checkout), computed once per process."""
    tags = {"ngrpo.version": ngrpo_lightning.__version__}
    # the package's own files must be tracked there: a wheel installed into a virtual environment
    # that lies inside some other repository would otherwise take that repository's commit
    commit = _git("rev-parse", "HEAD") if _git("ls-files", "--error-unmatch", "__init__.py") is not None else None
    if commit:
        tags["mlflow.source.git.commit"] = commit
        changed = _git("status", "--porcelain", "--untracked-files=no")
        tags["ngrpo.git_dirty"] = "true" if changed else "false"
    return tags
