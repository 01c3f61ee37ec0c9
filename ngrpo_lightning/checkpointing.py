"""What a checkpoint holds beyond Lightning's own state: RNG states and the run's config check."""

from __future__ import annotations

import random

import torch


def rng_states() -> dict:
    """Python, NumPy, torch (and CUDA) RNG states of this process."""
    import numpy as np

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "gauss": float(gauss)}  # tensors and scalars: loadable with weights_only
    states = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    import numpy as np

    if "python" in states:
        random.setstate(states["python"])
    if "numpy" in states:
        n = states["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "torch" in states:
        torch.set_rng_state(states["torch"].cpu())
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# config keys that may change between a run and its resumption
RESUMABLE_KEYS = ("resume", "output_dir", "logger", "validate_before_fit", "checkpoint", "trainer.max_steps",
                  "trainer.max_epochs", "trainer.enable_progress_bar", "trainer.val_check_interval", "trainer.log_every_n_steps",
                  "reward.num_workers", "reward.timeout_s", "experiment_name")


def config_mismatch(saved: dict, current: dict, prefix: str = "") -> str | None:
    """The first difference between two resolved configs that forbids resuming (``None`` if none)."""
    for key in sorted(set(saved) | set(current)):
        name = f"{prefix}{key}"
        if name in RESUMABLE_KEYS:
            continue
        a, b = saved.get(key, "<unset>"), current.get(key, "<unset>")
        if isinstance(a, dict) and isinstance(b, dict):
            inner = config_mismatch(a, b, name + ".")
            if inner:
                return inner
        elif a != b:
            return f"{name} differs: the checkpoint has {a!r}, this run has {b!r}"
    return None
