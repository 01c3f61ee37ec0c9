"""What a training step logs besides its losses: statistics of the fresh rollouts and their
rewards (``train/*``), and the metrics of a step's micro-batches combined into one update's."""

from __future__ import annotations

import torch

from ngrpo_lightning.objectives import masked_max, masked_mean, zero_variance_groups
from ngrpo_lightning.rollout.batch import RolloutBatch


def rollout_step_metrics(batch: RolloutBatch, rewards: torch.Tensor, step) -> dict[str, torch.Tensor | float]:
    """``train/*`` statistics of a step: rewards and advantages of the rows trained on (a prepared
    :class:`~ngrpo_lightning.training.updates.StepRollouts`), lengths of the fresh ``batch``, and the
    rollout/train mismatch of the fresh tokens' log-probs."""
    lengths = batch.response_lengths.float()
    fresh = (~step.replayed)[:, None] * step.batch.response_mask
    mismatch = (step.batch.rollout_logprobs - step.old_logp).abs()
    advantages = step.advantages
    return {
        "train/reward": rewards.mean(),
        "train/accuracy": (rewards >= 1.0).float().mean(),  # fully correct (a task may grade below 1)
        "train/advantage_mean": advantages.mean(),
        "train/advantage_std": advantages.std() if len(advantages) > 1 else advantages.new_tensor(0.0),
        "train/zero_variance_groups": zero_variance_groups(rewards, batch.group_size).float().mean(),
        "train/response_length_mean": lengths.mean(),
        "train/response_length_max": lengths.max(),
        "train/truncated_frac": batch.truncated.float().mean() if batch.truncated is not None else 0.0,
        "train/rollout_logprob_diff_mean": masked_mean(mismatch, fresh),
        "train/rollout_logprob_diff_max": masked_max(mismatch, fresh),
    }


def combine_metrics(parts: list[dict], weights: list[float]) -> dict[str, torch.Tensor]:
    """Weighted sums of metric dicts, except ``*_min`` (minimum) and ``*_max`` (maximum)."""
    out: dict[str, torch.Tensor] = {}
    for part, w in zip(parts, weights):
        for k, v in part.items():
            v = torch.as_tensor(v).detach().float()
            if k.endswith("_min"):
                out[k] = torch.minimum(out[k], v) if k in out else v
            elif k.endswith("_max"):
                out[k] = torch.maximum(out[k], v) if k in out else v
            else:
                out[k] = out.get(k, 0.0) + v * w
    return out


def host_floats(values: dict) -> dict[str, float]:
    """``values`` (numbers and one-element tensors) as Python floats, read from each device at once
    (``float(t)`` one at a time waits once per metric); widened to float64 exactly."""
    out = {k: float(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}
    by_device: dict[torch.device, list[str]] = {}
    for k, v in values.items():
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(k)
    for keys in by_device.values():
        read = torch.stack([values[k].detach().reshape(()).double() for k in keys]).tolist()
        out.update(zip(keys, read))
    return {k: out[k] for k in values}
