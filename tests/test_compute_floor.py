"""benchmarks/compute_floor.py: the FLOPs the benchmarks divide by are the ones a forward runs.

The linear and attention terms are checked against torch's own FLOP counter on the tiny model's
real forward (eager attention, which multiplies every query-key pair, so the counter sees
``tokens^2`` pairs); the causal pair count against explicit masks.
"""

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import compute_floor  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    from ngrpo_lightning.models import resolve_model_path

    path = resolve_model_path("tiny")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    return model, compute_floor.model_shape(path)


def test_shape_reads_layers_and_attention_width(tiny):
    model, shape = tiny
    config = model.config
    assert (shape.layers, shape.attn_width) == (config.num_hidden_layers, config.num_attention_heads * config.head_dim)
    assert shape.head_params == config.vocab_size * config.hidden_size


def test_linear_and_attention_terms_match_torch_flop_counter(tiny):
    model, shape = tiny
    tokens = 96
    ids = torch.randint(3, model.config.vocab_size, (1, tokens))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids)  # logits at every position: all tokens count as "response" tokens
    counts = counter.get_flop_counts()["Global"]
    linear = sum(n for op, n in counts.items() if "bmm" not in str(op))
    attention = sum(n for op, n in counts.items() if "bmm" in str(op))
    assert linear == pytest.approx(compute_floor.linear_flops(shape, 0, tokens), rel=1e-3)
    # eager attention multiplies all tokens^2 pairs (the floor counts the causal half of them)
    assert attention == pytest.approx(compute_floor.attention_flops(shape, tokens * tokens), rel=1e-3)


def test_causal_pairs_match_explicit_masks():
    prompts, responses, group = [5, 5, 9, 9], [3, 7, 1, 4], 2
    causal = lambda n: int(torch.ones(n, n).tril().sum())
    pairs = compute_floor.attention_pairs(prompts, responses, group)
    assert pairs["attn_pairs_unshared"] == sum(causal(p + r) for p, r in zip(prompts, responses))
    # shared: each distinct prompt's own pairs once; each row's response tokens attend to it and themselves
    shared = causal(5) + causal(9) + sum(causal(p + r) - causal(p) for p, r in zip(prompts, responses))
    assert pairs["attn_pairs"] == shared


def test_frozen_weights_drop_one_linear_pass_and_no_attention(tiny):
    _, shape = tiny
    step = {"tokens": 64, "prompt_tokens": 30, "row_prompt_tokens": 60}
    step |= compute_floor.attention_pairs([15, 15, 15, 15], [16] * 4, 2)
    for shared, prompt in ((True, 30), (False, 60)):
        full = compute_floor.step_flops(step, shape, shared=shared)
        frozen = compute_floor.step_flops(step, shape, shared=shared, frozen=True)
        assert full - frozen == compute_floor.linear_flops(shape, prompt, 64)
    without = {k: v for k, v in step.items() if not k.startswith("attn")}
    assert compute_floor.step_flops(without, shape) < compute_floor.step_flops(step, shape)
