"""One builder for both doors: what ``ngrpo train`` builds, and what a script builds.

A script writes::

    import lightning as L
    from ngrpo_lightning import build_run

    run = build_run(["model=tiny", "trainer.max_steps=20"], explorer=MyExplorer(rho=0.2))
    trainer = L.Trainer(**run.trainer_kwargs(logger=my_logger))
    trainer.fit(run.module, datamodule=run.datamodule)

and gets what the command gets: settings checked before anything loads, threads and seed (:func:`prepare_process`),
the module and DataModule (:func:`assemble`), and the Trainer's arguments (:meth:`Run.trainer_kwargs`).
``ngrpo train`` adds the header, resuming, the output folder's claim, the MLflow run and the summary."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import lightning as L
from omegaconf import DictConfig, OmegaConf

from ngrpo_lightning.backends.threads import ProcessThreads, set_process_threads
from ngrpo_lightning.build.components import build_module, build_pass_at_k, check_config
from ngrpo_lightning.build.data import build_datamodule, build_problems
from ngrpo_lightning.build.trainer import processes_per_node, trainer_kwargs
from ngrpo_lightning.config import compose, config_dir
from ngrpo_lightning.rollout import RolloutDataModule
from ngrpo_lightning.tracking.components import user_experiment_name
from ngrpo_lightning.training.module import RLModule

__all__ = ["KNOWN_WARNINGS", "Run", "assemble", "build_run", "prepare_process"]

# Lightning warnings that are expected here and would only bury the run's own output.
KNOWN_WARNINGS = (
    r"Found \d+ module\(s\) in eval mode",  # the frozen reference model, on purpose
    r"Using ModelCheckpoint with manual optimization",  # checkpoints are taken between steps
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"Checkpoint directory .* exists and is not empty",  # the run's own: claim_output_dir decided on it first
    r"Total length of `\w+` across ranks is zero",  # a task without a validation set: nothing to validate
    # one process whose vLLM engine started torch.distributed (a group of 1): nothing to reduce over
    r"It is recommended to use `self\.log\('[\w/]+', \.\.\., sync_dist=True\)`",
)


@dataclass
class Run:
    """A built run: its config, ``module`` (the LightningModule), ``datamodule`` (rollouts of the
    current policy), ``problems`` (train, validation) and this process's ``threads``."""

    cfg: DictConfig
    module: RLModule
    datamodule: RolloutDataModule
    problems: tuple
    threads: ProcessThreads

    def trainer_kwargs(self, logger=None, callbacks: Sequence[L.Callback] = ()) -> dict:
        """The ``lightning.Trainer`` arguments that train this run as ``ngrpo train`` does (``trainer.*``, strategy,
        checkpoint writer, the run's callbacks and ``callbacks``); ``logger`` any Lightning logger, or None."""
        pass_at_k = build_pass_at_k(self.cfg, self.problems[1])
        return trainer_kwargs(self.cfg, logger, [*pass_at_k, *callbacks])


def default_experiment() -> str:
    """The MLflow experiment a run logs to when neither its experiment preset nor the user names one."""
    return str(OmegaConf.load(config_dir() / "config.yaml").experiment_name)


def prepare_process(cfg: DictConfig) -> ProcessThreads:
    """Before anything loads: expected warnings silenced, every setting checked, the seed set, a run of
    a user's own classes given its own experiment, and this process's threads (returned)."""
    for pattern in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    check_config(cfg)  # every component, setting, trainer and engine is checked before any model or data loads
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    if cfg.experiment_name == default_experiment() and (named := user_experiment_name(cfg)):
        cfg.experiment_name = named  # a user's classes do not land among the default experiment's runs
    return set_process_threads(cfg.backend.get("threads"), processes_per_node(cfg))  # before anything computes


def assemble(cfg: DictConfig, problems, *, explorer=None, objective=None, backend_choices: dict | None = None):
    """``(module, datamodule)`` of a prepared config (:func:`prepare_process`) and its problems."""
    module = build_module(cfg, backend_choices=backend_choices, explorer=explorer, objective=objective)
    return module, build_datamodule(cfg, module.tokenizer, problems)


def build_run(
    overrides: Sequence[str] | DictConfig = (),
    *,
    explorer=None,
    objective=None,
) -> Run:
    """A run as ``ngrpo train`` builds it, from command-line overrides or a composed config;
    ``explorer`` and ``objective``: your own objects in place of the config's (checked alike)."""
    cfg = overrides if isinstance(overrides, DictConfig) else compose(list(overrides))
    threads = prepare_process(cfg)
    problems = build_problems(cfg.data, cfg.seed)
    module, datamodule = assemble(cfg, problems, explorer=explorer, objective=objective)
    return Run(cfg, module, datamodule, problems, threads)
