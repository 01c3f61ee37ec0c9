"""RolloutBatch: everything a training step needs from one round of rollouts."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from ngrpo_lightning.rollout.padding import pad_to
from ngrpo_lightning.rollout.records import NOISE_GENERATOR, InputRecords, rebuilds_as_saved


@dataclass
class RolloutBatch:
    """N = P x G rollouts, stored group by group (rows ``g*G .. g*G+G-1`` share prompt ``g``). The training forward's
    tokens: ``[prompt_ids (left padded) | response_ids (right padded)]``; ``response_mask`` covers EOS too."""

    prompt_ids: torch.Tensor  # [N, P] long, left padded
    prompt_mask: torch.Tensor  # [N, P] long
    response_ids: torch.Tensor  # [N, L] long, right padded
    response_mask: torch.Tensor  # [N, L] long
    rollout_logprobs: torch.Tensor  # [N, L] float: log p(token) under the rollout's policy
    records: InputRecords = field(default_factory=InputRecords)
    group_size: int = 1
    answers: list[str] = field(default_factory=list)  # gold answer per row
    verifiers: list[str | None] = field(default_factory=list)  # task verifier spec per row (None: math-verify)
    problem_ids: list[str] = field(default_factory=list)  # problem id per row
    response_text: list[str] = field(default_factory=list)  # decoded response per row
    truncated: torch.Tensor | None = None  # [N] bool: hit max_new_tokens without EOS
    stats: dict[str, float] = field(default_factory=dict)  # engine timings, tokens/s, ...

    # ----------------------------------------------------------------- shapes
    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def num_groups(self) -> int:
        return len(self) // self.group_size

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def response_offset(self) -> int:
        return self.prompt_ids.shape[1]

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)

    # ------------------------------------------------------------ utilities
    @classmethod
    def concat(cls, batches: list[RolloutBatch], pad_id: int = 0) -> RolloutBatch:
        """The rows of several batches (same ``group_size``), re-padded with ``pad_id``, records renumbered; ``stats``
        are the first batch's."""
        if not batches:
            raise ValueError("RolloutBatch.concat needs at least one batch")
        if len(batches) == 1:
            return batches[0]
        if len({b.group_size for b in batches}) > 1:
            raise ValueError(f"cannot concatenate batches of group sizes {sorted({b.group_size for b in batches})}")
        width_p = max(b.prompt_ids.shape[1] for b in batches)
        width_l = max(b.response_ids.shape[1] for b in batches)
        left = lambda t, v: pad_to(t, width_p, v, left=True)  # noqa: E731
        right = lambda t, v: pad_to(t, width_l, v)  # noqa: E731
        offsets = [0]
        for b in batches[:-1]:
            offsets.append(offsets[-1] + len(b))
        records = InputRecords.concat(
            [InputRecords(**{**vars(b.records), "row": b.records.row + off}) for b, off in zip(batches, offsets)]
        )
        joined = lambda name: [x for b in batches for x in getattr(b, name)]  # noqa: E731
        return cls(
            prompt_ids=torch.cat([left(b.prompt_ids, pad_id) for b in batches]),
            prompt_mask=torch.cat([left(b.prompt_mask, 0) for b in batches]),
            response_ids=torch.cat([right(b.response_ids, pad_id) for b in batches]),
            response_mask=torch.cat([right(b.response_mask, 0) for b in batches]),
            rollout_logprobs=torch.cat([right(b.rollout_logprobs, 0.0) for b in batches]),
            records=records,
            group_size=batches[0].group_size,
            answers=joined("answers"),
            verifiers=joined("verifiers") if all(b.verifiers for b in batches) else [],
            problem_ids=joined("problem_ids"),
            response_text=joined("response_text"),
            truncated=None if any(b.truncated is None for b in batches) else torch.cat([b.truncated for b in batches]),
            stats=dict(batches[0].stats),
        )

    def clone(self) -> RolloutBatch:
        """A copy with fresh tensors (e.g. to leave ``torch.inference_mode``)."""
        return self._map(lambda t: t.clone())

    def to(self, device) -> RolloutBatch:
        return self._map(lambda t: t.to(device))

    def _map(self, fn) -> RolloutBatch:
        """Apply ``fn`` to every tensor (record tensors included)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in out.items():
            if isinstance(value, torch.Tensor):
                out[name] = fn(value)
            elif isinstance(value, InputRecords):
                out[name] = InputRecords(**{k: fn(v) for k, v in vars(value).items()})
        return RolloutBatch(**out)

    def state_dict(self) -> dict:
        """The batch as plain containers, which ``torch.load(weights_only=True)`` reads (:meth:`from_state_dict`)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["records"] = dict(vars(self.records))
        out["noise_generator"] = NOISE_GENERATOR
        return out

    @classmethod
    def from_state_dict(cls, state: dict) -> RolloutBatch:
        """The batch :meth:`state_dict` saved; ``ValueError`` when its noise came from another generator."""
        state = dict(state)
        generator = state.pop("noise_generator", None)
        records = InputRecords(**state["records"])
        if not rebuilds_as_saved(records.noise_seed, generator):
            raise ValueError(
                f"rollouts saved with noise generator {generator!r}, this version's is {NOISE_GENERATOR!r}"
            )
        return cls(**{**state, "records": records})

    def select(self, rows: torch.Tensor | list[int]) -> RolloutBatch:
        """A sub-batch of the given rows (records renumbered); ``group_size`` is kept, so select whole groups."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        pick = lambda xs: [xs[i] for i in rows.tolist()] if xs else xs  # noqa: E731
        return replace(
            self,
            prompt_ids=self.prompt_ids[rows],
            prompt_mask=self.prompt_mask[rows],
            response_ids=self.response_ids[rows],
            response_mask=self.response_mask[rows],
            rollout_logprobs=self.rollout_logprobs[rows],
            records=self.records.select_rows(rows),
            answers=pick(self.answers),
            verifiers=pick(self.verifiers),
            problem_ids=pick(self.problem_ids),
            response_text=pick(self.response_text),
            truncated=None if self.truncated is None else self.truncated[rows],
        )

    def trim(self) -> RolloutBatch:
        """Drop columns that are padding in every row (after selecting a sub-batch)."""
        keep_p, keep_l = 0, 0
        if len(self):  # both widths in one read of the device
            widths = torch.stack([self.prompt_mask.sum(-1).max(), self.response_mask.sum(-1).max()])
            keep_p, keep_l = (int(w) for w in widths.tolist())
        cut = self.prompt_ids.shape[1] - keep_p
        rec = self.records.take((self.records.pos < keep_l).nonzero().squeeze(1))
        return replace(
            self,
            prompt_ids=self.prompt_ids[:, cut:],
            prompt_mask=self.prompt_mask[:, cut:],
            response_ids=self.response_ids[:, :keep_l],
            response_mask=self.response_mask[:, :keep_l],
            rollout_logprobs=self.rollout_logprobs[:, :keep_l],
            records=rec,
        )
