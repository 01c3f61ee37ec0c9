"""Training runs read back from the MLflow store, grouped into arms.

An *arm* is the runs of one sweep job's overrides without the seed (tag ``ngrpo.arm``), or, outside a sweep, an MLflow
experiment. Each run brings its metric histories, last per-problem Pass@k and the settings arms must share."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from ngrpo_lightning.config import ConfigError

CURVES = ("train/reward", "val/accuracy", "train/entropy", "explore/mixed_frac")
SPEED = ("time/step_s", "rollout/tokens_per_s")
EXPLORATION = (
    "explore/distinct_answers_frac",
    "explore/distinct_1gram",
    "explore/distinct_2gram",
    "explore/edit_distance_norm",
)
# Settings whose difference makes two arms incomparable: flagged in the report, never averaged over.
BUDGET = (
    "model.name_or_path",
    "data.source",
    "data.tasks",
    "data.train",
    "trainer.max_steps",
    "rollout.group_size",
    "rollout.max_new_tokens",
    "data.prompts_per_step",
    "pass_at_k.n",
)


@dataclass
class RunData:
    run_id: str
    arm: str
    seed: str
    experiment: str
    status: str
    params: dict
    start_ms: int
    curves: dict[str, list[tuple[int, float, float]]] = field(default_factory=dict)  # key: (step, minutes, value)
    pass_at_k: dict | None = None  # results.json of the last Pass@k evaluation
    pass_at_k_step: int | None = None
    code: str = ""  # the commit it ran (``+changes`` when the checkout differed), "" where unknown


def select_runs(client, sweep: str | None, experiments, runs, store: str = "this store") -> list:
    """The MLflow runs of a sweep id, experiments and/or run ids; an unknown name is refused with those in ``store``."""
    if not (sweep or experiments or runs):
        raise ConfigError("ngrpo compare needs sweep=<id>, experiments=[...] or runs=[...]")
    all_experiments = {e.name: e.experiment_id for e in client.search_experiments()}
    found = []
    if sweep:
        found += client.search_runs(list(all_experiments.values()), filter_string=f"tags.`ngrpo.sweep` = '{sweep}'")
        if not found:
            known = sorted(
                {
                    r.data.tags["ngrpo.sweep"]
                    for r in client.search_runs(list(all_experiments.values()))
                    if "ngrpo.sweep" in r.data.tags
                }
            )
            raise ConfigError(f"sweep={sweep!r} has no runs in {store}; sweeps there: {known or 'none'}")
    for name in experiments or []:
        if name not in all_experiments:
            raise ConfigError(f"experiment {name!r} is not in {store}; experiments there: {sorted(all_experiments)}")
        found += client.search_runs([all_experiments[name]])
    for run_id in runs or []:
        try:
            found.append(client.get_run(run_id))
        except Exception as err:  # noqa: BLE001 - MLflow raises its own exception types per store
            recent = [r.info.run_id for r in client.search_runs(list(all_experiments.values()), max_results=5)]
            raise ConfigError(f"run {run_id!r} is not in {store} ({err}); recent runs: {recent}") from err
    unique = {r.info.run_id: r for r in found}
    return [r for r in unique.values() if r.info.run_name not in ("drift", "rollouts")]


def load_run(client, run) -> RunData:
    """A run's arm, seed, settings, metric curves and last Pass@k results."""
    tags, params = run.data.tags, run.data.params
    experiment = client.get_experiment(run.info.experiment_id).name
    data = RunData(
        run_id=run.info.run_id,
        arm=tags.get("ngrpo.arm") or experiment,
        seed=tags.get("ngrpo.seed") or params.get("seed", "?"),
        experiment=experiment,
        status=run.info.status,
        params=params,
        start_ms=run.info.start_time,
        code=code_of(tags),
    )
    along = [k for k in run.data.metrics if k.startswith("val/") and "/pass_at_" in k]  # PassAtK every N steps
    for key in (*CURVES, *SPEED, *EXPLORATION, "rollout/tokens", "reward/error_frac", *along):
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: (m.step, m.timestamp))
        if history:
            data.curves[key] = [(m.step, (m.timestamp - data.start_ms) / 60_000, m.value) for m in history]
    evaluations = [a.path for a in client.list_artifacts(run.info.run_id, "pass_at_k") if a.is_dir]
    if evaluations:
        last = max(evaluations)
        with open(client.download_artifacts(run.info.run_id, f"{last}/results.json")) as f:
            data.pass_at_k = json.load(f)
        data.pass_at_k_step = int(last.rsplit("_", 1)[1])
    return data


def code_of(tags: dict) -> str:
    """The code a run ran, from its tags (:mod:`ngrpo_lightning.tracking.code_version`)."""
    commit = tags.get("mlflow.source.git.commit", "")[:10]
    return commit + ("+changes" if commit and tags.get("ngrpo.git_dirty") == "true" else "")


def code_versions(runs: list[RunData]) -> str:
    """One line on the code the runs ran: one commit, several (with their runs), or unknown."""
    counts = Counter(run.code or "unknown" for run in runs)
    if len(counts) == 1:
        (code,) = counts
        return f"Code: {code} for all {len(runs)} runs." if code != "unknown" else "Code: not recorded."
    listed = ", ".join(f"{code} ({n} run{'s' * (n != 1)})" for code, n in counts.most_common())
    return f"Code: {len(counts)} versions ({listed}); differences between arms may come from the code too."


LEFT_OUT_ERROR_FRAC = 0.2  # a run whose answers failed in the verifier this often measured its verifier


def broken_verifier_runs(runs: list[RunData]) -> list[tuple[RunData, float]]:
    """Runs whose answers got the status ``error`` (a failed check) in more than
    :data:`LEFT_OUT_ERROR_FRAC` of them on average, with that share: their zeros say nothing."""
    out = []
    for run in runs:
        points = [v for _, _, v in run.curves.get("reward/error_frac") or []]
        if points and sum(points) / len(points) > LEFT_OUT_ERROR_FRAC:
            out.append((run, sum(points) / len(points)))
    return out


def budget_mismatches(runs: list[RunData]) -> list[str]:
    """One line per setting of :data:`BUDGET` that is not the same in every run, and one where the runs' last Pass@k
    evaluations come from different optimizer steps (a run stopped early, or one still running)."""
    lines = []
    for key in BUDGET:
        values = {r.params.get(key) for r in runs}
        if len(values) > 1:
            per_arm = sorted({(r.arm, r.params.get(key)) for r in runs})
            lines.append(f"`{key}` differs: " + "; ".join(f"{arm}: {value}" for arm, value in per_arm))
    steps = sorted({(r.arm, r.pass_at_k_step) for r in runs if r.pass_at_k_step is not None})
    if len({step for _, step in steps}) > 1:
        lines.append("the last Pass@k evaluation is of different steps: " + "; ".join(f"{a}: {s}" for a, s in steps))
    return lines
