"""VLLMEngine on the packaged SmolLM2 in fp32: real vLLM (the CPU build), explorers inside
its decoding loop, weight sync; and short training runs with ``rollout.engine=vllm`` on a tiny
model, whose steps take a second where the packaged model's take ten."""

import copy
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import NEEDS_VLLM, chat_prompt_ids, fresh_store, scripted_cli

from ngrpo_lightning.checkpoints.safe_load import load_checkpoint

pytestmark = NEEDS_VLLM

QUESTIONS = ["What is 12 + 30?", "Compute 7 * 8.", "What is 100 - 37?"]


@pytest.fixture(scope="module")
def engine(smollm2):
    """An engine for the live policy (its directory, its dtype: float32)."""
    from ngrpo_lightning.rollout.vllm_engine import VLLMEngine

    policy, tok = smollm2
    eng = VLLMEngine.from_policy(policy, tok, max_new_tokens=24, seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts(smollm2):
    return chat_prompt_ids(smollm2[1], QUESTIONS)


def greedy():
    from ngrpo_lightning.explorers import TemperatureExplorer

    return TemperatureExplorer(temperature=0.0)


def test_the_engine_runs_model_runner_v1_by_its_own_choice(engine):
    """The runner the explorers are patched into is asked for (not left to vLLM's default,
    which is V2 wherever Triton imports: every GPU build) and is the one vLLM started."""
    import os

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as ModelRunnerV1

    from ngrpo_lightning.compat.vllm import PATCHED_RUNNER

    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert engine.llm.llm_engine.vllm_config.use_v2_model_runner is False
    assert isinstance(engine.runner, ModelRunnerV1) and engine.runner.ngrpo_patched
    assert engine.runner_class == f"{type(engine.runner).__module__}.{type(engine.runner).__qualname__}"
    assert PATCHED_RUNNER == f"{ModelRunnerV1.__module__}.{ModelRunnerV1.__qualname__}"


def test_greedy_rollouts_equal_hf_engine(engine, smollm2, prompts):
    from ngrpo_lightning.rollout import HFEngine

    ours = engine.generate(prompts, greedy(), n=1)
    ref = HFEngine(smollm2[0], smollm2[1], max_new_tokens=24).generate(prompts, greedy(), n=1)
    assert torch.equal(ours.response_ids, ref.response_ids)
    assert torch.equal(ours.response_mask, ref.response_mask)
    assert ours.response_text == ref.response_text
    assert torch.equal(ours.truncated, ref.truncated)
    assert (ours.rollout_logprobs - ref.rollout_logprobs).abs().max() < 1e-4
    assert len(ours.records) == 0


def _explorers():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))
    from top_two_blend import TopTwoBlend  # the user-written explorer of docs/explorers.md

    from ngrpo_lightning.explorers import (
        GaussianNoiseExplorer,
        GumbelSoftExplorer,
        NeighborMixingExplorer,
        OrthogonalNoiseExplorer,
    )

    return {
        "neighbor": NeighborMixingExplorer(k=3, rho=0.5, temperature=1.0),
        "gaussian": GaussianNoiseExplorer(sigma=0.5, rho=0.5),
        "gumbel": GumbelSoftExplorer(),
        "orthogonal_noise": OrthogonalNoiseExplorer(k=3, rho=0.5),  # the release's baseline
        "user-written": TopTwoBlend(rho=0.5),
    }


@pytest.mark.parametrize("name", ["neighbor", "gaussian", "gumbel", "orthogonal_noise", "user-written"])
def test_records_reconstruct_vllm_logprobs(engine, smollm2, prompts, name):
    """Training's forward rebuilds the mixed inputs from the records and gets vLLM's log-probs;
    ignoring the records it does not (so the mixtures really were vLLM's inputs)."""
    from ngrpo_lightning.training.forward import response_logprobs

    explorer = _explorers()[name]
    batch = engine.generate(prompts, explorer, n=4)
    mask = batch.response_mask.bool()
    tokens = int(mask.sum())
    assert len(batch.records) > 0
    with torch.no_grad():
        logp, _ = response_logprobs(smollm2[0], batch, explorer.temperature or 1.0)
        plain, _ = response_logprobs(smollm2[0], batch, explorer.temperature or 1.0, use_records=False)
    assert (logp - batch.rollout_logprobs)[mask].abs().max() <= 1e-3
    assert (plain - batch.rollout_logprobs)[mask].abs().max() > 0.1
    rho = getattr(explorer, "rho", None)
    if rho is not None:  # the fraction of mixed steps matches rho (binomial, 4 standard deviations)
        frac = len(batch.records) / tokens
        assert abs(frac - rho) <= 4 * math.sqrt(rho * (1 - rho) / tokens), (frac, tokens)
    assert bool((batch.records.pos < batch.response_lengths[batch.records.row]).all())


