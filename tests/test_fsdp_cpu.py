"""FSDP2 on CPU (``trainer=fsdp_cpu``: Lightning's ModelParallelStrategy, 2 processes on gloo).

Two processes with 2 prompts each train like one process with the same 4 prompts: the
same losses and the same updated weights (fp32 tolerance). Rollouts are sampled with a
seed per (step, row within its group) and the reward is scripted per row, so both runs see
the same rollouts and advantages whatever the batch composition; prompts are split by rank
with a prompt's G samples on one rank.

The two processes are started by torchrun, as a launcher starts them on a cluster, and both
start at once; one test starts them as ``ngrpo train trainer=fsdp_cpu`` alone does, by
Lightning, which starts the second process once the first has set up (twice the start-up).
"""

import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTED_CLI, fresh_store, scripted_cli

from ngrpo_lightning.build.trainer import check_trainer
from ngrpo_lightning.checkpoints.safe_load import load_checkpoint
from ngrpo_lightning.commands.cli import main
from ngrpo_lightning.config import ConfigError, compose
from ngrpo_lightning.explorers import ExplorerStep, TemperatureExplorer


class RowSeededSampler(TemperatureExplorer):
    """Plain sampling whose draw for a row depends only on the decoding step and the row's
    index within its group (G=2), not on the batch the row is in (or its rank)."""

    def prepare(self, embeddings):
        super().prepare(embeddings)
        self.t = 0

    def step(self, logits, generator=None):
        rows = [
            self.sample(logits[r : r + 1], torch.Generator(device=logits.device).manual_seed(1000 * self.t + r % 2))
            for r in range(len(logits))
        ]
        self.t += 1
        return ExplorerStep(tokens=torch.cat(rows))


RUN = [
    "model=tiny",
    "data.train_size=8",
    "data.val_size=0",
    "rollout.group_size=2",
    "rollout.max_new_tokens=6",
    "explorer._target_=test_fsdp_cpu.RowSeededSampler",
    "explorer.top_k=4",
    "optim.lr=1e-2",
    "logger.log_samples_every=0",
    "trainer.enable_progress_bar=false",
    "trainer.max_steps=2",
    "validate_before_fit=false",
    "checkpoint.every_n_steps=0",
]
KEYS = ["train/loss", "train/kl_ref", "train/grad_norm", "train/entropy", "train/reward", "train/response_length_mean"]

# a backend that decodes a sharded policy through itself, never on a copy (backend.name=cpu_through)
THROUGH = textwrap.dedent("""
    from ngrpo_lightning.backends.base import BACKENDS
    from ngrpo_lightning.backends.cpu import CPUBackend

    @BACKENDS.register("cpu_through")
    class ThroughCPUBackend(CPUBackend):
        def decodes_sharded_on_copy(self, copy_bytes, device):
            return False
""")


def launch(tmp: Path, name: str, *extra: str, driver_text: str = SCRIPTED_CLI, torchrun: bool = True) -> Path:
    """``train`` with ``RUN + extra`` in new processes; with ``trainer=fsdp_cpu``, two started by
    torchrun (``torchrun=False``: by Lightning, from the first). Returns the run's ``output_dir``."""
    python, driver = scripted_cli(tmp, THROUGH, driver_text)
    out = tmp / name
    args = RUN + [f"output_dir={out}", f"logger.tracking_uri={fresh_store(out / 'mlruns.db')}", *extra]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    ranks = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]  # a free port of its own
    python = [python, *(ranks if torchrun and "trainer=fsdp_cpu" in extra else [])]
    proc = subprocess.run(
        [*python, driver, "train", *args], cwd=tmp, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (out / "stderr.txt").write_text(proc.stderr)
    return out


def one_process(tmp: Path, monkeypatch, *extra: str) -> Path:
    """The reference run: one process, in this one, with the global batch of two ranks' prompts."""
    from conftest import ScriptedReward

    from ngrpo_lightning.commands.cli import train

    monkeypatch.setattr("ngrpo_lightning.build.components.build_reward", lambda cfg: ScriptedReward((1, 0)))
    out = tmp / "one"
    store = [f"output_dir={out}", f"logger.tracking_uri={fresh_store(out / 'mlruns.db')}"]
    train(compose(RUN + [*extra, *store, "trainer=cpu", "data.prompts_per_step=4"]))
    return out


def metrics(out: Path, *more: str) -> dict[str, list[float]]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{out}/mlruns.db")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])  # a store per run
    history = {k: client.get_metric_history(run.info.run_id, k) for k in KEYS + list(more)}
    return {k: [m.value for m in sorted(h, key=lambda m: m.step)] for k, h in history.items()}


def policy_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    load_checkpoint(ckpt)  # what resume, eval and export read first: data only (.metadata and meta.pt of a folder)
    if ckpt.is_dir():  # a distributed (sharded) checkpoint: gather it into one file
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(ckpt, ckpt.parent / "full.pt")
        ckpt = ckpt.parent / "full.pt"
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("policy.")}


