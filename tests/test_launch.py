"""How a run is launched must not change what it computes, and losing a process must not lose
what was saved: one node of two FSDP2 processes (Lightning's launcher) and two nodes of one
process each (torchrun on this host) run on the same threads and give the same update; a rank
killed outright ends the run, and ``resume=last`` continues it. The runs are test_fsdp_cpu's."""

import os
import subprocess
import textwrap

import pytest
import torch
from conftest import SCRIPTED_CLI, fresh_store, scripted_cli
from test_fsdp_cpu import RUN, THROUGH, metrics, policy_weights, policy_weights_initial

from ngrpo_lightning.checkpoints.safe_load import load_checkpoint


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("settings", ["default", "deterministic"])
def test_one_node_of_two_processes_and_two_nodes_of_one_give_the_same_update(tmp_path, settings):
    """The same global run (FSDP2, 2 processes, 2 steps) launched as one node of two processes by
    Lightning's launcher and as two nodes of one process each by torchrun on this host: each process
    computes on the same threads however it was started (backend/threads.py; torchrun alone gave each
    of two nodes all the cores), says so in the header, and the updates agree within 2% (L2 of their
    difference over L2 of the update) with default settings, and bit for bit with
    ``trainer.deterministic=true`` (the backend's choices fixed: no choice that depends on a timing)."""
    same = ["trainer.deterministic=true"] if settings == "deterministic" else []
    python, driver = scripted_cli(tmp_path, THROUGH, SCRIPTED_CLI)
    # the rule decides, not the suite (conftest sets OMP_NUM_THREADS in processes of a parallel run)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTEST_XDIST_WORKER_COUNT")}
    env.update(MLFLOW_DISABLE_TELEMETRY="true", TOKENIZERS_PARALLELISM="false")

    def args(name: str, *extra: str) -> list[str]:
        out = tmp_path / name
        return [*RUN, f"output_dir={out}", f"logger.tracking_uri={fresh_store(out / 'mlruns.db')}", *extra, *same]

    one = subprocess.run(
        [python, driver, "train", *args("one_node", "trainer=fsdp_cpu", "data.prompts_per_step=2")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-4000:]
    port = _free_port()
    nodes = [
        subprocess.Popen(
            [
                python,
                *("-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={rank}"),
                *("--master-addr=127.0.0.1", f"--master-port={port}", driver, "train"),
                *args("two_nodes", "trainer=fsdp_cpu", "trainer.num_nodes=2", "trainer.devices=1"),
                "data.prompts_per_step=2",
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-4000:]
    cores = len(os.sched_getaffinity(0))
    threads = f"{max(1, cores // 2)} thread{'s' if cores // 2 > 1 else ''} ({cores} cores / 2 processes on this host)"
    said = [line for out in (one.stdout, outputs[0][0]) for line in out.splitlines() if "device:" in line]
    assert len(said) == 2 and all(threads in line for line in said), said
    initial = policy_weights_initial()
    updates = [
        {k: v - initial[k] for k, v in policy_weights(tmp_path / name / "checkpoints/last.ckpt").items()}
        for name in ("one_node", "two_nodes")
    ]
    norm = lambda d: torch.sqrt(sum((v.double() ** 2).sum() for v in d.values()))  # noqa: E731
    assert norm(updates[0]) > 0
    assert norm({k: updates[0][k] - updates[1][k] for k in updates[0]}) <= 0.02 * norm(updates[0])
    if same:
        assert all(torch.equal(updates[0][k], updates[1][k]) for k in updates[0])


# the second rank dies outright (SIGKILL: the OOM killer, a lost node) as its fourth step starts
KILL_RANK_1 = textwrap.dedent("""
    import os, signal
    from ngrpo_lightning.training.module import RLModule

    _start = RLModule.on_train_batch_start

    def _lost(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return _start(self, batch, batch_idx)

    RLModule.on_train_batch_start = _lost
""")


def test_a_rank_lost_under_fsdp2_stops_the_run_and_resume_continues_from_its_last_checkpoint(tmp_path):
    """One of two FSDP2 processes killed outright at step 4: Lightning's launcher ends the other
    (no process waits forever in a collective), the step-2 checkpoint stays whole with nothing
    half-written beside it, and ``resume=last`` continues the same MLflow run to the end."""
    python, driver = scripted_cli(tmp_path, THROUGH + KILL_RANK_1, SCRIPTED_CLI)
    out = tmp_path / "run"
    args = [*RUN, f"output_dir={out}", f"logger.tracking_uri={fresh_store(out / 'mlruns.db')}"]
    args += ["trainer=fsdp_cpu", "data.prompts_per_step=2", "trainer.max_steps=6", "checkpoint.every_n_steps=2"]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    lost = subprocess.run([python, driver, "train", *args], cwd=tmp_path, env=env, capture_output=True, timeout=240)
    assert lost.returncode != 0  # the first process is ended too, not left waiting for its peer
    last = out / "checkpoints/last.ckpt"
    assert last.resolve().name == "step-2.ckpt" and load_checkpoint(last)["global_step"] == 2
    assert not [p.name for p in (out / "checkpoints").iterdir() if "partial" in p.name]
    python, driver = scripted_cli(tmp_path, THROUGH, SCRIPTED_CLI)  # the same run, no rank lost
    resumed = subprocess.run(
        [python, driver, "train", *args, "resume=last"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert load_checkpoint(out / "checkpoints/last.ckpt")["global_step"] == 6
    assert len(metrics(out)["train/loss"]) >= 6  # one MLflow run: the steps before the loss and after it


def test_the_threads_rule_reads_torchruns_variables_only_under_torchrun():
    """Left over in an environment (a library that started a process group of one in this process,
    a shell), WORLD_SIZE and LOCAL_WORLD_SIZE say nothing of a run Lightning's launcher starts: its
    processes per node decide. Under torchrun they do (two nodes on one host: the whole world)."""
    from ngrpo_lightning.backends.threads import available_cores, decide_threads

    cores = available_cores()
    stale = {"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    assert decide_threads(None, 2, env=stale).threads == max(1, cores // 2)
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    assert decide_threads(None, 1, env=torchrun).processes_on_host == 2  # two nodes on this host
    assert decide_threads(None, 1, env={**torchrun, "MASTER_ADDR": "10.0.0.2"}).processes_on_host == 1
    assert decide_threads(None, 2, env={"OMP_NUM_THREADS": "3"}).threads == 3  # the user's
    assert decide_threads(4, 2, env={"OMP_NUM_THREADS": "3"}).threads == 4  # backend.threads first
