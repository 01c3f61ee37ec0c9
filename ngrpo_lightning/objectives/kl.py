"""Per-token KL estimators between the policy and a reference (Schulman's k1/k2/k3).

With ``log_r = log pi_ref(y) - log pi(y)`` for tokens ``y ~ pi``: k1 = -log_r (unbiased, high variance, signed),
k2 = log_r^2 / 2 (biased, second-order), k3 = exp(log_r) - 1 - log_r (unbiased, non-negative, low variance)."""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of the sampled tokens."""
    log_r = (ref_logp - logp).clamp(-20.0, 20.0)  # clamp: one wild token must not overflow exp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"objective.kl_estimator={estimator!r} is unknown: allowed {list(KL_ESTIMATORS)}")


def reference_kl(
    logp, ref_logp, kl_coef: float, estimator: str = "k3", clamp: float | None = None
) -> torch.Tensor | None:
    """The per-token KL penalty term, or None when ``kl_coef == 0``; ``clamp`` bounds each token's
    estimate to ``[-clamp, clamp]`` (verl's ``low_var_kl``: k3 clamped at 10), so one far token
    cannot dominate. Fails clearly when a KL weight is set without reference log-probs."""
    if kl_coef <= 0:
        return None
    if ref_logp is None:
        raise ValueError("objective.kl_coef > 0 but no reference log-probs were given (is a reference model loaded?)")
    kl = kl_penalty(logp, ref_logp, estimator)
    return kl if clamp is None else kl.clamp(-clamp, clamp)