def synced_like_hf_engine(engine, model, smollm2, prompts, before) -> None:
    """Sync ``model`` into vLLM: its greedy rollouts change from ``before`` and equal HFEngine's
    on ``model``; the live policy's weights are synced back after."""
    from ngrpo_lightning.rollout import HFEngine
    from ngrpo_lightning.rollout.engine import full_named_tensors

    policy, tok = smollm2
    try:
        engine.sync_weights(full_named_tensors(model), version=1)
        assert engine.weights_version == 1
        after = engine.generate(prompts, greedy(), n=1)
        ref = HFEngine(model, tok, max_new_tokens=24).generate(prompts, greedy(), n=1)
        assert not torch.equal(after.response_ids, before.response_ids)
        assert torch.equal(after.response_ids, ref.response_ids)
        assert (after.rollout_logprobs - ref.rollout_logprobs).abs().max() < 1e-4
    finally:
        engine.sync_weights(full_named_tensors(policy), version=None)


def test_sync_weights_changes_vllm_output_to_the_new_policy(engine, smollm2, prompts):
    policy, _ = smollm2
    before = engine.generate(prompts, greedy(), n=1)
    changed = copy.deepcopy(policy)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in changed.model.layers[-1].parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05 * p.std())
    synced_like_hf_engine(engine, changed, smollm2, prompts, before)
    assert torch.equal(engine.generate(prompts, greedy(), n=1).response_ids, before.response_ids)


def test_a_lora_policy_reaches_vllm_with_its_adapters_merged(engine, smollm2, prompts):
    from ngrpo_lightning.models import lora
    from ngrpo_lightning.models.loading import load_policy

    before = engine.generate(prompts, greedy(), n=1)
    adapted = lora.apply(load_policy("smollm2-135m-instruct")[0], lora.LoraSettings(enabled=True, rank=8))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in adapted.named_parameters():
            if "lora_B" in name:  # trained adapters: the policy is no longer its base model
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    synced_like_hf_engine(engine, adapted, smollm2, prompts, before)


