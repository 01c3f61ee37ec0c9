"""The RolloutEngine contract, its registry, and what every engine shares.

An engine turns tokenized prompts and an explorer into a :class:`RolloutBatch`; engines are registered by name::

    @register_engine("my_engine")             # rollout.engine=my_engine
    class MyEngine(RolloutEngine):
        def __init__(self, model, tokenizer, max_new_tokens=256, seed=0, ignore_eos=False, beam=1): ...
        def generate(self, prompts, explorer, n=1, max_new_tokens=None) -> RolloutBatch: ...

or, outside the package, by class path (``rollout.engine=my_pkg.engines.MyEngine``). Constructor keyword arguments
beyond the common ones are the engine's settings (``rollout.<settings_key>.*``, checked by
:meth:`RolloutEngine.check_settings` before any model loads). A new engine writes only its decoding loop; shared here:

- :meth:`RolloutEngine.start`: a rollout's prologue (the explorer's special ids and ``prepare(E)``, the seeded
  generator, the log-prob temperature, the answer marker);
- :meth:`RolloutEngine.set_eos_ids`: the ids that end a response (none with ``ignore_eos``);
- :meth:`RolloutEngine.rollout_stats`: the ``rollout/*`` statistics of a batch;
- the sampling generator, seeded and saved in checkpoints (:meth:`state_dict`).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ngrpo_lightning.explorers import Explorer
from ngrpo_lightning.models.lora import has_adapters, merged_named_tensors
from ngrpo_lightning.registry import Registry
from ngrpo_lightning.rollout.answer_marker import AnswerMarker
from ngrpo_lightning.rollout.batch import RolloutBatch

__all__ = [
    "ENGINES",
    "RolloutEngine",
    "RolloutStart",
    "eos_token_ids",
    "full_named_tensors",
    "register_engine",
    "special_token_ids",
]

ENGINES = Registry("engine", key="rollout.engine")
register_engine = ENGINES.register  # class decorator: selectable as ``rollout.engine=<name>``

# Constructor arguments the framework gives every engine, not its settings (the backend's choices for HFEngine too)
CONTEXT_ARGS = (
    "self",
    "model",
    "tokenizer",
    "max_new_tokens",
    "seed",
    "ignore_eos",
    "policy",
    "sharded_root",
    "backend",
    "checks_every",
    "static_cache",
    "graphs",
)


def eos_token_ids(generation_eos, tokenizer) -> list[int]:
    """All ids that end a response: a generation config's ``eos_token_id`` (int, list or None), then the tokenizer's."""
    ids = (
        [] if generation_eos is None else [generation_eos] if isinstance(generation_eos, int) else list(generation_eos)
    )
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def special_token_ids(tokenizer, vocab_size: int) -> list[int]:
    """Ids an explorer should never pick by itself: the tokenizer's special tokens and embedding rows beyond it."""
    return sorted(set(tokenizer.all_special_ids) | set(range(len(tokenizer), vocab_size)))


@dataclass
class RolloutStart:
    """What a rollout's decoding loop needs from the prologue (:meth:`RolloutEngine.start`)."""

    generator: torch.Generator  # the engine's seeded sampling generator, on the logits' device
    temperature: float  # the temperature rollout log-probs are taken at (1 for a greedy policy)
    marker: AnswerMarker | None  # stops mixing after a row's answer marker (explorer.answer_start)


