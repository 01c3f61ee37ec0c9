# %% [markdown]
# # A walk-through: train the tiny model for a few steps, plot its reward and its Pass@k
#
# A notebook in jupytext's percent format (`jupytext --to ipynb examples/walkthrough.py` makes an
# `.ipynb` of it); it runs as a script too: `python examples/walkthrough.py`. The tiny model is a
# random 2-layer Llama with the packaged model's tokenizer: it learns nothing useful, in seconds,
# which is what a walk-through needs. `NGRPO_EXAMPLE_STEPS` sets the steps (default 8).

# %%
import os

import lightning as L
import matplotlib

matplotlib.use("Agg")  # files, not windows: this also runs without a display
import matplotlib.pyplot as plt

from ngrpo_lightning import NeighborMixingExplorer, build_run

steps = int(os.environ.get("NGRPO_EXAMPLE_STEPS", "8"))

# %% [markdown]
# Build the run as `ngrpo train` does: N-GRPO's neighbor mixing (k = 3 nearest tokens, on 30% of
# the steps), the built-in task, Pass@k on the validation problems at the end (n = 4 samples each).

# %%
run = build_run(
    ["model=tiny", f"trainer.max_steps={steps}", "pass_at_k.n=4", "logger=none", "output_dir=outputs/walkthrough"],
    explorer=NeighborMixingExplorer(rho=0.3, k=3),
)


class Rewards(L.Callback):
    """The mean reward of every training step, as the module logs it."""

    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, *args):
        self.values.append(float(trainer.callback_metrics["train/reward"]))


rewards = Rewards()
trainer = L.Trainer(**run.trainer_kwargs(callbacks=[rewards]))
trainer.fit(run.module, datamodule=run.datamodule)

# %% [markdown]
# The reward per step, and Pass@k of the trained policy against k.

# %%
pass_at = {int(k.rsplit("@", 1)[1]): float(v) for k, v in trainer.callback_metrics.items() if "/avg/pass@" in k}
fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3))
left.plot(range(1, len(rewards.values) + 1), rewards.values, marker="o")
left.set(xlabel="step", ylabel="mean reward", title="training reward")
right.plot(sorted(pass_at), [pass_at[k] for k in sorted(pass_at)], marker="o")
right.set(xlabel="k", ylabel="pass@k", title="Pass@k after training", xticks=sorted(pass_at))
fig.tight_layout()
fig.savefig("walkthrough.png", dpi=100)
print(f"rewards: {[round(r, 3) for r in rewards.values]}; pass@k: {pass_at}; plot: walkthrough.png")
