"""The Explorer contract: how the next input of one decoding step is formed.

For every row of one decoding step's logits an explorer picks (a) the *emitted* token (the text the reward
sees) and (b) the next input embedding: ``E[token]`` for a discrete step, for a *non-discrete* one a mixture::

    e = sum_j weights[j] * E[ids[j]]  +  noise_scale * randn(d, seed=noise_seed)

Engines record these fields and training rebuilds the same inputs from the record
(:func:`ngrpo_lightning.rollout.reconstruction.build_inputs_embeds`), so an explorer never touches an engine or
the training loop. An engine calls, in order:

1. ``set_special_ids(ids)``: special token ids (and embedding rows no token maps to), to exclude.
2. ``prepare(embeddings)``: the input embedding matrix ``E`` (V x d) on the decoding device.
3. ``step(logits, generator)`` per decoding step: raw float32 logits B x V in, an :class:`ExplorerStep` out;
   all randomness from ``generator``, so rollouts are reproducible.

Explorers are pure torch: register one with :func:`register_explorer`, or pick a class by ``explorer._target_=``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ngrpo_lightning.checks import check_choice as _check_choice
from ngrpo_lightning.checks import check_number
from ngrpo_lightning.registry import Registry

__all__ = [
    "explorer_step",
    "Explorer",
    "ExplorerStep",
    "EXPLORERS",
    "declares_capturable",
    "register_explorer",
    "check_answer_start",
    "check_explorer",
    "check_range",
    "check_choice",
]

EXPLORERS = Registry("explorer", key="explorer.name")
register_explorer = EXPLORERS.register  # class decorator: selectable as ``explorer.name=<name>`` in configs


@dataclass
class ExplorerStep:
    """One decoding step of B rows: ``tokens`` always; the other fields describe the non-discrete rows (``None``
    when all are discrete) and are ignored where ``mixed[b]`` is false."""

    tokens: torch.Tensor  # [B] long: emitted token ids
    mixed: torch.Tensor | None = None  # [B] bool: rows whose next input is a mixture
    ids: torch.Tensor | None = None  # [B, K] long: mixture token ids
    weights: torch.Tensor | None = None  # [B, K] float: mixture weights (rows sum to 1)
    noise_seed: torch.Tensor | None = None  # [B] long: seed of the additive noise, if any
    noise_scale: torch.Tensor | None = None  # [B] float: std of the additive noise (0 = none)

    def __post_init__(self):
        # shapes and dtypes only: nothing here makes the host wait for the device
        _field("tokens", self.tokens, 1, "integer token ids")
        rows = self.tokens.shape[0]
        if self.mixed is not None:
            _field("mixed", self.mixed, 1, "bool", rows)
            if self.ids is None or self.weights is None:
                raise ValueError("ExplorerStep: a step with `mixed` rows needs `ids` and `weights`")
        if self.ids is not None or self.weights is not None:
            _field("ids", self.ids, 2, "integer token ids", rows)
            _field("weights", self.weights, 2, "float", rows)
            if self.weights.shape != self.ids.shape:
                raise ValueError(
                    f"ExplorerStep: `weights` {tuple(self.weights.shape)} must have the shape of `ids` "
                    f"{tuple(self.ids.shape)}, [B, K]"
                )
        if (self.noise_seed is None) != (self.noise_scale is None):
            raise ValueError(
                "ExplorerStep: `noise_seed` and `noise_scale` come together (both [B] tensors, or neither)"
            )
        if self.noise_seed is not None:
            _field("noise_seed", self.noise_seed, 1, "integer", rows)
            _field("noise_scale", self.noise_scale, 1, "float", rows)


_KINDS = {
    "integer token ids": lambda t: not t.is_floating_point() and t.dtype != torch.bool and not t.is_complex(),
    "integer": lambda t: not t.is_floating_point() and t.dtype != torch.bool and not t.is_complex(),
    "bool": lambda t: t.dtype == torch.bool,
    "float": lambda t: t.is_floating_point(),
}


def _field(name: str, value, dims: int, kind: str, rows: int | None = None) -> None:
    """``ExplorerStep.<name>`` is a tensor of ``dims`` dimensions, of ``kind``, with ``rows`` rows."""
    shape = "[B]" if dims == 1 else "[B, K]"
    if not torch.is_tensor(value):
        raise ValueError(f"ExplorerStep: `{name}` must be a {shape} tensor ({kind}), got {type(value).__name__}")
    if value.dim() != dims or not _KINDS[kind](value) or (rows is not None and value.shape[0] != rows):
        raise ValueError(
            f"ExplorerStep: `{name}` must be a {shape} tensor ({kind}) of the step's {rows or 'B'} rows, "
            f"got {value.dtype} {list(value.shape)}"
        )


def explorer_step(explorer: Explorer, logits: torch.Tensor, generator: torch.Generator | None) -> ExplorerStep:
    """``explorer.step`` with its answer's shapes and types checked (no wait for the device)."""
    try:
        step = explorer.step(logits, generator=generator)
    except ValueError as err:
        if str(err).startswith("ExplorerStep:"):
            raise ValueError(f"{type(explorer).__name__}.step: {err}") from err
        raise
    if not isinstance(step, ExplorerStep):
        raise TypeError(f"{type(explorer).__name__}.step returned a {type(step).__name__}, not an ExplorerStep")
    if step.tokens.shape[0] != logits.shape[0]:
        raise ValueError(
            f"{type(explorer).__name__}.step returned {step.tokens.shape[0]} tokens for {logits.shape[0]} rows"
        )
    return step