class RolloutEngine(ABC):
    """Generates ``n`` samples per prompt with a given explorer. Engines with their own copy of the weights (vLLM,
    ``needs_sync``) receive the policy's through :meth:`sync_weights`; ``HFEngine`` decodes with the policy itself.
    Sampling draws from one seeded ``torch.Generator``, checkpointed so a resumed run samples what it would have."""

    registered_name: str = ""
    settings_key: str | None = None  # rollout.<settings_key>.* are the engine's settings (None: it has none)
    needs_sync: bool = False  # True for engines that decode with their own copy of the weights
    weights_version: int | None = None  # the policy version (optimizer steps) of the engine's weights
    # the live policy's version at the next rollout (None: not known); an engine keeping weights without a sync
    # (HFEngine's copy of an FSDP2 policy) rewrites them only when it moved
    policy_version: int | None = None
    tokenizer = None
    eos_ids: list[int] = []
    seed: int = 0
    _generator: torch.Generator | None = None
    _pending_state: torch.Tensor | None = None  # a checkpointed generator state, applied on first use

    # ------------------------------------------------------------ building
    @classmethod
    def check_available(cls) -> None:
        """Raise ``ValueError`` if this machine cannot run the engine. Called before any model loads."""

    @classmethod
    def check_explorer(cls, explorer: Explorer) -> None:
        """Raise ``ValueError`` if the engine cannot run ``explorer``. Called before any model loads."""

    @classmethod
    def check_model(cls, model: torch.nn.Module) -> None:
        """Raise ``ValueError`` if the engine cannot decode ``model`` here. Called once it has loaded."""

    @classmethod
    def settings_names(cls) -> list[str]:
        """The engine's own settings: its constructor's keyword arguments beyond the common ones."""
        params = inspect.signature(cls.__init__).parameters
        return [p for p, v in params.items() if p not in CONTEXT_ARGS and v.kind is not inspect.Parameter.VAR_KEYWORD]

    @classmethod
    def check_settings(cls, settings: dict, prefix: str) -> None:
        """``ValueError`` naming ``<prefix>.<key>`` and the allowed ones for a setting the engine does not take;
        engines add value checks. Called before any model loads."""
        allowed = cls.settings_names()
        unknown = sorted(set(settings) - set(allowed))
        if unknown:
            raise ValueError(f"{prefix}.{unknown[0]} is unknown: allowed {allowed}")

    @classmethod
    def from_policy(
        cls,
        policy: torch.nn.Module,
        tokenizer,
        *,
        max_new_tokens: int,
        seed: int,
        ignore_eos: bool = False,
        max_prompt_tokens: int | None = None,
        sharded_root: torch.nn.Module | None = None,
        backend=None,
        **settings,
    ) -> RolloutEngine:
        """The engine for a live policy. ``max_prompt_tokens`` bounds the prompts; ``sharded_root``: the policy's FSDP2
        root when sharded; ``backend``: the run's (:mod:`ngrpo_lightning.backends`); ``settings``: the engine's own."""
        return cls(policy, tokenizer, max_new_tokens=max_new_tokens, seed=seed, ignore_eos=ignore_eos, **settings)

    # ------------------------------------------------------------ rollouts
    @abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        explorer: Explorer,
        n: int = 1,
        max_new_tokens: int | None = None,
    ) -> RolloutBatch:
        """Roll out ``n`` samples of each tokenized prompt (rows grouped by prompt)."""

    def set_eos_ids(self, ids: Iterable[int], ignore_eos: bool = False) -> None:
        """The ids that end a response; none with ``ignore_eos`` (every response ``max_new_tokens`` long)."""
        self.eos_ids = [] if ignore_eos else list(ids)

    def start(self, explorer: Explorer, embedding: torch.Tensor, native: bool = False) -> RolloutStart:
        """A rollout's prologue: tell the explorer the special ids and embedding matrix ``E`` (not for ``native``
        sampling); hand out the seeded generator, the log-prob temperature and the answer marker."""
        if not native:
            explorer.set_special_ids(special_token_ids(self.tokenizer, embedding.shape[0]))
            explorer.prepare(embedding.detach())
        return RolloutStart(
            generator=self.generator(embedding.device),
            temperature=explorer.temperature or 1.0,  # log-probs of a greedy policy are taken at T=1
            marker=None if native else AnswerMarker.for_explorer(explorer, self.tokenizer),
        )

    @staticmethod
    def rollout_stats(elapsed_s: float, tokens: int) -> dict[str, float]:
        """The ``rollout/*`` statistics every engine reports."""
        return {
            "rollout/time_s": elapsed_s,
            "rollout/tokens": tokens,
            "rollout/tokens_per_s": tokens / max(elapsed_s, 1e-9),
        }

    # ------------------------------------------------------------- weights
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Load the policy's weights (full tensors, Hugging Face names) as ``version``; no-op sharing the policy."""

    def close(self) -> None:
        """Release engine resources (processes, device memory)."""

    # ------------------------------------------------------------ sampling
    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The sampling generator on ``device`` (seeded, or restored from a checkpoint)."""
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
    """``(name, tensor)`` for every entry of ``model.state_dict()``, FSDP2's DTensors gathered one at a time (a
    collective: all ranks iterate together). A policy with LoRA adapters gives its base entries, adapters merged."""
    if has_adapters(model):
        yield from merged_named_tensors(model)
        return
    for name, tensor in model.state_dict().items():
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
