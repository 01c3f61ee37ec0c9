"""No mixing once a sequence has emitted its answer marker (``explorer.answer_start``).

The N-GRPO release explores only while the model thinks (before ``</think>``). The marker is matched on token ids over
each row's emitted tokens; the step that completes it is not mixed, nor any later one. Engines pass every step through
:meth:`AnswerMarker.unmix`, keyed by what names a sequence (vLLM: the request id); HFEngine, whose rows keep their
index, uses :meth:`AnswerMarker.rows`, the same rule on the device.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ngrpo_lightning.explorers import Explorer, ExplorerStep


class AnswerMarker:
    """Which sequences have emitted the token ids ``marker``."""

    def __init__(self, marker: Sequence[int]):
        if not marker:
            raise ValueError("explorer.answer_start encodes to no tokens: give a non-empty marker such as '</think>'")
        self.marker = tuple(int(i) for i in marker)
        self.recent: dict[Hashable, tuple[int, ...]] = {}  # the last len(marker) tokens of each sequence
        self.answered: set[Hashable] = set()

    @classmethod
    def for_explorer(cls, explorer: Explorer, tokenizer) -> AnswerMarker | None:
        """The marker of ``explorer.answer_start`` in ``tokenizer``'s ids, or None when it has none."""
        text = getattr(explorer, "answer_start", None)
        if not text:
            return None
        return cls(tokenizer(text, add_special_tokens=False)["input_ids"])

    def unmix(self, step: ExplorerStep, keys: Sequence[Hashable], emitted: torch.Tensor | None = None) -> None:
        """Record this step's tokens (``emitted``: rows whose token counts, default all) and clear ``step.mixed`` for
        every row whose sequence has completed the marker, now or before."""
        tokens = step.tokens.tolist()
        counts = [True] * len(tokens) if emitted is None else emitted.tolist()
        done = []
        for key, token, count in zip(keys, tokens, counts):
            if count and key not in self.answered:
                recent = (self.recent.get(key, ()) + (token,))[-len(self.marker) :]
                self.recent[key] = recent
                if recent == self.marker:
                    self.answered.add(key)
            done.append(key in self.answered)
        if step.mixed is not None and any(done):
            step.mixed = step.mixed & ~torch.tensor(done, device=step.mixed.device)

    def rows(self, count: int, device) -> RowAnswerMarker:
        """The same rule for ``count`` rows that keep their index all rollout long, on ``device``."""
        return RowAnswerMarker(self.marker, count, device)


class RowAnswerMarker:
    """:class:`AnswerMarker` for rows 0..R-1, kept on the device and updated in place: each row's last
    ``len(marker)`` counted tokens and whether it has answered."""

    def __init__(self, marker: Sequence[int], rows: int, device):
        self.marker = torch.tensor(marker, dtype=torch.long, device=device)
        self.recent = torch.full((rows, len(marker)), -1, dtype=torch.long, device=device)  # -1: no token yet
        self.answered = torch.zeros(rows, dtype=torch.bool, device=device)

    def restart(self) -> None:
        """No row has emitted anything (a kept marker's new rollout)."""
        self.recent.fill_(-1)
        self.answered.zero_()

    def unmix(self, step: ExplorerStep, emitted: torch.Tensor) -> None:
        """Record the ``emitted`` rows' tokens and clear ``step.mixed`` for every row that has completed the marker."""
        shifted = torch.cat([self.recent[:, 1:], step.tokens[:, None]], 1)
        self.recent.copy_(torch.where(emitted[:, None], shifted, self.recent))
        self.answered |= emitted & (self.recent == self.marker).all(-1)
        if step.mixed is not None:
            step.mixed = step.mixed & ~self.answered
