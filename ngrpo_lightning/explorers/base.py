"""The Explorer contract: how the next input of one decoding step is formed.

An explorer sees the logits of one decoding step and decides, for every row of the
batch, (a) the token that is *emitted* (the text the reward sees) and (b) the input
embedding fed to the next step. Most steps are discrete: the next input is simply
``E[token]``. A *non-discrete* step feeds a mixture instead::

    e = sum_j weights[j] * E[ids[j]]  +  noise_scale * randn(d, seed=noise_seed)

Neighbor mixing (N-GRPO) uses K = k ids and no noise, Gumbel soft thinking the top-k
ids, Gaussian noise (STHT) one id plus noise. Engines record exactly these fields for
the non-discrete rows, and training rebuilds the same inputs from the record
(:func:`ngrpo_lightning.rollout.reconstruction.build_inputs_embeds`), so an explorer
never touches an engine or the training loop.

The contract, in the order an engine calls it before and during a rollout:

1. ``set_special_ids(ids)``: the tokenizer's special token ids (and any embedding rows no
   token maps to). Explorers that pick tokens by embedding geometry exclude them.
2. ``prepare(embeddings)``: the policy's input embedding matrix ``E`` (V x d), on the
   decoding device. Build or refresh indices here.
3. ``step(logits, generator)`` once per decoding step: logits B x V (raw, float32) in, an
   :class:`ExplorerStep` out. Draw all randomness from ``generator`` (on the logits'
   device) so that rollouts are reproducible from the engine's seed.

Explorers are pure torch: no Lightning, no engine imports. Register one by name with
:func:`register_explorer`, or select any subclass by class path (``explorer._target_=``).
"""

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
    """What an explorer decides for one decoding step of a batch of B rows.

    ``tokens`` is always set. The other fields describe the non-discrete rows and are
    ``None`` when every row is discrete (plain sampling). For a row with ``mixed[b]``
    false, the mixture fields of that row are ignored.
    """

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
    """``explorer.step`` as the engines call it, its answer checked (shapes and types: no wait for
    the device), so that a user's explorer that returns something else is named at once."""
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
    """Run one step of a copy of ``explorer`` on made-up logits (``rows`` x ``vocab``, a random
    ``vocab`` x ``dim`` embedding matrix), before any model loads: what it returns is an
    :class:`ExplorerStep` of the right shapes and types, its tokens and mixture ids are in the
    vocabulary, and each mixed row's weights are non-negative and sum to 1. ``ValueError`` naming
    the class and the field otherwise: an explorer that returned a tensor failed only after the
    model had loaded and validation had run, and weights that were raw logits trained silently."""
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
        The policy's sampling temperature. Engines compute the rollout log-probs of the
        emitted tokens as ``log_softmax(logits / temperature)`` and training uses the same
        temperature, so every explorer must define it (1.0 if it does not sample).
    sync_free:
        True when :meth:`step` never makes the host wait for the device: no ``.item()``,
        ``bool(t)``, ``nonzero``, boolean-mask indexing or shape that depends on the data. On a
        GPU the decoding loop then queues step after step without waiting; an explorer that does
        not declare it still works, and the engine says once at the start that it may wait per
        token. Check a claim with :class:`ngrpo_lightning.rollout.host_syncs.HostSyncs`.
    capturable:
        True when :meth:`step` can be recorded once as a CUDA graph and replayed at every later
        step (:mod:`ngrpo_lightning.rollout.step_graphs`): it is ``sync_free``; it does the same
        device work at every step, returning the same fields of the same shapes; its randomness
        comes only from ``generator``; and any state it keeps between steps is a tensor updated in
        place (Python attributes set in :meth:`step` are read once, when the step is recorded).
        A recorded step is replayed while the explorer's public settings and the addresses of its
        tensors stay as they were; a change records it again.
        Read from the class that defines :meth:`step` (:func:`declares_capturable`), so a subclass
        with a step of its own declares it again. Otherwise, on a GPU, the step runs eagerly
        between the model's replayed steps, and the engine says so once.
    answer_start:
        A marker text (e.g. ``"</think>"``): once a sequence has emitted its tokens, the engine
        clears ``mixed`` for that sequence's steps (the one completing the marker included), so
        exploration stops where the answer starts. ``None``: mix to the end.
    """

    temperature: float = 1.0
    sync_free: bool = False
    capturable: bool = False
    answer_start: str | None = None  # engines stop mixing a sequence once it has emitted this text
    registered_name: str = ""
    _special_ids: tuple[int, ...] = ()

    def set_special_ids(self, ids) -> None:
        """Called by the engine before :meth:`prepare` with the ids an explorer should never
        pick by itself: the tokenizer's special tokens and padded embedding rows."""
        self._special_ids = tuple(sorted({int(i) for i in ids}))

    def prepare(self, embeddings: torch.Tensor) -> None:
        """Called by the engine before every rollout with the policy's input embedding
        matrix ``E`` (V x d), on the device where decoding runs. Build indices here."""
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
    """Whether ``explorer``'s step may be recorded (:attr:`Explorer.capturable`): as declared by
    the class that defines its :meth:`~Explorer.step` or by a subclass of it, never by a base class
    whose step it replaced."""
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
    """Validate a numeric hyper-parameter at construction time; the error names ``explorer.<key>``.
    ``integer``: a count (``k``, ``top_k``) must be an int, so ``explorer.k=2.5`` is refused rather
    than truncated."""
    return check_number(f"explorer.{key}", value, low, high, low_open=low_open, integer=integer)


def check_choice(key: str, value, allowed) -> None:
    """Validate a categorical hyper-parameter; the error names ``explorer.<key>`` and the choices."""
    return _check_choice(f"explorer.{key}", value, allowed)


def check_answer_start(value) -> str | None:
    """``explorer.answer_start``: a non-empty text or null."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"explorer.answer_start={value!r} must be a non-empty text (e.g. '</think>') or null")
    return value