@pytest.fixture(scope="module")
def plain_one_process(tmp_path_factory) -> Path:
    """:func:`one_process` of ``RUN`` alone, run once for both decodings of the test below."""
    with pytest.MonkeyPatch.context() as patch:
        return one_process(tmp_path_factory.mktemp("reference"), patch)


@pytest.mark.parametrize("decoding", ["through the policy", "on a copy"])
def test_two_fsdp2_processes_train_like_one_process(tmp_path, plain_one_process, decoding):
    """Rollouts on a copy of the sharded policy's gathered weights (the backend's choice for a
    small model, rollout/sharded_decoding.py), or through the policy: either way as one process trains."""
    one = plain_one_process
    through = ["backend.name=cpu_through"] if decoding == "through the policy" else []
    # per rank: the same global batch
    two = launch(tmp_path, "two", "trainer=fsdp_cpu", "data.prompts_per_step=2", *through)
    m1, m2 = metrics(one), metrics(two, "rollout/sharded_on_copy")
    assert m2["rollout/sharded_on_copy"] == [float(not through)] * 2  # which way each step's rollouts went
    said = [line for line in (two / "stderr.txt").read_text().splitlines() if line.startswith("ngrpo: decoding")]
    assert len(said) == 1, said  # the first rank says it, once
    assert ("on a copy" in said[0]) == (not through) and ("eagerly" in said[0]) == bool(through)
    assert m1["train/response_length_mean"] == [6.0, 6.0]  # equal token counts: token-mean losses average exactly
    assert m1["train/loss"][0] != 0.0
    for key in KEYS:
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-5), key
    assert (two / "checkpoints/last.ckpt").is_dir()  # sharded checkpoint
    w1, w2 = policy_weights(one / "checkpoints/last.ckpt"), policy_weights(two / "checkpoints/last.ckpt")
    assert w1.keys() == w2.keys()
    initial = policy_weights_initial()
    moved = [k for k in w1 if not torch.allclose(w1[k], initial[k])]
    assert moved, "training changed no weight"
    # Adam divides by sqrt(v): where a gradient is ~0 its update (up to lr = 1e-2 per step) amplifies
    # fp32 summation-order noise; 1e-4 is 1% of one step (measured max: 1.8e-5, in 3 of 110k weights)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-4, msg=k)
    # the distributed checkpoint exports, in one process, to the Hugging Face model of its policy
    from safetensors.torch import load_file

    assert main(["export", str(two), str(tmp_path / "hf"), "--no-mlflow"]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported and all(torch.equal(v, w2[f"policy.{k}"]) for k, v in exported.items())


def test_two_fsdp2_processes_train_lora_adapters_like_one_process_and_resume_exactly(tmp_path, monkeypatch):
    """model.lora under FSDP2: after 2 steps, the same losses and adapter weights as one process;
    checkpoints hold the adapters only, and the sharded one exports to peft's format. A third step,
    then again from the step-2 checkpoint: the adapters, the optimizer's work and the losses are bit
    for bit those of the 3 sharded steps in one go. (Against one unsharded process the sharded run
    agrees to summation order only, which AdamW at lr 5e-2 amplifies where a gradient is near 0:
    2e-4 after 3 steps on an AVX2 CPU; so that comparison is after step 2.)"""
    pytest.importorskip("peft")
    lora = ["model.lora.enabled=true", "model.lora.rank=4", "optim.lr=5e-2"]
    one = one_process(tmp_path, monkeypatch, *lora)
    sharded = [*lora, "trainer=fsdp_cpu", "data.prompts_per_step=2", "trainer.max_steps=3"]
    sharded += ["checkpoint.every_n_steps=1", "checkpoint.keep=-1"]
    two = launch(tmp_path, "two", *sharded)
    m1, m2 = metrics(one), metrics(two)
    assert m1["train/loss"][0] != 0.0 and m1["train/kl_ref"][1] > 0  # step 2's policy left its base (the reference)
    for key in KEYS:
        assert m2[key][:2] == pytest.approx(m1[key], rel=1e-4, abs=1e-5), key
    w1, w2 = policy_weights(one / "checkpoints/last.ckpt"), policy_weights(two / "checkpoints/step-2.ckpt")
    assert w1 and all(".lora_" in k for k in w1)  # adapters only, no base weights
    assert w1.keys() == w2.keys()
    assert any("lora_B" in k and w1[k].abs().sum() > 0 for k in w1)  # B starts at 0: training moved it
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-4, msg=k)
    assert main(["export", str(two), str(tmp_path / "peft"), "--no-mlflow"]) == 0
    assert (tmp_path / "peft" / "adapter_config.json").is_file()

    final, losses = policy_weights(two / "checkpoints/last.ckpt"), m2["train/loss"]
    assert launch(tmp_path, "two", *sharded, f"resume={two}/checkpoints/step-2.ckpt") == two
    again = policy_weights(two / "checkpoints/last.ckpt")
    assert again.keys() == final.keys()
    for k in final:
        assert torch.equal(again[k], final[k]), k
    resumed = metrics(two)["train/loss"]  # step 3 logged twice: by the whole run, then by the resumed one
    assert len(resumed) == 4 and resumed[:2] == losses[:2] and resumed[2] == resumed[3] == losses[2]


