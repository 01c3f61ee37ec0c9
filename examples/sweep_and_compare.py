"""Two arms, GRPO and N-GRPO, over a few seeds from Python, then `ngrpo compare`'s report of them:
Pass@k with intervals, the verdict on their difference, and what more seeds would tell.

    python examples/sweep_and_compare.py        # 2 arms x 3 seeds of the packaged model, 15 steps each
    NGRPO_EXAMPLE_STEPS=1 NGRPO_EXAMPLE_SEEDS=2 NGRPO_EXAMPLE_MODEL=tiny python examples/sweep_and_compare.py
"""

import os

from ngrpo_lightning import compare, compose, train


def main() -> dict:
    steps = int(os.environ.get("NGRPO_EXAMPLE_STEPS", "15"))
    seeds = int(os.environ.get("NGRPO_EXAMPLE_SEEDS", "3"))
    model = os.environ.get("NGRPO_EXAMPLE_MODEL", "smollm2")
    for experiment in ("grpo", "ngrpo"):  # each arm logs to the MLflow experiment of its name
        for seed in range(seeds):
            overrides = [f"experiment={experiment}", f"seed={seed}", f"model={model}", f"trainer.max_steps={steps}"]
            train(compose([*overrides, "pass_at_k.n=4", f"output_dir=outputs/arms/{experiment}-{seed}"]))
    report = compare(compose(["experiments=[grpo,ngrpo]", "output_dir=outputs/arms/compare"], "compare"))
    print(report["text"])
    return report


if __name__ == "__main__":
    main()
