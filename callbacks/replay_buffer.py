"""ReplayBuffer: replay of past successes into groups whose fresh rollouts are all wrong.

Give it to the module, ``RLModule(..., step_hooks=[buffer])`` (``ngrpo train`` does when
``replay.capacity`` > 0); as a :class:`~ngrpo_lightning.training.updates.StepHook` it takes part in
every step:

1. ``mix_in``: in each group whose fresh rollouts are all wrong, a stored success of the same
   prompt (at most ``max_staleness`` steps old) replaces the last rollout, so the group's
   advantages are no longer all zero;
2. ``weigh``: a replayed row's advantage is scaled by ``min(exp(mean_t(logp - stored_old_logp)),
   is_cap)`` (:mod:`ngrpo_lightning.objectives.importance`).

After the step it stores the fresh successes, one per prompt, and forgets entries too stale or
beyond ``capacity``; its state is kept in checkpoints.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import lightning as L
import torch

from ngrpo_lightning.objectives import sequence_importance_weight
from ngrpo_lightning.rollout.batch import RolloutBatch
from ngrpo_lightning.rollout.padding import pad_rows
from ngrpo_lightning.rollout.records import NOISE_GENERATOR, RECORD_FIELDS, InputRecords, rebuilds_as_saved
from ngrpo_lightning.training.settings import ReplayConfig
from ngrpo_lightning.training.updates import StepHook, StepRollouts

log = logging.getLogger(__name__)


class ReplayBuffer(L.Callback, StepHook):
    """Replay past successful trajectories into all-wrong groups.

    Args:
        capacity: prompts whose latest success is kept (``replay.capacity``; 0 = no replay).
        max_staleness: steps after sampling that a success may still be replayed (``replay.max_staleness``).
        is_cap: cap of a replayed trajectory's importance weight (``replay.is_cap``).
        success_threshold: a rollout with reward >= this is a success.
    """

    def __init__(
        self,
        capacity: int,
        max_staleness: int = ReplayConfig.max_staleness,
        is_cap: float = ReplayConfig.is_cap,
        success_threshold: float = 0.5,
    ):
        ReplayConfig(capacity=capacity, max_staleness=max_staleness, is_cap=is_cap)  # checks each value, names its key
        self.capacity, self.max_staleness = capacity, max_staleness
        self.is_cap, self.success_threshold = float(is_cap), float(success_threshold)
        self.entries: dict[str, dict] = {}  # problem id -> its latest stored success (oldest first)
        self.steps_seen = 0  # training steps completed; the current step's index while one runs

    # ------------------------------------------------------------ planning
    def mix_in(self, step: StepRollouts) -> StepRollouts:
        """Substitute stored successes into all-wrong groups (see the module docstring)."""
        g = step.group_size
        targets, sources = [], []
        if self.capacity and self.entries and step.batch.problem_ids:
            success = (step.rewards >= self.success_threshold).view(-1, g).any(-1).tolist()
            for group, ok in enumerate(success):
                entry = self.entries.get(step.batch.problem_ids[group * g])
                if not ok and entry is not None and self.steps_seen - entry["step"] <= self.max_staleness:
                    targets.append(group * g + g - 1)
                    sources.append(entry)
        step.stats["replay/substituted"] = len(sources)
        step.stats["replay/size"] = len(self.entries)
        if not sources:
            return step
        past = self._as_rollouts(sources, step)
        order = torch.arange(len(step))
        order[targets] = len(step) + torch.arange(len(sources))
        mixed = StepRollouts.concat([step, past]).select(order)
        mixed.stats = dict(step.stats)
        return mixed

    def weigh(self, step: StepRollouts) -> StepRollouts:
        """Scale replayed rows' advantages by their capped importance weights."""
        if not step.replayed.any():
            return step
        weight = sequence_importance_weight(step.old_logp, step.behaviour_logp, step.batch.response_mask, self.is_cap)
        weight = torch.where(step.replayed, weight, torch.ones_like(weight))
        step.stats["replay/is_weight_mean"] = float(weight[step.replayed].mean())
        return replace(step, advantages=step.advantages * weight)

    # ---------------------------------------------------------- Lightning
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        """Remember the step's fresh successes and forget what can no longer be replayed."""
        step = outputs.get("rollouts") if isinstance(outputs, dict) else None
        if self.capacity and isinstance(step, StepRollouts) and step.batch.problem_ids:
            self._store(step)
        self.steps_seen += 1
        for pid in [p for p, e in self.entries.items() if self.steps_seen - e["step"] > self.max_staleness]:
            del self.entries[pid]
        while len(self.entries) > self.capacity:
            del self.entries[next(iter(self.entries))]

    def state_dict(self) -> dict:
        entries = [dict(e) for e in self.entries.values()]
        return {"steps_seen": self.steps_seen, "entries": entries, "noise_generator": NOISE_GENERATOR}

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps_seen = int(state_dict["steps_seen"])
        self.entries = {e["problem_id"]: dict(e) for e in state_dict["entries"]}
        generator = state_dict.get("noise_generator")
        stale = [p for p, e in self.entries.items() if not rebuilds_as_saved(e["records"]["noise_seed"], generator)]
        for pid in stale:  # noise made another way cannot be rebuilt as its rollout saw it
            del self.entries[pid]
        if stale:
            log.warning(
                "replay buffer: %d saved successes with noisy inputs dropped: saved with noise generator %r, "
                "this version's is %r",
                len(stale),
                generator,
                NOISE_GENERATOR,
            )

    # -------------------------------------------------------------- storage
    def _store(self, step: StepRollouts) -> None:
        """Keep each prompt's first fresh success of this step (it replaces older ones)."""
        b, g = step.batch, step.group_size
        ok = ((step.rewards >= self.success_threshold) & ~step.replayed).view(-1, g)
        for group in ok.any(-1).nonzero().squeeze(-1).tolist():
            row = group * g + int(ok[group].float().argmax())
            pid = b.problem_ids[row]
            self.entries.pop(pid, None)  # re-insert: the dict stays ordered oldest first
            self.entries[pid] = self._entry(step, row)

    def _entry(self, step: StepRollouts, row: int) -> dict:
        """One trajectory as plain CPU tensors and values (checkpoint-safe), unpadded."""
        b = step.batch
        prompt = b.prompt_ids[row][b.prompt_mask[row].bool()]
        length = int(b.response_mask[row].sum())
        rec = b.records
        mine = rec.row == row
        return {
            "problem_id": b.problem_ids[row],
            "step": self.steps_seen,
            "reward": float(step.rewards[row]),
            "prompt_ids": prompt.cpu().clone(),
            "response_ids": b.response_ids[row, :length].cpu().clone(),
            "rollout_logprobs": b.rollout_logprobs[row, :length].cpu().clone(),
            "old_logp": step.old_logp[row, :length].detach().cpu().clone(),
            "records": {k: getattr(rec, k)[mine].cpu().clone() for k in RECORD_FIELDS},
            "answer": b.answers[row] if b.answers else "",
            "response_text": b.response_text[row] if b.response_text else "",
            "truncated": bool(b.truncated[row]) if b.truncated is not None else False,
        }

    def _as_rollouts(self, entries: list[dict], like: StepRollouts) -> StepRollouts:
        """Stored trajectories as replayed rows (padded like a rollout batch)."""
        device = like.batch.response_ids.device
        pad, n = like.pad_id, len(entries)
        prompt_ids, prompt_mask = pad_rows([e["prompt_ids"] for e in entries], pad, left=True)
        response_ids, response_mask = pad_rows([e["response_ids"] for e in entries], pad)
        rollout_logp, _ = pad_rows([e["rollout_logprobs"] for e in entries])
        old_logp, _ = pad_rows([e["old_logp"] for e in entries])
        records = InputRecords.concat(
            [InputRecords(row=torch.full_like(e["records"]["pos"], i), **e["records"]) for i, e in enumerate(entries)]
        )
        batch = RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            rollout_logprobs=rollout_logp,
            records=records,
            group_size=like.group_size,
            answers=[e["answer"] for e in entries],
            problem_ids=[e["problem_id"] for e in entries],
            response_text=[e["response_text"] for e in entries],
            truncated=torch.tensor([e["truncated"] for e in entries]),
        ).to(device)
        rewards = torch.tensor([e["reward"] for e in entries], device=device, dtype=like.rewards.dtype)
        return StepRollouts(
            batch, rewards, torch.ones(n, dtype=torch.bool, device=device), old_logp.to(device), pad_id=pad
        )
