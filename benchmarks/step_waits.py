"""Where a training step makes the host wait for the device, per phase, counted from torch's
dispatcher (``HostSyncs``), so on any machine: one step of the tiny model through Lightning, on
the plain backend (products and attention as the CUDA backend runs them outside decoding),
GRPO with a KL reference, the update in micro-batches.

On a GPU the host queues kernels ahead of the device, and a wait stops it until the device has
run everything queued. Inside a pass (from its first decoder layer through its LM head, the loss
and the backward: ``inside``) that is most of the pass, and the host's launching and the device's
running take turns instead of overlapping; such a pass also cannot be recorded as a CUDA graph.
``before`` counts the rest: selecting a micro-batch, cutting it to its longest row, finding the
prompts a group shares, building masks, and the metrics read at the step's end.

On the CPU every tensor counts as the device's. Reads the dispatcher does not see on a CPU
tensor (``tolist``, ``numpy``) are counted as the copies they are on a GPU, though there some
read tensors the host made (the rows of a micro-batch, in ``RolloutBatch.select``): the total is
an upper bound, ``inside`` is exact.

    python benchmarks/step_waits.py                    # tiny model, micro-batches of 2 rows
    python benchmarks/step_waits.py --lora --objective gspo
"""

from __future__ import annotations

import argparse
import copy
import sys
import traceback
from collections import Counter
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.profilers import Profiler
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, print_table, write_json  # noqa: E402

from ngrpo_lightning.backends.base import Backend  # noqa: E402
from ngrpo_lightning.data import reasoning_gym_problems  # noqa: E402
from ngrpo_lightning.explorers import TemperatureExplorer  # noqa: E402
from ngrpo_lightning.models import lora  # noqa: E402
from ngrpo_lightning.models.loading import load_policy  # noqa: E402
from ngrpo_lightning.objectives import OBJECTIVES  # noqa: E402
from ngrpo_lightning.phases import PREFIX  # noqa: E402
from ngrpo_lightning.rewards.reward import RewardResult  # noqa: E402
from ngrpo_lightning.rollout import RolloutDataModule  # noqa: E402
from ngrpo_lightning.rollout.host_syncs import HostSyncs  # noqa: E402
from ngrpo_lightning.training.module import RLModule  # noqa: E402
from ngrpo_lightning.training.settings import OptimConfig  # noqa: E402

PROJECT = str(Path(__file__).resolve().parents[1] / "ngrpo_lightning")


class CurrentPhase(Profiler):
    """A Lightning profiler that only remembers which step phase (``ngrpo/<name>``) is running."""

    def __init__(self):
        super().__init__()
        self.name = "between phases"

    def start(self, action_name: str) -> None:
        if action_name.startswith(PREFIX):
            self.name = action_name.removeprefix(PREFIX)

    def stop(self, action_name: str) -> None:
        if action_name.startswith(PREFIX):
            self.name = "between phases"

    def summary(self) -> str:
        return ""


class Waits(HostSyncs):
    """Waits per (phase, inside a pass or before it, where in the project, operation), counted
    while ``on``. A pass is inside from its first decoder layer on, through the rest of
    ``response_logprobs``, the objective and the backward; the next wait anywhere else (the next
    pass's preparation) ends it."""

    PASS = ("response_logprobs", "manual_backward", "backward")  # and anything under objectives/

    def __init__(self, phase: CurrentPhase, first_layers: list[torch.nn.Module]):
        super().__init__()
        self.phase, self.on, self.inside, self.seen = phase, False, False, Counter()
        for layer in first_layers:  # the policy's and the reference's
            self._hooks.append(layer.register_forward_pre_hook(self._pass_started))

    def _pass_started(self, *_):
        self.inside = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.on and self._waits(func, args, kwargs):
            self.record(str(func.overloadpacket).removeprefix("aten."))
        return func(*args, **kwargs)

    def record(self, operation: str) -> None:
        stack = traceback.extract_stack()
        in_pass = any(f.name in self.PASS or f"{PROJECT}/objectives/" in f.filename for f in stack)
        self.inside = self.inside and in_pass
        frames = [f for f in stack if f.filename.startswith(PROJECT)]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].name}" if frames else "(Lightning)"
        self.seen[(self.phase.name, "inside" if self.inside else "before", where, operation)] += 1