@pytest.mark.parametrize("experiment", ["ngrpo", "ngrpo-lora"])
def test_three_step_ngrpo_run_with_vllm_logs_to_mlflow(tmp_path, experiment, tiny_vllm_model):
    """`ngrpo train rollout.engine=vllm experiment=ngrpo` (in its own process: one vLLM per process);
    with LoRA adapters (ngrpo-lora), vLLM gets the merged weights after every step. The run validates
    first, as by default: vLLM, built at that rollout under inference mode, still takes the syncs.
    On a tiny model whose rewards are scripted, so every step moves its weights (the tests above
    check vLLM's arithmetic on the packaged model)."""
    from mlflow import MlflowClient

    store = fresh_store(tmp_path / "mlflow.db")
    args = [
        "model=tiny",
        f"model.name_or_path={tiny_vllm_model}",
        "rollout.engine=vllm",
        f"experiment={experiment}",
        "trainer.max_steps=3",
        "data.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=24",
        "data.val_size=4",  # validated before the fit: vLLM starts inside it, under inference mode
        "explorer.rho=0.5",
        "optim.lr=1e-2",
        "train.tis_cap=2.0",
        f"logger.tracking_uri={store}",
        f"output_dir={tmp_path}/out",
        "trainer.enable_progress_bar=false",
        "checkpoint.every_n_steps=0",
    ]
    proc = subprocess.run(
        [*scripted_cli(tmp_path), "train", *args], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(store)
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.data.params["rollout.engine"] == "vllm"
    diffs = client.get_metric_history(run.info.run_id, "train/rollout_logprob_diff_max")
    assert len(diffs) == 3 and all(m.value < 1e-3 for m in diffs)  # synced after every step: no stale weights
    assert all(m.value > 0 for m in client.get_metric_history(run.info.run_id, "train/grad_norm"))  # they moved
    assert all(m.value > 0 for m in client.get_metric_history(run.info.run_id, "explore/mixed_frac"))
    assert len(client.get_metric_history(run.info.run_id, "train/tis_weight_mean")) == 3


def test_eval_with_vllm_equals_eval_with_hf_engine(tmp_path):
    """`ngrpo eval engine=vllm` (greedy) extracts the same answers as the default engine."""
    import json

    from ngrpo_lightning.commands.cli import main

    common = ["data.val_size=6", "n=1", "temperature=0", "max_new_tokens=24", "reward.num_workers=1", "logger=none"]
    assert main(["eval", *common, f"output_dir={tmp_path}/hf"]) == 0
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ngrpo_lightning.commands.cli",
            "eval",
            *common,
            "engine=vllm",
            f"output_dir={tmp_path}/vllm",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    hf, vllm = (
        json.loads((tmp_path / e / "results.json").read_text())["sets"]["reasoning_gym"] for e in ("hf", "vllm")
    )
    assert [p["answers"] for p in vllm["problems"]] == [p["answers"] for p in hf["problems"]]
    assert vllm["metrics"] == hf["metrics"]


def test_no_mixing_after_the_answer_marker_in_vllm(engine, smollm2, prompts):
    """The marker is tracked per request id (rows move between vLLM's steps); each rollout
    starts from the same generator state, so the two rollouts agree up to the marker."""
    from test_explorer_rollouts import check_answer_marker

    from ngrpo_lightning.explorers import NeighborMixingExplorer
    from ngrpo_lightning.training.forward import response_logprobs

    start = engine.state_dict()

    def generate(explorer):
        engine.load_state_dict(copy.deepcopy(start))
        return engine.generate(prompts, explorer, n=2)

    def logprobs_of(batch):
        with torch.no_grad():
            return response_logprobs(smollm2[0], batch, 1.0)[0]

    check_answer_marker(
        generate,
        smollm2[1],
        lambda text: NeighborMixingExplorer(k=3, rho=0.6, emit="sampled", answer_start=text),
        logprobs_of,
    )


def test_rollouts_ahead_drive_the_runs_vllm_from_the_workers_copy(engine, smollm2, prompts):
    """Rollouts ahead with vLLM use the run's one engine: a job queued at version 0 decodes the
    version-0 weights (synced from the worker's copy) although the engine was synced to newer ones
    in between, as a validation does; the job samples from a stream of its own, so the run's other
    rollouts neither move its draws nor are moved by them; the worker never closes the engine."""
    from ngrpo_lightning.explorers import TemperatureExplorer
    from ngrpo_lightning.rollout.ahead import RolloutsAhead
    from ngrpo_lightning.rollout.engine import full_named_tensors
    from ngrpo_lightning.rollout.worker_copy import trainable_snapshot

    policy, _ = smollm2
    live = copy.deepcopy(policy)  # the trainer's policy, which moves while the job waits
    before = engine.generate(prompts, greedy(), n=1)
    greedy_job = lambda e: e.generate(prompts, greedy(), n=1)  # noqa: E731
    sample_job = lambda e: e.generate(prompts, TemperatureExplorer(temperature=1.0), n=2)  # noqa: E731
    no_build = lambda model: pytest.fail("the worker built an engine of its own")  # noqa: E731
    ahead = RolloutsAhead(live, no_build, threads=1, shared_engine=engine)
    try:
        ahead.submit((0, 0), greedy_job, trainable_snapshot(live), 0)
        ahead.settle()  # a validation waits for the worker, then syncs the newer weights
        with torch.no_grad():
            for p in live.model.layers[-1].parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.05 * p.std())
        engine.sync_weights(full_named_tensors(live), version=1)
        newer = engine.generate(prompts, greedy(), n=1)
        assert not torch.equal(newer.response_ids, before.response_ids)
        ahead.submit((0, 1), greedy_job, {}, 0)  # version 0 again: the worker syncs its copy back in
        assert torch.equal(ahead.take((0, 0)).response_ids, before.response_ids)
        assert torch.equal(ahead.take((0, 1)).response_ids, before.response_ids)
        assert engine.weights_version == 0

        engine.generate(prompts, TemperatureExplorer(temperature=1.0), n=2)  # the run's other rollouts draw
        first, again = (RolloutsAhead(live, no_build, threads=1, shared_engine=engine) for _ in range(2))
        try:  # two workers' first jobs: each starts its own stream at the seed, whatever was drawn between
            others = engine.state_dict()["generator"]
            first.submit((1, 0), sample_job, trainable_snapshot(live), 1)
            sampled = first.take((1, 0)).response_ids
            assert torch.equal(engine.state_dict()["generator"], others)  # the job drew from its own stream
            engine.generate(prompts, TemperatureExplorer(temperature=1.0), n=2)
            again.submit((1, 0), sample_job, trainable_snapshot(live), 1)
            assert torch.equal(again.take((1, 0)).response_ids, sampled)
        finally:
            first.close()
            again.close()
        assert engine.weights_version == 1
    finally:
        ahead.close()
        engine.sync_weights(full_named_tensors(policy), version=None)
    assert engine.llm is not None  # still open: the run's later rollouts use it


