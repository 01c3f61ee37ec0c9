"""The RolloutEngine interface: prompts in, a :class:`RolloutBatch` out; and the policy's full
weights for engines that keep their own copy."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import torch
from torch.distributed.tensor import DTensor

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

    needs_sync: bool = False  # True for engines that decode with their own copy of the weights
    weights_version: int | None = None  # the policy version (optimizer steps) of the engine's weights

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Load the policy's current weights (full tensors, Hugging Face names) and remember
        their ``version``. A no-op for engines that share the policy."""

    def close(self) -> None:
        """Release engine resources (processes, device memory)."""


class SeededEngine(RolloutEngine):
    """An engine whose sampling draws from one seeded ``torch.Generator``, saved in checkpoints
    so that a resumed run samples what it would have."""

    seed: int = 0
    _generator: torch.Generator | None = None
    _pending_state: torch.Tensor | None = None  # a checkpointed generator state, applied on first use

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        device = torch.device(device)
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
            if self._pending_state is not None:
                self._generator.set_state(self._pending_state)
                self._pending_state = None
        return self._generator

    def state_dict(self) -> dict:
        """The sampling generator's state."""
        if self._generator is not None:
            return {"seed": self.seed, "generator": self._generator.get_state()}
        return {"seed": self.seed, "generator": self._pending_state}

    def load_state_dict(self, state: dict) -> None:
        self.seed = state.get("seed", self.seed)
        gen_state = state.get("generator")
        self._pending_state = None if gen_state is None else gen_state.cpu()
        self._generator = None  # rebuilt (with this state) on the next rollout


def full_named_tensors(model: torch.nn.Module):
    """``(name, tensor)`` for every entry of ``model.state_dict()``, with FSDP2's sharded
    DTensors gathered into full tensors one at a time (a collective: all ranks iterate
    together), so that an engine with its own weights can load them."""
    for name, tensor in model.state_dict().items():
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
