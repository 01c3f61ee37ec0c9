"""The rollout engine of a run's policy: built at its first rollout, given the policy's weights when the version
moved, its sampling state saved and restored per rank. The rollouts-ahead worker builds its own with
:meth:`PolicyEngine.build`, or drives this one where the engine has weights of its own (``needs_sync``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ngrpo_lightning.rollout.context import RunContext
from ngrpo_lightning.rollout.engine import RolloutEngine, full_named_tensors
from ngrpo_lightning.rollout.engines import build_engine, engine_class

__all__ = ["PolicyEngine", "by_rank"]


class PolicyEngine:
    """Builds, syncs and checkpoints the engine ``name`` (``rollout.engine``).

    Args:
        name: a registered engine or an engine's class path.
        settings: its own settings (``rollout.vllm.*``) and the common ones (``ignore_eos``, ``max_prompt_tokens``).
        max_new_tokens: the response length limit.
        seed: of the sampling generator (each rank adds its rank).
        rank: this process's rank (a function: the trainer tells it once attached).
    """

    def __init__(self, name: str, settings: dict, max_new_tokens: int, seed: int, rank: Callable[[], tuple[int, int]]):
        engine_class(name)  # an unknown engine fails here, naming rollout.engine and the allowed names
        self.name, self.settings, self.max_new_tokens, self.seed = name, dict(settings), max_new_tokens, seed
        self.rank = rank
        self.engine: RolloutEngine | None = None
        self._state: dict | None = None  # a checkpoint's sampling state, until the engine exists

    @property
    def needs_sync(self) -> bool:
        """Whether the engine decodes with weights of its own (vLLM), known before it is built."""
        return engine_class(self.name).needs_sync

    def build(self, model: torch.nn.Module, context: RunContext, sharded_root=None) -> RolloutEngine:
        """An engine of this kind for ``model`` (the policy, or a copy), computing as the run's backend says."""
        return build_engine(
            self.name,
            model,
            context.tokenizer,
            max_new_tokens=self.max_new_tokens,
            seed=self.seed + self.rank()[0],
            sharded_root=sharded_root,
            backend=context.backend,
            **self.settings,
        )

    def ready(self, context: RunContext) -> RolloutEngine:
        """The engine, built at the first call (with a resumed checkpoint's sampling state) and told the version
        (``RolloutEngine.policy_version``); one with its own weights (vLLM) gets the policy's when the version moved,
        a collective under FSDP2."""
        if self.engine is None:
            self.engine = self.build(context.policy, context, context.sharded_root(context.policy))
            if self._state is not None:
                self.engine.load_state_dict(self._state)
            self._state = None
        version = context.version.value
        self.engine.policy_version = version
        if self.engine.needs_sync and self.engine.weights_version != version:
            self.engine.sync_weights(full_named_tensors(context.policy), version=version)
        return self.engine

    def close(self) -> None:
        """Release the engine (vLLM's memory and threads)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def state_dict(self) -> list:
        """Every rank's sampling state (gathered when several processes run)."""
        return by_rank(self.engine.state_dict() if self.engine is not None else self._state, self.rank()[1])

    def load_state_dict(self, states: list) -> None:
        rank = self.rank()[0]
        self._state = states[rank] if rank < len(states) else None
        if self.engine is not None and self._state is not None:
            self.engine.load_state_dict(self._state)
            self._state = None


def by_rank(state, world: int) -> list:
    """Every rank's ``state``, in rank order (gathered when several processes run), for a checkpoint."""
    if world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        states = [None] * world
        torch.distributed.all_gather_object(states, state)
        return states
    return [state]