def test_rollouts_ahead_with_vllm_train_stale_and_resume_exactly(tmp_path, tiny_vllm_model):
    """`ngrpo train rollout.engine=vllm train.max_staleness=1`, validating before the fit and every
    2 steps: batch b decodes the weights after batch max(0, b - 1) (batch 0's rollout log-probs are
    the trainer's, later ones are stale and corrected); resuming from the checkpoint after step 2,
    with the last batch's rollouts in flight, gives the same steps and weights again (a tiny model,
    its rewards scripted: every step moves its weights)."""
    from mlflow import MlflowClient

    store = fresh_store(tmp_path / "mlflow.db")
    args = [
        "model=tiny",
        f"model.name_or_path={tiny_vllm_model}",
        "rollout.engine=vllm",
        "experiment=ngrpo",
        "train.max_staleness=1",
        "trainer.max_steps=3",
        "trainer.val_check_interval=2",
        "data.train_size=8",
        "data.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=16",
        "optim.lr=1e-2",
        "data.val_size=4",
        "reward.num_workers=1",
        "checkpoint.every_n_steps=2",
        "checkpoint.keep=-1",
        f"logger.tracking_uri={store}",
        f"output_dir={tmp_path}/out",
        "trainer.enable_progress_bar=false",
    ]

    def train(*extra):
        proc = subprocess.run(
            [*scripted_cli(tmp_path), "train", *args, *extra], cwd=tmp_path, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-3000:]

    def history(key):
        client = MlflowClient(store)
        [run] = client.search_runs([client.get_experiment_by_name("ngrpo").experiment_id])
        points = {}  # the latest value per step: the resumed run logs step 3 again
        for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp):
            points[m.step] = m.value
        return [v for _, v in sorted(points.items())]

    def weights():
        return load_checkpoint(tmp_path / "out/checkpoints/last.ckpt", mmap=False)["state_dict"]

    train()
    keys = ["train/loss", "train/grad_norm", "train/rollout_logprob_diff_max", "async/weights_version"]
    whole, final = {key: history(key) for key in keys}, weights()
    assert whole["async/weights_version"] == [0, 0, 1]
    diffs = whole["train/rollout_logprob_diff_max"]
    assert diffs[0] < 1e-3 and min(diffs[1:]) > 1e-3  # fresh, then stale by one step
    assert len(history("val/accuracy")) >= 3  # before the fit, at step 2, after
    train("resume=out/checkpoints/step-2.ckpt")
    for key, expected in whole.items():
        assert history(key) == pytest.approx(expected, rel=1e-5, abs=1e-6), key
    again = weights()
    for name in final:
        torch.testing.assert_close(again[name], final[name], rtol=1e-5, atol=1e-6, msg=name)
