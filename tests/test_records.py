"""A run of a user's own explorer can be run again from its record: MLflow's params hold every
setting the explorer and objective ran with, defaults included (read from the built objects), the
user's module is logged with its hash, the run lands in an experiment named by its classes, and a
run made again from the recorded params steps as the first one did."""

import hashlib
import json
from pathlib import Path

from conftest import ScriptedReward, fresh_store
from mlflow import MlflowClient

from ngrpo_lightning.commands.cli import train
from ngrpo_lightning.config import compose
from ngrpo_lightning.explorers import TemperatureExplorer

RUN = [
    "model=tiny",
    "data.train_size=4",
    "data.val_size=0",
    "data.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "trainer.max_steps=1",
    "logger.log_samples_every=0",
    "validate_before_fit=false",
    "trainer.enable_progress_bar=false",
    "optim.lr=1e-2",
]


class Bonus(TemperatureExplorer):
    """Plain sampling with ``bonus`` added to the logits of the first ``width`` tokens: settings whose
    defaults the config never sees when the run names the class alone."""

    def __init__(self, bonus: float = 3.0, width: int = 64, temperature: float = 1.0, top_k: int = 0):
        super().__init__(temperature=temperature, top_k=top_k)
        self.bonus, self.width = float(bonus), int(width)

    def step(self, logits, generator=None):
        shifted = logits.clone()
        shifted[:, : self.width] += self.bonus
        return super().step(shifted, generator)


def first_step(store: str, run_id: str) -> dict[str, float]:
    client = MlflowClient(store)
    keys = ("train/loss", "train/grad_norm", "train/entropy", "train/kl_ref", "train/response_length_mean")
    return {k: client.get_metric_history(run_id, k)[0].value for k in keys}


def test_a_user_explorers_run_is_recorded_whole_and_runs_again_from_its_params(tmp_path, monkeypatch):
    monkeypatch.setattr("ngrpo_lightning.build.components.build_reward", lambda cfg: ScriptedReward((1, 0)))
    store = fresh_store(tmp_path / "mlruns.db")
    first = train(
        compose(
            [*RUN, "explorer._target_=test_records.Bonus", f"logger.tracking_uri={store}", f"output_dir={tmp_path}/a"]
        )
    )
    client = MlflowClient(store)
    run = client.get_run(first["run_id"])
    assert client.get_experiment(run.info.experiment_id).name == "Bonus-grpo"  # not among the default's runs
    params = run.data.params
    # the explorer's settings as it ran, defaults included; the objective's too
    assert {k: params[k] for k in ("explorer.bonus", "explorer.width", "explorer.top_k")} == {
        "explorer.bonus": "3.0",
        "explorer.width": "64",
        "explorer.top_k": "0",
    }
    assert {"objective.clip_low", "objective.clip_high", "objective.kl_coef"} <= set(params)
    described = json.loads(
        Path(client.download_artifacts(run.info.run_id, "components.json", str(tmp_path))).read_text()
    )
    assert described["explorer"] == {
        "class": "test_records.Bonus",
        "settings": {"bonus": 3.0, "width": 64, "temperature": 1.0, "top_k": 0},
    }
    # the user's module, logged with its hash
    source = Path(__file__).read_bytes()
    assert run.data.tags["ngrpo.code.test_records"] == hashlib.sha256(source).hexdigest()
    assert {a.path for a in client.list_artifacts(run.info.run_id, "code")} == {"code/test_records.py"}
    # the user's code changes its default later; run again from the recorded params: the same first step
    monkeypatch.setattr(Bonus.__init__, "__defaults__", (0.0, 64, 1.0, 0))
    recorded = [f"{k}={v}" for k, v in params.items() if k.startswith(("explorer.", "objective.")) and v != "None"]
    again = train(compose([*RUN, *recorded, f"logger.tracking_uri={store}", f"output_dir={tmp_path}/b"]))
    assert first_step(store, again["run_id"]) == first_step(store, first["run_id"])
    changed = train(
        compose(
            [*RUN, "explorer._target_=test_records.Bonus", f"logger.tracking_uri={store}", f"output_dir={tmp_path}/c"]
        )
    )
    assert first_step(store, changed["run_id"]) != first_step(store, first["run_id"])  # the record was needed
    assert first_step(store, first["run_id"])["train/grad_norm"] > 0  # a real update to compare
