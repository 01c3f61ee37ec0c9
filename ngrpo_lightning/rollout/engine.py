"""The RolloutEngine contract, its registry, and what every engine shares.

An engine turns tokenized prompts and an explorer into a :class:`RolloutBatch`. Engines are
components like explorers and objectives: registered by name and selected in configs::

    @register_engine("my_engine")             # rollout.engine=my_engine
    class MyEngine(RolloutEngine):
        def __init__(self, model, tokenizer, max_new_tokens=256, seed=0, ignore_eos=False, beam=1): ...
        def generate(self, prompts, explorer, n=1, max_new_tokens=None) -> RolloutBatch: ...

or, written outside the package, by class path (``rollout.engine=my_pkg.engines.MyEngine``).
The constructor's keyword arguments beyond the common ones are the engine's settings, read
from ``rollout.<settings_key>.*`` (``rollout.hf.*``, ``rollout.vllm.*``) and checked by
:meth:`RolloutEngine.check_settings` before any model loads.

What every engine does the same way lives here, so that a new engine writes only its
decoding loop:

- :meth:`RolloutEngine.start`: the prologue of a rollout (the explorer's special ids and
  ``prepare(E)``, the seeded generator, the log-prob temperature, the answer marker);
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

# Constructor arguments every engine is given by the framework (not settings of its own).
# ``backend``: how the model computes (ngrpo_lightning/backends), the run's choice, not a setting;
# ``checks_every``, ``static_cache``, ``graphs``: how HFEngine decodes, the backend's choices (benchmarks
# may pass them).
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
    """All ids that end a response: a generation config's ``eos_token_id`` (an int, a list or
    None) and the tokenizer's, in that order."""
    ids = (
        [] if generation_eos is None else [generation_eos] if isinstance(generation_eos, int) else list(generation_eos)
    )
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def special_token_ids(tokenizer, vocab_size: int) -> list[int]:
    """Ids an explorer should never pick by itself: the tokenizer's special tokens and the
    embedding rows no token maps to (vocabularies padded beyond the tokenizer)."""
    return sorted(set(tokenizer.all_special_ids) | set(range(len(tokenizer), vocab_size)))


@dataclass
class RolloutStart:
    """What a rollout's decoding loop needs from the prologue (:meth:`RolloutEngine.start`)."""

    generator: torch.Generator  # the engine's seeded sampling generator, on the logits' device
    temperature: float  # the temperature rollout log-probs are taken at (1 for a greedy policy)
    marker: AnswerMarker | None  # stops mixing after a row's answer marker (explorer.answer_start)


class RolloutEngine(ABC):
    """Generates ``n`` samples per prompt with a given explorer.

    Engines that decode with their own copy of the weights (vLLM) receive the policy's
    weights after every optimizer step through :meth:`sync_weights` (``needs_sync``); engines
    that decode with the policy module itself (``HFEngine``) need no sync.

    Sampling draws from one seeded ``torch.Generator`` (``seed``), whose state is saved in
    checkpoints so that a resumed run samples what it would have.
    """

    registered_name: str = ""
    settings_key: str | None = None  # rollout.<settings_key>.* are the engine's settings (None: it has none)
    needs_sync: bool = False  # True for engines that decode with their own copy of the weights
    weights_version: int | None = None  # the policy version (optimizer steps) of the engine's weights
    # the live policy's version at the next rollout, told by the run before each (None: not known). An
    # engine that keeps weights of its own without a sync (HFEngine's copy of an FSDP2 policy) rewrites
    # them only when it moved: every rank holds the same version, so every rank gathers, or none does
    policy_version: int | None = None
    tokenizer = None
    eos_ids: list[int] = []
    seed: int = 0
    _generator: torch.Generator | None = None
    _pending_state: torch.Tensor | None = None  # a checkpointed generator state, applied on first use

    # ------------------------------------------------------------ building
    @classmethod
    def check_available(cls) -> None:
        """Raise ``ValueError`` if this machine cannot run the engine (e.g. a missing optional
        dependency). Called before any model loads."""

    @classmethod
    def check_explorer(cls, explorer: Explorer) -> None:
        """Raise ``ValueError`` if the engine cannot run ``explorer`` (an engine that cannot feed
        mixed inputs runs plain sampling only). Called before any model loads."""

    @classmethod
    def check_model(cls, model: torch.nn.Module) -> None:
        """Raise ``ValueError`` if the engine cannot decode ``model`` on this machine. Called once
        the model has loaded, before the first rollout."""

    @classmethod
    def settings_names(cls) -> list[str]:
        """The engine's own settings: its constructor's keyword arguments beyond the common ones."""
        params = inspect.signature(cls.__init__).parameters
        return [p for p, v in params.items() if p not in CONTEXT_ARGS and v.kind is not inspect.Parameter.VAR_KEYWORD]

    @classmethod
    def check_settings(cls, settings: dict, prefix: str) -> None:
        """Refuse a setting the engine does not take (``ValueError`` naming ``<prefix>.<key>`` and
        the allowed ones); engines add value checks. Called before any model loads."""
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
        """The engine for a live policy. ``max_prompt_tokens`` bounds the prompts (engines that
        size buffers from it use it); ``sharded_root`` is the policy's FSDP2 root module when it is
        sharded (engines that decode with the policy unshard it); ``backend`` is the run's
        (:mod:`ngrpo_lightning.backends`: engines that compute with the policy follow it);
        ``settings`` are the engine's own."""
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
        """The ids that end a response; none with ``ignore_eos`` (every response is
        ``max_new_tokens`` long: fixed-length rollouts, for benchmarks)."""
        self.eos_ids = [] if ignore_eos else list(ids)

    def start(self, explorer: Explorer, embedding: torch.Tensor, native: bool = False) -> RolloutStart:
        """The prologue of a rollout: tell the explorer the special ids and the embedding matrix
        ``E`` it decodes with (skipped for ``native`` sampling that never calls the explorer),
        and hand out the seeded generator, the log-prob temperature and the answer marker."""
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
        """Load the policy's current weights (full tensors, Hugging Face names) and remember
        their ``version``. A no-op for engines that share the policy."""

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
    """``(name, tensor)`` for every entry of ``model.state_dict()``, with FSDP2's sharded
    DTensors gathered into full tensors one at a time (a collective: all ranks iterate
    together), so that an engine with its own weights can load them. A policy with LoRA
    adapters gives its base model's entries with the adapters merged in (model.lora)."""
    if has_adapters(model):
        yield from merged_named_tensors(model)
        return
    for name, tensor in model.state_dict().items():
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