def test_a_sharded_run_validates_in_batches_evaluates_pass_at_k_and_exports(tmp_path):
    """Validation before the fit in several batches, Pass@k and the final export at its end, under
    FSDP2, the processes started as by ``ngrpo train trainer=fsdp_cpu`` alone. Pass@k's engine
    decodes the rollouts' copy of the gathered weights (it had been handed the layers without
    FSDP2's root, and failed); the export reads the sharded checkpoint on the first rank alone (it
    had waited for the other ranks, gone, and failed)."""
    from mlflow import MlflowClient
    from safetensors.torch import load_file

    out = launch(
        tmp_path, "passk", "trainer=fsdp_cpu", "data.prompts_per_step=2", "trainer.max_steps=1",
        "validate_before_fit=true", "data.val_size=8", "rollout.val_batch_size=2", "pass_at_k.n=2",
        "export.final=true", torchrun=False,
    )  # fmt: skip
    client = MlflowClient(f"sqlite:///{out}/mlruns.db")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])  # a store per run
    assert {"val/accuracy", "val/avg/pass_at_2", "val/avg/pass_at_1"} <= run.data.metrics.keys()
    assert run.data.metrics["rollout/sharded_on_copy"] == 1.0
    trained = policy_weights(out / "checkpoints/last.ckpt")
    exported = load_file(out / "hf_model/model.safetensors")
    assert exported and all(torch.equal(v, trained[f"policy.{k}"]) for k, v in exported.items())
    assert any(not torch.equal(v, policy_weights_initial()[f"policy.{k}"]) for k, v in exported.items())


