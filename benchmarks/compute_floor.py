"""The compute floor of a GRPO step: the matmul FLOPs of the passes it needs, and the machine's
dense matmul rate to divide them by (``benchmarks/vs_trl.py`` reports step / floor).

A forward costs 2 x parameters x tokens (the decoder body on every token, the LM head on
response tokens only; attention score/value products left out, under 3% at the benchmark's
lengths); a forward + backward 3x that.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    body_params: int  # parameters a token passes through below the LM head (the embedding lookup excluded)
    head_params: int  # vocab x hidden: the LM head, applied where logits are needed
    hidden: int
    intermediate: int


def model_shape(model_path: str) -> ModelShape:
    """Parameter counts of a model, from its config (no weights loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    head = config.vocab_size * config.hidden_size
    untied = not getattr(config, "tie_word_embeddings", False)
    return ModelShape(total - head * (2 if untied else 1), head, config.hidden_size, config.intermediate_size)


def matmul_rate(shape: ModelShape, dtype: str, repeats: int = 10) -> float:
    """Dense matmul FLOP/s of this process's threads: best of ``repeats`` [3000, hidden] x [hidden, intermediate]."""
    a = torch.randn(3000, shape.hidden, dtype=getattr(torch, dtype))
    b = torch.randn(shape.hidden, shape.intermediate, dtype=getattr(torch, dtype))
    torch.matmul(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.shape[0] * shape.hidden * shape.intermediate / best


def step_flops(step: dict, shape: ModelShape, shared: bool = True, frozen: bool = False) -> float:
    """Matmul FLOPs one step needs: the rollout, the reference forward and the training forward +
    backward (3 forwards). Each pass needs every distinct prompt once (a group's rows share it)
    and every response token; logits only at response tokens. ``shared=False``: the reference
    and training passes run every row's prompt (the floor of a step that does not share).
    ``frozen``: the weights get no gradients (LoRA: only the adapters train, whose products are
    not counted), so backward is the activations' gradients alone: training costs 2 forwards."""

    def forward(prompt_tokens: int) -> float:
        return 2 * (shape.body_params * (prompt_tokens + step["tokens"]) + shape.head_params * step["tokens"])

    passes = forward(step["prompt_tokens"] if shared else step["row_prompt_tokens"])
    return forward(step["prompt_tokens"]) + passes + (2 if frozen else 3) * passes  # rollout, reference, training