def check_explorer(explorer: Explorer, vocab: int = 1024, dim: int = 16, rows: int = 64) -> None:
    """Run one step of a copy of ``explorer`` on made-up logits (``rows`` x ``vocab``) before any model loads and
    check its :class:`ExplorerStep` (shapes, types, ids, mixed rows' weights summing to 1); ``ValueError`` naming
    the class and the field otherwise."""
    import copy

    name = type(explorer).__name__
    trial = copy.deepcopy(explorer)  # the trial's counters and indices are not the run's
    vocab = max(vocab, *(2 * v for v in vars(explorer).values() if type(v) is int and 0 < v <= 65536), 1)
    made_up = torch.Generator().manual_seed(0)
    trial.set_special_ids([0])
    trial.prepare(torch.randn(vocab, dim, generator=made_up))
    logits = 4 * torch.randn(rows, vocab, generator=made_up)
    try:
        step = explorer_step(trial, logits, torch.Generator().manual_seed(1))
    except (TypeError, ValueError) as err:
        raise ValueError(str(err)) from err
    if int(step.tokens.min()) < 0 or int(step.tokens.max()) >= vocab:
        raise ValueError(f"{name}.step: `tokens` must be ids in [0, {vocab}) of the logits' columns")
    if step.mixed is None or not bool(step.mixed.any()):
        return
    ids, weights = step.ids[step.mixed], step.weights[step.mixed].float()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"{name}.step: `ids` of the mixed rows must be ids in [0, {vocab}) of the embedding rows")
    if bool((weights < 0).any()):
        raise ValueError(
            f"{name}.step: `weights` of the mixed rows must be non-negative, got {float(weights.min()):.3g}"
        )
    sums = weights.sum(dim=-1)
    if not torch.allclose(sums, torch.ones_like(sums), atol=1e-3):
        raise ValueError(
            f"{name}.step: `weights` of each mixed row must sum to 1 (a mixture of embeddings), got sums from "
            f"{float(sums.min()):.3g} to {float(sums.max()):.3g}; raw scores become weights through a softmax"
        )


class Explorer(ABC):
    """Base class of all explorers. Subclasses implement :meth:`step`.

    Attributes
    ----------
    temperature:
        The sampling temperature; rollout log-probs are ``log_softmax(logits / temperature)`` and training uses
        the same (1.0 if the explorer does not sample).
    sync_free:
        True when :meth:`step` never makes the host wait for the device (no ``.item()``, ``bool(t)``,
        ``nonzero``, boolean-mask indexing or data-dependent shape), so a GPU decoding loop queues steps without
        waiting. Check a claim with :class:`ngrpo_lightning.rollout.host_syncs.HostSyncs`.
    capturable:
        True when :meth:`step` can be recorded once as a CUDA graph and replayed
        (:mod:`ngrpo_lightning.rollout.step_graphs`): ``sync_free``, the same device work and output shapes at
        every step, randomness only from ``generator``, state kept only in tensors updated in place. A change of
        public settings or tensor addresses records it again. Read from the class that defines :meth:`step`
        (:func:`declares_capturable`); otherwise the step runs eagerly.
    answer_start:
        A marker text (e.g. ``"</think>"``): once a sequence has emitted it, the engine clears ``mixed`` for its
        steps, so exploration stops where the answer starts. ``None``: mix to the end.
    """

    temperature: float = 1.0
    sync_free: bool = False
    capturable: bool = False
    answer_start: str | None = None  # engines stop mixing a sequence once it has emitted this text
    registered_name: str = ""
    _special_ids: tuple[int, ...] = ()

    def set_special_ids(self, ids) -> None:
        """The ids never to pick by itself (special tokens, padded embedding rows); before :meth:`prepare`."""
        self._special_ids = tuple(sorted({int(i) for i in ids}))

    def prepare(self, embeddings: torch.Tensor) -> None:
        """Called before every rollout with ``E`` (V x d) on the decoding device; build indices here."""
        self.embeddings = embeddings

    @abstractmethod
    def step(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> ExplorerStep:
        """Decide one decoding step. ``logits`` is B x V (raw, untempered, float32)."""

    def state_dict(self) -> dict:
        """Explorer state saved in checkpoints (counters, schedules). Stateless by default."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_") and k != "embeddings")
        return f"{type(self).__name__}({fields})"


def declares_capturable(explorer: Explorer) -> bool:
    """Whether ``explorer``'s step may be recorded (:attr:`Explorer.capturable`), as declared by the class defining
    its :meth:`~Explorer.step` or a subclass of it, never by a base class."""
    for cls in type(explorer).__mro__:
        if "capturable" in vars(cls):
            return bool(explorer.capturable) and bool(explorer.sync_free)
        if "step" in vars(cls):
            return False
    return False


def check_range(
    key: str,
    value: float,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    integer: bool = False,
):
    """Check a number, errors naming ``explorer.<key>``; ``integer``: ints only (``explorer.k=2.5`` is refused)."""
    return check_number(f"explorer.{key}", value, low, high, low_open=low_open, integer=integer)


def check_choice(key: str, value, allowed) -> None:
    """Validate a categorical hyper-parameter; the error names ``explorer.<key>`` and the choices."""
    return _check_choice(f"explorer.{key}", value, allowed)


def check_answer_start(value) -> str | None:
    """``explorer.answer_start``: a non-empty text or null."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"explorer.answer_start={value!r} must be a non-empty text (e.g. '</think>') or null")
    return value
