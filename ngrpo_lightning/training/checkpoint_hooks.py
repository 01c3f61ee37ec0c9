"""What :class:`~ngrpo_lightning.training.module.RLModule` adds to Lightning's checkpoints, and leaves out.

Beside Lightning's own state the module saves the explorer's state, the update plan's shuffling, the RNG states and
what identifies the run, and leaves out the frozen weights (reference, LoRA base), recorded by name and SHA-256 and
checked on resume.
"""

from __future__ import annotations

import lightning as L

from ngrpo_lightning.backends import file_weights
from ngrpo_lightning.checkpoints.run import (
    check_base_model,
    config_mismatch,
    rng_states,
    set_rng_states,
    weights_digest,
)
from ngrpo_lightning.models import lora


class CheckpointHooks:
    """The checkpoint hooks of ``RLModule`` (a mixin before ``L.LightningModule``)."""

    def setup(self, stage: str) -> None:
        """Record the frozen reference's identity (before any sharding), saved in place of its weights."""
        if self.reference is not None and not self.base_model:
            with file_weights.materialized(self.reference):  # a file-backed one is read back for the hash
                self.base_model = {
                    "name_or_path": str(getattr(self.reference, "name_or_path", "") or ""),
                    "weights_sha256": weights_digest(self.reference),
                }
        elif self.adapters and not self.base_model:  # the base weights inside the peft policy
            base = self.policy.get_base_model()
            self.base_model = {
                "name_or_path": str(getattr(base, "name_or_path", "") or ""),
                "weights_sha256": weights_digest(self.policy, keep=lambda name: not lora.is_adapter_weight(name)),
            }

    def state_dict(self, *args, **kwargs) -> dict:
        """The module's state without the frozen reference (and, with adapters, base) weights."""
        state = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        for key in [k for k in state if k.startswith(f"{prefix}reference.")]:
            del state[key]
        if self.adapters:
            policy = f"{prefix}policy."
            for key in [k for k in state if k.startswith(policy) and not lora.is_adapter_weight(k[len(policy) :])]:
                del state[key]
        return state

    # ---------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["explorer"] = self.explorer.state_dict()  # counters and schedules (e.g. index refresh)
        checkpoint["update_plan"] = self.plan.state_dict()  # the mini-batch shuffling
        checkpoint["policy_version"] = self.policy_version.state_dict()
        checkpoint["rng"] = rng_states()
        checkpoint["ngrpo"] = {
            **self.run_meta,
            "base_model": dict(self.base_model),
            "backend_choices": self.backend.recorded_choices(),  # a resumed run decides the same
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get("ngrpo") or {}
        if saved.get("config") is not None and self.run_meta.get("config") is not None:
            problem = config_mismatch(saved["config"], self.run_meta["config"])
            if problem:
                raise ValueError(f"cannot resume from this checkpoint: {problem}")
        if self.adapters or not any(k.startswith("reference.") for k in checkpoint.get("state_dict", {})):
            check_base_model(saved.get("base_model") or {}, self.base_model)
        self.explorer.load_state_dict(checkpoint.get("explorer", {}))
        self.plan.load_state_dict(checkpoint.get("update_plan", {}))
        # checkpoints from before the version was saved: one optimizer step per global step
        self.policy_version.load_state_dict(
            checkpoint.get("policy_version") or {"value": checkpoint.get("global_step", 0)}
        )
        if "rng" in checkpoint:
            set_rng_states(checkpoint["rng"])


def reference_not_required(module: L.LightningModule, incompatible) -> None:
    """``load_state_dict`` post-hook: absent ``reference.*`` weights are not missing keys."""
    base = "policy."  # with adapters, the frozen base weights are not in checkpoints either
    incompatible.missing_keys[:] = [
        k
        for k in incompatible.missing_keys
        if not k.startswith("reference.")
        and not (module.adapters and k.startswith(base) and not lora.is_adapter_weight(k[len(base) :]))
    ]
