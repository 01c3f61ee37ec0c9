"""The C allocator is chosen by the ``ngrpo`` command before Python starts (``commands/bin/ngrpo``, a shell script
that execs Python once): mimalloc where its wheel is installed, freed memory kept in the process, its huge pages off;
``NGRPO_ALLOCATOR=system`` keeps the C library's malloc; a run says which it got. The library itself never restarts
the process or preloads a library."""

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ngrpo_lightning.commands.launch import GOMP_SPINCOUNT
from ngrpo_lightning.config import ConfigError, compose

ROOT = Path(__file__).resolve().parents[1]
NGRPO = Path(sys.executable).parent / "ngrpo"
MI_OPTION_PURGE_DELAY, MI_OPTION_ALLOW_THP = 15, 43  # mimalloc's mi_option_t numbers (mimalloc.h, 3.4)
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mimalloc is preloaded on Linux only")
SET = (
    "LD_PRELOAD",
    "MIMALLOC_PURGE_DELAY",
    "MIMALLOC_ALLOW_THP",
    "NGRPO_ALLOCATOR",
    "GOMP_SPINCOUNT",
    "OMP_WAIT_POLICY",
)
SPIN = {"GOMP_SPINCOUNT": GOMP_SPINCOUNT}  # OpenMP's spin, set by launch.py before torch loads


def clean(**env) -> dict:
    """This environment without what the command sets, plus ``env``."""
    return {**{k: v for k, v in os.environ.items() if k not in SET}, **env}


def command(*args, env=None, cwd=None, program=NGRPO, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(program), *args], env=env or clean(), cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def printed_env(**env) -> dict[str, str]:
    proc = command("env", env=clean(**env))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(line.split("=", 1) for line in proc.stdout.splitlines())


def in_process(code: str, env: dict) -> str:
    proc = subprocess.run([sys.executable, "-c", code], env=clean(**env), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


PROBE = (
    "import ctypes; p = ctypes.CDLL(None); "
    "print('mimalloc' if hasattr(p, 'mi_version') else 'system', "
    f"*([p.mi_option_get(o) for o in ({MI_OPTION_PURGE_DELAY}, {MI_OPTION_ALLOW_THP})] "
    "if hasattr(p, 'mi_option_get') else ['-']))"
)


@LINUX
def test_the_command_preloads_mimalloc_with_freed_memory_kept():
    env = printed_env()
    assert Path(env["LD_PRELOAD"]).name.startswith("libmimalloc.so."), env
    assert env["MIMALLOC_PURGE_DELAY"] == "-1" and env["MIMALLOC_ALLOW_THP"] == "0"
    assert in_process(PROBE, env) == "mimalloc -1 0"  # loaded; purge delay and huge pages taken from the environment
    assert in_process(PROBE, {}) == "system -"  # a plain process is left alone
    assert not [k for k in env if k.startswith("MALLOC_")], env  # glibc's malloc is never tuned (its record)
    make = subprocess.run(["make", "-s", "-C", str(ROOT), "run-env", f"BIN={NGRPO.parent}"], env=clean(),
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert dict(line.split("=", 1) for line in make.stdout.splitlines()) == env  # make's view is the command's


@LINUX
def test_the_users_choices_win():
    assert printed_env(NGRPO_ALLOCATOR="system") == SPIN
    mine = ctypes.util.find_library("m") or "libm.so.6"  # any preload of the user's own
    assert printed_env(LD_PRELOAD=mine) == {"LD_PRELOAD": mine, **SPIN}
    assert printed_env(NGRPO_ALLOCATOR="system", GOMP_SPINCOUNT="1000") == {"GOMP_SPINCOUNT": "1000"}
    assert printed_env(NGRPO_ALLOCATOR="system", OMP_WAIT_POLICY="PASSIVE") == {}  # OpenMP's own policy: no spin set
    assert printed_env(MIMALLOC_PURGE_DELAY="10")["MIMALLOC_PURGE_DELAY"] == "10"
    proc = command("env", env=clean(NGRPO_ALLOCATOR="jemalloc"))
    assert proc.returncode == 2 and "NGRPO_ALLOCATOR=jemalloc" in proc.stderr and "mimalloc" in proc.stderr


@LINUX
def test_the_command_works_through_a_link_and_no_file_in_the_working_directory_shadows_a_library(tmp_path):
    (tmp_path / "omegaconf.py").write_text("raise SystemExit('shadowed')\n")  # the command imports omegaconf
    link = tmp_path / "bin" / "ngrpo"
    link.parent.mkdir()
    link.symlink_to(NGRPO)
    proc = command("env", cwd=tmp_path, program=link)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "libmimalloc.so." in proc.stdout


@pytest.mark.parametrize("allocator", ["mimalloc", "system"])
def test_a_run_says_its_allocator_and_the_library_never_restarts_itself(tmp_path, allocator):
    if allocator == "mimalloc" and not sys.platform.startswith("linux"):
        pytest.skip("mimalloc is preloaded on Linux only")
    cmd = ["train", "model=tiny", "trainer.max_steps=1", "logger=none", "data.val_size=0"]
    proc = command(*cmd, env=clean(NGRPO_ALLOCATOR=allocator), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.strip().startswith("device:")]
    assert f"{allocator} allocator" in line
    sources = "\n".join(p.read_text() for p in (ROOT / "ngrpo_lightning").rglob("*.py"))
    for forbidden in ("os.exec", "putenv", 'environ["LD_PRELOAD"]', "mallopt"):
        assert forbidden not in sources, forbidden


def test_the_ranks_lightning_starts_run_the_same_command_on_the_same_allocator(tmp_path):
    """``trainer=fsdp_cpu`` from the command: Lightning starts the second rank as ``python -m`` the module the
    launcher ran, in the environment it set; both ranks finish the step."""
    cmd = ["train", "model=tiny", "trainer=fsdp_cpu", "trainer.max_steps=1", "logger=none", "data.val_size=0"]
    proc = command(*cmd, f"output_dir={tmp_path / 'out'}", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Trained 1 step" in proc.stdout and "GLOBAL_RANK: 1" in proc.stderr + proc.stdout


def test_the_removed_host_keys_are_refused_by_name():
    with pytest.raises(ConfigError, match="host"):
        compose(["model=tiny", "host.allocator=system"])
