"""The reward's process pool: its soft (SIGPROF, CPU time) and hard (kill the pool) time limits,
workers spread, killed, recovered and never leaked, and answers never lost on a busy machine."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

# Only torch-free names at module level: the hard-limit test's check_fn lives in this
# module, so spawned verifier workers import it (MathReward pulls in torch, lazily).
from ngrpo_lightning import rewards
from ngrpo_lightning.rewards import verify_answer

TIMEOUT_S = 1.0
GRACE_S = 1.0


def _misbehave_on_marker(pred, gold):
    """check_fn for the hard-limit tests. Gold "HANG": block SIGPROF (like a long C call that
    never looks at signals) and sleep forever, so only killing the process helps.
    Gold "CRASH": the worker dies (like a segfault or the OOM killer)."""
    if gold == "HANG":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPROF})
        time.sleep(3600)
    if gold == "CRASH":
        os._exit(3)
    return verify_answer(pred, gold)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # zombies are dead
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _wait_dead(pids, timeout=10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


@pytest.fixture(scope="module")
def reward():
    with rewards.MathReward(timeout_s=TIMEOUT_S, num_workers=2, kill_grace_s=GRACE_S) as r:
        yield r


BUSY = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def test_pathological_answer_times_out_others_scored(reward):
    """Soft limit: sympy's big-int power loop checks signals, so SIGPROF stops it."""
    completions = [r"\boxed{3}", r"\boxed{9^{9^{9^{9^{9}}}}}", r"\boxed{7}"]
    t0 = time.monotonic()
    res = reward(completions, ["3", "12", "7"])
    elapsed = time.monotonic() - t0
    assert res.status == ["correct", "timeout", "correct"]
    assert res.scores.tolist() == [1.0, 0.0, 1.0]
    assert res.metrics()["reward/timeout_frac"] == pytest.approx(1 / 3)
    assert elapsed < TIMEOUT_S + 3.0
    assert reward([r"\boxed{2}"], ["2"]).status == ["correct"]  # the worker lives on


def test_hung_worker_is_killed_and_pool_recovers():
    """Hard limit: an item that ignores SIGPROF is killed with its whole pool; the other
    items of the batch are re-run in a fresh pool and still scored. Same for a crash."""
    r = rewards.MathReward(timeout_s=TIMEOUT_S, num_workers=2, kill_grace_s=GRACE_S, check_fn=_misbehave_on_marker)
    try:
        t0 = time.monotonic()
        old_pids = r.start()
        start_s = time.monotonic() - t0  # the machine may be busy: scale the bound below
        completions = [rf"\boxed{{{i}}}" for i in range(40)]
        golds = [str(i) for i in range(40)]
        golds[7] = "HANG"
        t0 = time.monotonic()
        res = r(completions, golds)
        elapsed = time.monotonic() - t0
        assert res.status[7] == "timeout" and res.scores[7] == 0.0
        assert all(s == "correct" for i, s in enumerate(res.status) if i != 7)
        assert elapsed < TIMEOUT_S + GRACE_S + 2 * start_s + 2.0  # + respawn of the pool
        assert r.pool.restarts == 1
        assert not _wait_dead(old_pids), "the killed workers must not linger"
        new_pids = r.pool.worker_pids()
        assert new_pids and not set(new_pids) & set(old_pids)
        assert r([r"\boxed{1}", "nothing"], ["1", "1"]).status == ["correct", "no_answer"]

        # A dying worker: its item is checked once more in a fresh pool (a first death may be the
        # machine's: memory), and an error when it dies again; the rest of the batch is re-run.
        res = r([r"\boxed{1}", r"\boxed{2}", r"\boxed{3}"], ["1", "CRASH", "3"])
        assert res.status == ["correct", "error", "correct"]
        assert r.pool.restarts == 3
        new_pids = r.pool.worker_pids()
    finally:
        r.close()
    assert not _wait_dead(new_pids), "close() must reap the workers"
    r.close()  # idempotent


def test_large_batch_spreads_over_workers(reward):
    n = 256
    res = reward([rf"\boxed{{{i}}}" for i in range(n)], [str(i if i % 4 else i + 1) for i in range(n)])
    assert res.counts()["correct"] == 3 * n // 4 and res.counts()["wrong"] == n // 4
    used = set(res.worker_pids)
    assert len(used) > 1 and used <= set(reward.pool.worker_pids())