class Reads(TorchFunctionMode):
    """``tolist()`` and ``numpy()`` of a tensor: on a GPU a copy to the host (a wait the dispatcher
    sees), on the CPU a plain read it does not; counted here as the waits they are on a GPU."""

    def __init__(self, waits: Waits):
        super().__init__()
        self.waits = waits

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.waits.on and getattr(func, "__name__", "") in ("tolist", "numpy"):
            self.waits.record(func.__name__)
        return func(*args, **(kwargs or {}))


def scripted_reward(texts, answers):  # half of each group right: every group has a signal
    scores = torch.tensor([float(i % 2) for i in range(len(texts))])
    return RewardResult(scores=scores, status=["correct" if s else "wrong" for s in scores.tolist()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--objective", default="grpo", choices=sorted(OBJECTIVES))
    ap.add_argument("--micro-batch", type=int, default=2, help="rows per forward/backward of the update")
    ap.add_argument("--lora", action="store_true", help="LoRA adapters (rank 8) on every linear layer")
    ap.add_argument("--out", default=str(RESULTS / "step_waits.json"))
    args = ap.parse_args()

    torch.manual_seed(0)
    policy, tok = load_policy(args.model, attn_implementation="sdpa")
    reference = None
    if args.lora:
        policy = lora.apply(policy, lora.LoraSettings(enabled=True, rank=8, alpha=16, target_modules="all-linear"))
    else:
        reference = copy.deepcopy(policy)
    backend = Backend(dtype=policy.dtype)
    backend.prepare(policy, trains=True)
    module = RLModule(
        policy,
        tok,
        TemperatureExplorer(temperature=1.0),
        OBJECTIVES[args.objective](kl_coef=0.01),
        scripted_reward,
        reference=reference,
        adapters=args.lora,
        backend=backend,
        optim=OptimConfig(lr=1e-3, micro_batch_size=args.micro_batch),
    )
    problems = reasoning_gym_problems(["chain_sum"], 4, seed=0)
    data = RolloutDataModule(tok, problems, [], prompts_per_step=2, group_size=2, max_new_tokens=6, seed=0)
    phase = CurrentPhase()
    decoder = policy.get_base_model() if args.lora else policy
    waits = Waits(phase, [m.model.layers[0] for m in (decoder, reference) if m is not None])

    class SecondStep(L.Callback):  # the first step warms up; the second (rollout included) is counted
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            waits.on = batch_idx == 0

    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        profiler=phase,
        callbacks=[SecondStep()],
    )
    with waits, Reads(waits):
        trainer.fit(module, datamodule=data)
    rows = [
        {"phase": p, "when": when, "where": where, "operation": op, "waits": n}
        for (p, when, where, op), n in sorted(waits.seen.items())
    ]
    total = Counter()
    for row in rows:
        total[(row["phase"], row["when"])] += row["waits"]
    kind = f"{args.objective}, {'LoRA' if args.lora else 'full fine-tuning'}, micro-batches of {args.micro_batch}"
    print(f"{args.model}: the waits of one training step ({kind})")
    print_table(rows, ["phase", "when", "where", "operation", "waits"])
    summary = [{"phase": p, "when": w, "waits": n} for (p, w), n in sorted(total.items())]
    print_table(summary, ["phase", "when", "waits"])
    print(f"total: {sum(total.values())}, inside passes: {sum(n for (_, w), n in total.items() if w == 'inside')}")
    write_json("step_waits", rows, args.out, model=args.model, setting=kind, summary=summary)


if __name__ == "__main__":
    main()
