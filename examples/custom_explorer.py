"""Train the packaged SmolLM2 on the built-in task with an explorer written here, from Python:
Lightning's own Trainer and MLFlowLogger, the run built as `ngrpo train` builds it (build_run),
then Pass@4 of the trained policy on the validation problems.

    python examples/custom_explorer.py                       # 15 steps (minutes on a laptop CPU)
    NGRPO_EXAMPLE_STEPS=2 python examples/custom_explorer.py # a short run
    env $(ngrpo env) python examples/custom_explorer.py      # on the allocator and spin `ngrpo train` sets
"""

import os
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import MLFlowLogger

from ngrpo_lightning import Explorer, ExplorerStep, TemperatureExplorer, build_run


class UncertainTopTwo(Explorer):
    """Where the policy is unsure (its two likeliest tokens within `margin` of each other), the next
    input is the mixture of their embeddings, weighted by their probabilities, and the likelier one
    is emitted; elsewhere a token is sampled as usual."""

    def __init__(self, margin: float = 0.2, temperature: float = 1.0):
        self.margin, self.temperature = margin, temperature
        self.sampler = TemperatureExplorer(temperature)

    def step(self, logits, generator=None):
        top = torch.softmax(logits / self.temperature, dim=-1).topk(2, dim=-1)
        mixed = top.values[:, 0] - top.values[:, 1] < self.margin
        tokens = torch.where(mixed, top.indices[:, 0], self.sampler.step(logits, generator).tokens)
        weights = top.values / top.values.sum(dim=-1, keepdim=True)
        return ExplorerStep(tokens=tokens, mixed=mixed, ids=top.indices, weights=weights)


def main() -> dict[str, float]:
    steps = int(os.environ.get("NGRPO_EXAMPLE_STEPS", "15"))
    run = build_run(
        [f"trainer.max_steps={steps}", "pass_at_k.n=4", "output_dir=outputs/python-api"],
        explorer=UncertainTopTwo(margin=0.2),
    )
    Path("mlruns").mkdir(exist_ok=True)
    logger = MLFlowLogger(experiment_name="python-api", tracking_uri="sqlite:///mlruns/mlflow.db")
    trainer = L.Trainer(**run.trainer_kwargs(logger=logger))
    trainer.fit(run.module, datamodule=run.datamodule)
    scores = {k: float(v) for k, v in trainer.callback_metrics.items() if "pass@" in k}
    for name, value in sorted(scores.items()):
        print(f"{name}: {value:.3f}")
    return scores


if __name__ == "__main__":
    main()