def test_no_pool_leak_at_interpreter_exit(tmp_path):
    """A pool that is never closed is shut down at exit (the pool owns that guarantee;
    using it directly keeps torch out of the subprocess)."""
    script = tmp_path / "leak.py"
    script.write_text(
        textwrap.dedent("""
        from ngrpo_lightning.rewards.pool import VerifierPool

        if __name__ == "__main__":
            pool = VerifierPool(num_workers=2)
            out = pool.run([(0, "1", "1")], check_fn=None, timeout_s=2.0, kill_after_s=4.0, num_chunks=1)
            assert out[0][0] == "correct" and out[0][2] == 1.0, out
            print(*pool.worker_pids())  # exits without close()
    """)
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2 and not _wait_dead(pids)


def test_workers_exit_when_the_trainer_is_killed(tmp_path):
    """SIGKILL runs no clean-up in the parent: the workers must notice its death themselves."""
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent("""
        import sys, time
        from ngrpo_lightning.rewards.pool import VerifierPool

        if __name__ == "__main__":
            pool = VerifierPool(num_workers=2)
            print(*pool.start(), flush=True)
            time.sleep(600)
    """)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    assert not _wait_dead(pids, timeout=15.0), "verifier workers outlived their killed parent"


def test_timeouts_in_a_small_batch_run_in_parallel():
    """Pathological answers of one small batch are spread over the workers: the batch costs about
    timeout_s x ceil(pathological / workers), not the sum."""
    with rewards.MathReward(timeout_s=TIMEOUT_S, num_workers=2, kill_grace_s=GRACE_S) as r:
        r.start()
        slow = r"\boxed{9^{9^{9^{9^{9}}}}}"
        completions = [slow, slow, slow, slow] + [rf"\boxed{{{i}}}" for i in range(8)]
        golds = ["1"] * 4 + [str(i) for i in range(8)]
        t0 = time.monotonic()
        res = r(completions, golds)
        elapsed = time.monotonic() - t0
    assert res.status[:4] == ["timeout"] * 4 and res.status[4:] == ["correct"] * 8
    assert elapsed < 2 * TIMEOUT_S + 2.5  # serially it would be >= 4 x timeout_s
    assert len(set(res.worker_pids[:4])) == 2


def test_reward_pickles_without_its_workers(reward):
    import pickle

    reward.start()
    clone = pickle.loads(pickle.dumps(reward))
    assert repr(clone) == repr(reward) and not clone.pool.started and reward.pool.started
    clone.close()


def test_workers_do_not_import_the_parents_script(tmp_path):
    """A spawned worker would import the parent's main script first (for ``ngrpo train``: the whole
    trainer); it is started without it: small, and a script without a main guard works."""
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent("""
        import psutil, torch, transformers  # what a trainer holds; no `if __name__ == "__main__":` guard
        from ngrpo_lightning.rewards.pool import VerifierPool

        pool = VerifierPool(num_workers=1)
        out = pool.run([(0, "1", "1")], check_fn=None, timeout_s=2.0, kill_after_s=4.0, num_chunks=1)
        assert out[0][0] == "correct", out
        (pid,) = pool.worker_pids()
        print(psutil.Process(pid).memory_info().rss, psutil.Process().memory_info().rss)
        pool.close()
    """)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    worker, parent = map(int, out.stdout.split())
    assert worker < 0.3 * 2**30 and worker < parent, (worker, parent)


def test_a_busy_machine_loses_no_answer():
    """Twice as many CPU-bound processes as cores beside the verifier, and limits far below what
    a worker's first task check costs to import (reasoning-gym: about 0.6 s of CPU): every answer
    is scored as it should be. The limits count the check's own CPU time (and sleep), not the time
    it waits for a core, and what a check imports first is imported outside them: imported under a
    limit, reasoning-gym was cut off midway, and every later check in that worker raised."""
    reasoning_gym = pytest.importorskip("reasoning_gym")
    entries = list(reasoning_gym.create_dataset("chain_sum", size=8, seed=0))
    specs = [json.dumps(entry) for entry in entries]
    golds = [str(entry["answer"]) for entry in entries]
    right = [i % 2 == 0 for i in range(len(entries))]
    completions = [rf"\boxed{{{g if ok else int(g) + 1}}}" for g, ok in zip(golds, right)]
    math_completions, math_golds = [r"\boxed{\frac{1}{2}}", r"\boxed{3}"], ["0.5", "4"]
    burners = [
        subprocess.Popen([sys.executable, "-c", BUSY.format(seconds=90)]) for _ in range(2 * (os.cpu_count() or 1))
    ]
    try:
        with rewards.MathReward(timeout_s=0.3, kill_grace_s=0.3, num_workers=2, parallel_threshold=4) as r:
            tasks = r(completions, golds, specs)
            maths = r(math_completions, math_golds)
    finally:
        for proc in burners:
            proc.kill()
            proc.wait()
    assert tasks.status == ["correct" if ok else "wrong" for ok in right], tasks.status
    assert maths.status == ["correct", "wrong"], maths.status
