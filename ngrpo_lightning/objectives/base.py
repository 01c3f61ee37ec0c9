"""The PolicyObjective contract: recorded rollouts -> one scalar loss.

An objective is a pure function of per-token tensors (all [N, L], aligned with the response tokens)::

    loss, metrics = objective(logp, old_logp, ref_logp, advantages, mask)

``logp`` carries gradients; ``old_logp`` is the behaviour policy, ``ref_logp`` the frozen reference (``None`` without
KL), ``advantages`` one scalar per sequence ([N]), ``mask`` the response mask. Classes hold validated
hyper-parameters; the maths is a plain function beside each. Register one with :func:`register_objective`
(``objective.name=<name>``) or select a class path (``objective._target_=pkg.Class``). Class attributes tell the
module how to use it: ``kl_coef`` > 0 loads a frozen reference; ``loss_agg`` weighs micro-batches by tokens
(``token-mean``) or sequences, so micro-batched gradients equal the full batch's; ``token_advantages = True`` accepts
per-token advantages [N, L] (needed for per-token ``train.tis_cap``)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ngrpo_lightning.checks import check_choice, check_number
from ngrpo_lightning.objectives.aggregation import AGGREGATIONS
from ngrpo_lightning.registry import Registry

__all__ = [
    "OBJECTIVES",
    "PolicyObjective",
    "check_objective",
    "check_objective_choice",
    "check_objective_key",
    "register_objective",
]

OBJECTIVES = Registry("objective", key="objective.name")
register_objective = OBJECTIVES.register  # class decorator: selectable as ``objective.name=<name>``


class PolicyObjective(ABC):
    """Base class. ``kl_coef`` > 0 tells the module to load a frozen reference model;
    ``loss_agg`` is the loss's aggregation mode (see :mod:`.aggregation`)."""

    kl_coef: float = 0.0
    loss_agg: str = "seq-mean-token-mean"
    registered_name: str = ""
    token_advantages: bool = False  # True if ``advantages`` may also be per token [N, L] (train.tis_cap needs it)

    @abstractmethod
    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        ref_logp: torch.Tensor | None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return (loss, metrics) for the given per-token tensors."""

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def check_objective_key(key: str, value: float, low: float = 0.0):
    """Fail with ``objective.<key>`` named when ``value`` is not a number >= ``low``."""
    return check_number(f"objective.{key}", value, low)


def check_objective_choice(key: str, value: str, allowed) -> None:
    """Fail with ``objective.<key>`` named and the allowed values."""
    return check_choice(f"objective.{key}", value, allowed)


def check_objective(objective: PolicyObjective) -> None:
    """Try ``objective`` on made-up tensors (2 rollouts of 3 tokens): a known ``loss_agg`` and ``(scalar loss with a
    gradient, metrics dict)`` returned, else ``ValueError`` naming the class (not an obscure failure mid-update)."""
    name = type(objective).__name__
    if objective.loss_agg not in AGGREGATIONS:
        raise ValueError(f"{name}.loss_agg={objective.loss_agg!r} is unknown: allowed {list(AGGREGATIONS)}")
    logp = torch.linspace(-2.0, -0.5, 6).view(2, 3).requires_grad_()
    old = logp.detach() - 0.1
    out = objective(logp, old, old if objective.needs_reference else None, torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else f"a {type(out).__name__}"
        raise ValueError(f"{name} returned {got}: an objective returns (loss, metrics), metrics a dict of scalars")
    loss = out[0]
    if not torch.is_tensor(loss) or loss.dim() != 0:
        got = f"shape {list(loss.shape)}" if torch.is_tensor(loss) else type(loss).__name__
        raise ValueError(
            f"{name}'s loss must be one number (a 0-d tensor; aggregate() reduces per-token losses), got {got}"
        )
    if not loss.requires_grad:
        raise ValueError(f"{name}'s loss has no gradient with respect to logp: nothing would be learned")
