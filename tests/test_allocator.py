"""The C allocator is the launcher's business, not the library's: ``make train`` preloads mimalloc
with freed memory kept in the process (Makefile, ``RUN_ENV``); the ``ngrpo`` command never restarts
itself, and a run says which allocator it got."""

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ngrpo_lightning.config import ConfigError, compose

ROOT = Path(__file__).resolve().parents[1]
NGRPO = Path(sys.executable).parent / "ngrpo"
MI_OPTION_PURGE_DELAY, MI_OPTION_ALLOW_THP = 15, 43  # mimalloc's mi_option_t numbers (mimalloc.h, 3.4)


def launcher_env() -> dict[str, str]:
    """The environment ``make train`` runs the command in, for this virtual environment."""
    out = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "run-env", f"BIN={Path(sys.executable).parent}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def in_process(code: str, env: dict) -> str:
    clean = {
        k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MIMALLOC_PURGE_DELAY", "MIMALLOC_ALLOW_THP")
    }
    proc = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


PROBE = (
    "import ctypes; p = ctypes.CDLL(None); "
    "print('mimalloc' if hasattr(p, 'mi_version') else 'system', "
    f"*([p.mi_option_get(o) for o in ({MI_OPTION_PURGE_DELAY}, {MI_OPTION_ALLOW_THP})] "
    "if hasattr(p, 'mi_option_get') else ['-']))"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mimalloc is preloaded on Linux only")
def test_the_launcher_preloads_mimalloc_with_freed_memory_kept():
    env = launcher_env()
    assert Path(env["LD_PRELOAD"]).name.startswith("libmimalloc.so."), env
    assert env["MIMALLOC_PURGE_DELAY"] == "-1" and env["MIMALLOC_ALLOW_THP"] == "0"
    assert not [k for k in env if k.startswith("MALLOC_")], env  # glibc's malloc at its defaults (its record)
    assert in_process(PROBE, env) == "mimalloc -1 0"  # loaded; purge delay and huge pages taken from the environment
    assert in_process(PROBE, {}) == "system -"  # a plain process is left alone


def test_the_command_does_not_restart_itself_and_says_its_allocator(tmp_path):
    """A run started without the launcher runs on the system's malloc and says so; the library has no
    code that re-executes the process or preloads a library."""
    cmd = [str(NGRPO), "train", "model=tiny", "trainer.max_steps=1", "logger=none", "data.val_size=0"]
    clean = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.strip().startswith("device:")]
    assert "system allocator" in line
    sources = "\n".join(p.read_text() for p in (ROOT / "ngrpo_lightning").rglob("*.py"))
    for forbidden in ("os.execv", "LD_PRELOAD", "mallopt"):
        assert forbidden not in sources, forbidden
    assert not hasattr(ctypes.CDLL(None), "mi_version") or "LD_PRELOAD" in os.environ


def test_the_removed_host_keys_are_refused_by_name():
    with pytest.raises(ConfigError, match="host"):
        compose(["model=tiny", "host.allocator=system"])
