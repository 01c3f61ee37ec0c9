"""One builder for both doors: what ``ngrpo train`` builds, and what a script builds.

A script writes::

    import lightning as L
    from ngrpo_lightning import build_run

    run = build_run(["model=tiny", "trainer.max_steps=20"], explorer=MyExplorer(rho=0.2))
    trainer = L.Trainer(**run.trainer_kwargs(logger=my_logger))
    trainer.fit(run.module, datamodule=run.datamodule)

and gets what the command gets, through the same functions: every setting checked before anything
loads (:func:`prepare_process`), the process's threads and seed, the backend chosen for its device,
the module and the rollout DataModule (:func:`assemble`), and the Trainer's strategy, checkpoint
writer and callbacks (:meth:`Run.trainer_kwargs`). ``ngrpo train`` adds only what a command does
around them: the header, resuming, the output folder's claim, its MLflow run and the summary.
"""

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
    # one process whose vLLM engine started torch.distributed (a group of 1): nothing to reduce over;
    # several processes log with sync_dist=True and never see it
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
        """The arguments of a ``lightning.Trainer`` that trains this run as ``ngrpo train`` does:
        ``trainer.*``, the strategy, the checkpoint writer and the run's callbacks (Pass@k on the
        validation problems where ``pass_at_k.n`` > 0) beside ``callbacks``; ``logger`` any
        Lightning logger (``MLFlowLogger``), or None for none."""
        pass_at_k = build_pass_at_k(self.cfg, self.problems[1])
        return trainer_kwargs(self.cfg, logger, [*pass_at_k, *callbacks])


def default_experiment() -> str:
    """The MLflow experiment a run logs to when neither its experiment preset nor the user names one."""
    return str(OmegaConf.load(config_dir() / "config.yaml").experiment_name)


def prepare_process(cfg: DictConfig) -> ProcessThreads:
    """Before anything loads: the warnings this framework expects silenced, every component and
    setting checked, the seed set, the experiment of a
    run of a user's own classes named by them, and this process's threads (how many, decided the same
    way however it was launched). Returns the threads."""
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
    """A run as ``ngrpo train`` builds it, from config overrides (``["model=tiny",
    "trainer.max_steps=20"]``, as on the command line) or a composed config; ``explorer`` and
    ``objective``: objects of your own, in place of the config's (checked as the config's are)."""
    cfg = overrides if isinstance(overrides, DictConfig) else compose(list(overrides))
    threads = prepare_process(cfg)
    problems = build_problems(cfg.data, cfg.seed)
    module, datamodule = assemble(cfg, problems, explorer=explorer, objective=objective)
    return Run(cfg, module, datamodule, problems, threads)