def test_a_sharded_save_that_finds_the_disk_full_says_so_once_and_leaves_nothing_half_written(tmp_path, small_disk):
    """The distributed checkpoint (the tiny model's weights and AdamW's moments, 37 MiB) on a disk of
    20 MiB, the processes started as ``ngrpo train trainer=fsdp_cpu`` starts them: the checkpoint
    writer's one line, said once (every rank raised PyTorch's CheckpointException, a traceback each),
    and no partial folder left to hold the space (it stayed until the next save)."""
    python, driver = scripted_cli(tmp_path, THROUGH)
    out = small_disk("20m") / "run"
    args = [*RUN, "trainer=fsdp_cpu", "data.prompts_per_step=2", "trainer.max_steps=1", "logger=none"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [python, driver, "train", *args, f"output_dir={out}"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    line = f"ngrpo train: error: checkpoint {out}/checkpoints/last.ckpt was not written: its disk is full"
    assert proc.returncode == 1 and proc.stderr.count(line) == 1, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "now deleted" in proc.stderr
    assert list((out / "checkpoints").iterdir()) == []


def test_sharded_dynamic_sampling_rolls_out_as_many_extra_batches_on_every_rank(tmp_path):
    """train.dynamic_sampling over two FSDP2 processes whose rollouts are collectives (through the
    sharded policy): the first rank's first batch is all correct and needs an extra one, the
    second's is informative. Both roll out the extra batch (the second rank alone would have left
    the collectives); each trains on its informative groups."""
    # the first rank's first batch all correct, then mixed; the second rank's always mixed
    by_rank = SCRIPTED_CLI.replace(
        "ScriptedReward((1, 0))",
        "(ScriptedReward((1, 1), (1, 0)) if int(os.environ.get('LOCAL_RANK', 0)) == 0 else ScriptedReward((1, 0)))",
    ).replace("import sys\n", "import os, sys\n", 1)
    out = launch(
        tmp_path, "dapo", "trainer=fsdp_cpu", "data.prompts_per_step=2", "backend.name=cpu_through",
        "train.dynamic_sampling=true", driver_text=by_rank,
    )  # fmt: skip
    m = metrics(out, "dynamic/extra_rollouts", "dynamic/kept_groups", "dynamic/dropped_groups")
    assert m["dynamic/extra_rollouts"] == [1.0, 0.0]  # on every rank, averaged over them
    assert m["dynamic/dropped_groups"] == [1.0, 0.0]  # the first rank's 2 groups, averaged over the 2 ranks
    assert m["dynamic/kept_groups"] == [2.0, 2.0]


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_two_fsdp2_processes_roll_out_ahead_like_one_process_and_resume_exactly(tmp_path, monkeypatch, adapters):
    """train.max_staleness=1 under FSDP2: each rank's worker decodes a plain model of the gathered
    weights (LoRA: of the base, with the jobs' adapters), queued at the same steps as in one process,
    so the stale batches and their corrections are one process's; a checkpoint holds every rank's
    rollouts in flight, and resuming from it gives the same steps and weights again (full fine-tuning)."""
    lora = ["model.lora.enabled=true", "model.lora.rank=4", "optim.lr=5e-2"] if adapters else []
    ahead = ["train.max_staleness=1", "trainer.max_steps=3", *lora]
    one = one_process(tmp_path, monkeypatch, *ahead)
    sharded = [
        *ahead,
        "trainer=fsdp_cpu",
        "data.prompts_per_step=2",
        "checkpoint.every_n_steps=2",
        "checkpoint.keep=-1",
    ]
    two = launch(tmp_path, "two", *sharded)
    more = ("async/weights_version", "train/tis_weight_mean")
    m1, m2 = metrics(one, *more), metrics(two, *more)
    assert m1["async/weights_version"] == m2["async/weights_version"] == [0.0, 0.0, 1.0]
    assert m1["train/tis_weight_mean"][1] != pytest.approx(1.0, abs=1e-6)  # batch 1 is stale, and corrected
    # two ranks sum the gradients in another order than one process; two updates at lr 5e-2 (LoRA)
    # grow that float32 rounding: 1.1e-4 relative in step 3's grad norm on an AVX2 machine
    for key in KEYS + list(more):
        assert m2[key] == pytest.approx(m1[key], rel=5e-4, abs=1e-5), key
    final = policy_weights(two / "checkpoints/last.ckpt")
    w1 = policy_weights(one / "checkpoints/last.ckpt")
    assert w1.keys() == final.keys() and all(".lora_" in k for k in w1) == adapters
    for k in w1:
        torch.testing.assert_close(final[k], w1[k], rtol=1e-4, atol=1e-4, msg=k)
    if adapters:
        return
    launch(tmp_path, "two", *sharded, f"resume={two}/checkpoints/step-2.ckpt")
    again = policy_weights(two / "checkpoints/last.ckpt")
    for k in final:
        assert torch.equal(again[k], final[k]), k
    resumed = metrics(two, *more)  # step 3 logged twice: by the whole run, then by the resumed one
    assert {key: values[:2] + values[3:] for key, values in resumed.items()} == m2


def policy_weights_initial() -> dict[str, torch.Tensor]:
    from ngrpo_lightning.models.loading import load_policy

    model, _ = load_policy("tiny")
    return {f"policy.{k}": v for k, v in model.state_dict().items()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without GPUs")
def test_fsdp_without_gpus_points_to_fsdp_cpu(capsys):
    with pytest.raises(ConfigError, match="no CUDA GPU.*trainer=fsdp_cpu"):
        check_trainer(compose(["trainer=fsdp"]))
    assert main(["train", "trainer=fsdp", "model=tiny", "logger=none"]) == 2
    assert "trainer=fsdp_cpu" in capsys.readouterr().err


def test_bad_parallel_option_names_the_key():
    with pytest.raises(ConfigError, match="trainer.parallel.mixed_precision='fp8'"):
        check_trainer(compose(["trainer=fsdp_cpu", "trainer.parallel.mixed_precision=fp8"]))
    with pytest.raises(ConfigError, match="trainer.parallel.cpu_offload=true"):
        check_trainer(compose(["trainer=fsdp_cpu", "trainer.parallel.cpu_offload=true"]))
    with pytest.raises(ConfigError, match="trainer.parallel: .*unexpected keyword"):
        check_trainer(compose(["trainer=fsdp_cpu", "+trainer.parallel.shards=3"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fsdp_on_gpus_trains(tmp_path):  # pragma: no cover - no GPU in CI
    launch(tmp_path, "gpu", "trainer=fsdp", "trainer.devices=2", "data.prompts_per_step=2")


def test_prompts_are_split_by_rank_evenly_and_resume_mid_pass():
    from ngrpo_lightning.rollout.prompt_order import PromptStream

    def rows(stream):  # one pass, each batch trained on
        out = []
        for batch in stream:
            out += [row for row, _ in batch]
            stream.consumed(batch[0][1])
        return out

    shares = [rows(PromptStream(10, seed=1, shuffle=True, batch_size=2, rank=r, world_size=2)) for r in (0, 1)]
    assert len(shares[0]) == len(shares[1]) == 4  # whole batches, the same number on every rank
    assert not set(shares[0]) & set(shares[1])  # a prompt (and so its G samples) is on one rank
    whole = PromptStream(10, seed=1, shuffle=True, batch_size=4)
    passes = [rows(whole), rows(whole)]
    assert passes[0] != passes[1] and all(len(set(p)) == 8 for p in passes)  # a new shuffle per pass, whole batches
    assert whole.following((0, 1), 3) == [(1, 0), (1, 1), (2, 0)]  # what rollouts ahead queue: the same order
    assert whole.rows((1, 1)) == passes[1][4:]
    resumed = PromptStream(10, seed=1, shuffle=True, batch_size=4)
    resumed.load_state_dict({"epoch": 1, "batches_in_epoch": 1})
    assert next(iter(resumed))[0][1] == (1, 1) and list(resumed) == list(resumed)  # reading does not move it
    assert rows(resumed) == passes[1][4:]
    assert resumed.state_dict() == {"epoch": 2, "batches_in_epoch": 0}  # the next pass starts fresh


def test_the_process_count_is_computed_once_with_lightnings_meaning_of_devices():
    from ngrpo_lightning.build.trainer import process_count

    assert process_count(compose(["trainer=fsdp_cpu"])) == 2
    assert process_count(compose(["trainer=fsdp_cpu", "trainer.num_nodes=2"])) == 4  # a key of its own now
    assert process_count(compose(["trainer=cpu", "trainer.devices=auto"])) == 1  # a CPU accelerator: one process
    gpus = torch.cuda.device_count()
    assert process_count(compose(["trainer=gpu", "trainer.devices=auto"])) == gpus  # every GPU, 0 here without one
    assert process_count(compose(["trainer=gpu", "trainer.devices='0,1'"])) == 2
    assert process_count(compose(["trainer=gpu", "trainer.devices=[0,1,2]"])) == 3
