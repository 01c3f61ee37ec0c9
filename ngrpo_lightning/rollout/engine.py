"""The RolloutEngine interface: prompts in, a :class:`RolloutBatch` out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import torch

from ..explorers import Explorer
from .batch import RolloutBatch


class RolloutEngine(ABC):
    """Generates G samples per prompt with a given explorer.

    Engines that decode with their own copy of the weights (vLLM) receive the policy's
    weights after every optimizer step through :meth:`sync_weights`; engines that decode
    with the policy module itself (``HFEngine``) need no sync.
    """

    @abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        explorer: Explorer,
        n: int = 1,
        max_new_tokens: int | None = None,
    ) -> RolloutBatch:
        """Roll out ``n`` samples of each tokenized prompt (rows grouped by prompt)."""

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the policy's current weights. A no-op for engines that share the policy."""

    def close(self) -> None:
        """Release engine resources (processes, device memory)."""
