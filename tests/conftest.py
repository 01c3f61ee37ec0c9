"""Shared fixtures: real models (the tiny random Llama and the packaged SmolLM2) loaded once."""

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    from ngrpo_lightning.models import load_tokenizer

    return load_tokenizer("tiny")


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the tiny random Llama, fp32."""
    from ngrpo_lightning.models import load_policy

    return load_policy("tiny")


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the packaged SmolLM2-135M-Instruct, fp32."""
    from ngrpo_lightning.models import load_policy

    return load_policy("smollm2-135m-instruct")


def chat_prompt_ids(tokenizer, questions):
    """Token ids of chat-templated prompts asking for a boxed answer."""
    from ngrpo_lightning.data import render_prompt

    return [tokenizer(render_prompt(tokenizer, q), add_special_tokens=False)["input_ids"] for q in questions]


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    return torch.Generator().manual_seed(0)
