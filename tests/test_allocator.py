"""host.allocator: the ``ngrpo`` command runs on mimalloc (preloaded by restarting itself before
torch loads), on the system's malloc when asked, and refuses an unknown allocator by name."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ngrpo_lightning import allocator
from ngrpo_lightning.build import check_config
from ngrpo_lightning.config import ConfigError, compose

NGRPO = Path(sys.executable).parent / "ngrpo"
needs_mimalloc = pytest.mark.skipif(allocator.mimalloc_path() is None, reason="cmeel-mimalloc not installed (Linux)")


def ngrpo_train(tmp: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [str(NGRPO), "train", "model=tiny", "trainer.max_steps=1", "logger=none", "data.val_size=0", *extra]
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.LAUNCHED)}
    env = {**base, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


def device_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.strip().startswith("device:")]
    return line


@needs_mimalloc
def test_the_command_runs_on_mimalloc_by_default_and_on_the_system_allocator_when_asked(tmp_path):
    assert "mimalloc allocator" in device_line(ngrpo_train(tmp_path))
    assert "system allocator" in device_line(ngrpo_train(tmp_path, "host.allocator=system", "output_dir=o2"))


@needs_mimalloc
def test_a_value_the_command_line_did_not_show_restarts_the_composed_run(tmp_path):
    """The process already runs on mimalloc when the composed config asks for the system's malloc
    (what a config group's value looks like to the command): it restarts without mimalloc."""
    env = {"LD_PRELOAD": str(allocator.mimalloc_path()), allocator.LAUNCHED: "mimalloc"}
    assert "system allocator" in device_line(ngrpo_train(tmp_path, "host.allocator=system", env=env))


def test_an_unknown_allocator_is_refused_by_name_before_anything_loads(tmp_path):
    proc = ngrpo_train(tmp_path, "host.allocator=jemalloc")
    assert proc.returncode == 2
    assert "host.allocator='jemalloc': expected one of auto, mimalloc, system" in proc.stderr
    assert "device:" not in proc.stdout
    with pytest.raises(ConfigError, match="host.allocator='tcmalloc'"):
        check_config(compose(["model=tiny", "host.allocator=tcmalloc"]))


def test_the_preload_list_gains_or_loses_mimalloc_and_keeps_the_rest():
    other = "/opt/lib/libother.so"
    env = allocator.preload_env("system", {"LD_PRELOAD": f"/x/libmimalloc.so.3:{other}", "HOME": "/h"})
    assert env["LD_PRELOAD"] == other and env["HOME"] == "/h" and env[allocator.LAUNCHED] == "system"
    assert "LD_PRELOAD" not in allocator.preload_env("system", {"LD_PRELOAD": "/x/libmimalloc.so.3"})
    if allocator.mimalloc_path() is not None:
        env = allocator.preload_env("mimalloc", {"LD_PRELOAD": other})
        assert env["LD_PRELOAD"] == f"{allocator.mimalloc_path()}:{other}"
    assert allocator.requested(["train", "host.allocator=system", "++host.allocator=auto"], "mimalloc") == "auto"
    assert allocator.requested(["train", "seed=1"], "mimalloc") == "mimalloc"


KEEP_UNDER_MIMALLOC = """
import ctypes, json, psutil, torch
from ngrpo_lightning.host_memory import keep_freed_memory
kept = keep_freed_memory()
process = ctypes.CDLL(None)
before = psutil.Process().memory_info().rss
x = torch.ones(64 * 2**20)  # 256 MiB, touched
del x
print(json.dumps([kept, hasattr(process, "mi_version"), (psutil.Process().memory_info().rss - before) / 2**20]))
"""


@needs_mimalloc
def test_keep_freed_memory_turns_mimallocs_purging_off():
    env = {**os.environ, "LD_PRELOAD": str(allocator.mimalloc_path())}
    out = subprocess.run([sys.executable, "-c", KEEP_UNDER_MIMALLOC], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    kept, on_mimalloc, rss_after_free_mib = json.loads(out.stdout.strip().splitlines()[-1])
    assert kept and on_mimalloc
    assert rss_after_free_mib > 200  # the freed block stays for the next step to reuse


LAUNCHER_ENV = """
import os, sys
import ngrpo_lightning.launch as launch
assert "torch" not in sys.modules  # the launcher decides before torch (and OpenMP) loads
sys.argv = ["ngrpo", "config", "model=tiny"]
launch.main()
print("GOMP_SPINCOUNT=" + os.environ.get("GOMP_SPINCOUNT", "<unset>"))
"""


@pytest.mark.parametrize(
    ("exported", "expected"),
    [
        ({}, "GOMP_SPINCOUNT=1000"),
        ({"GOMP_SPINCOUNT": "5"}, "GOMP_SPINCOUNT=5"),
        ({"OMP_WAIT_POLICY": "active"}, "GOMP_SPINCOUNT=<unset>"),
    ],
)
def test_the_command_sets_a_short_openmp_spin_unless_the_user_chose(exported, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", LAUNCHER_ENV], env={**env, **exported}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == expected
