"""The compute floor of a GRPO step: the matmul FLOPs of the passes it needs, and the machine's
dense matmul rate to divide them by (``harness.py floor`` and ``vs_trl`` report step / floor), the
bandwidth floor of its decoding steps, and the roofline that joins them at a decoding step's rows.

A forward costs 2 x parameters x tokens in its linear layers (the decoder body on every token,
the LM head on response tokens only) plus, in every layer, causal attention's two products
(scores Q K^T and their weighting of V): 2 x 2 x the query width per query-key pair, over
the pairs a causal model cannot skip (token i attends to the i tokens up to it). At 40-token
responses attention is under 3% of a step; at thousands of tokens it is the growing term. A
forward + backward costs 3x a forward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    body_params: int  # parameters a token passes through below the LM head (the embedding lookup excluded)
    head_params: int  # vocab x hidden: the LM head, applied where logits are needed
    hidden: int
    intermediate: int
    layers: int = 0  # decoder layers (0: attention not counted)
    attn_width: int = 0  # query heads x head dim: the width of the score and value products
    kv_width: int = 0  # key/value heads x head dim: one position's keys (or values) in one layer


def model_shape(model_path: str) -> ModelShape:
    """Parameter counts of a model, from its config (no weights loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    head = config.vocab_size * config.hidden_size
    untied = not getattr(config, "tie_word_embeddings", False)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelShape(
        total - head * (2 if untied else 1),
        head,
        config.hidden_size,
        config.intermediate_size,
        layers=config.num_hidden_layers,
        attn_width=heads * head_dim,
        kv_width=(getattr(config, "num_key_value_heads", None) or heads) * head_dim,
    )


def matmul_rates(shape: ModelShape, dtype: str, repeats: int = 10, device: str = "cpu") -> dict[str, float]:
    """Dense matmul FLOP/s on ``device`` (the CPU: this process's threads), best of ``repeats``
    [3000, hidden] x [hidden, intermediate] products, each way the device multiplies: ``plain``
    (``torch.matmul``: MKL's or cuBLAS's) and, on a CPU with oneDNN, ``packed`` (the weight in
    oneDNN's blocked layout, as the CPU backend multiplies where it measures that faster). The two
    differ by up to about 2x on some CPUs (MKL keeps to narrower kernels on AMD's), so a floor is
    counted at the faster: what the machine can do, not what one library does on it."""
    rates = {"plain": best_rate(shape, dtype, repeats, device, packed=False)}
    if device == "cpu":
        from ngrpo_lightning.backends.packing import packing_available

        if packing_available(getattr(torch, dtype)):
            rates["packed"] = best_rate(shape, dtype, repeats, device, packed=True)
    return rates


def best_rate(shape: ModelShape, dtype: str, repeats: int, device: str, packed: bool) -> float:
    """FLOP/s of the best of ``repeats`` products (:func:`matmul_rates`), after one warm-up."""
    from ngrpo_lightning.backends.packing import pack, packed_linear

    a = torch.randn(3000, shape.hidden, dtype=getattr(torch, dtype), device=device)
    w = torch.randn(shape.intermediate, shape.hidden, dtype=getattr(torch, dtype), device=device)
    if packed:
        weight = pack(w, a.shape[0])
        product = lambda: packed_linear(a, weight)
    else:
        wt = w.t().contiguous()
        product = lambda: torch.matmul(a, wt)
    wait = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    with torch.inference_mode():
        product()  # warm-up
        wait()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            product()
            wait()
            best = min(best, time.perf_counter() - t0)
    flops = 2 * a.shape[0] * shape.hidden * shape.intermediate / best
    if a.is_cuda:  # a parent process of measured runs: hold no GPU memory beside them
        del a, w
        torch.cuda.empty_cache()
    return flops


def matmul_rate(shape: ModelShape, dtype: str, repeats: int = 10, device: str = "cpu") -> float:
    """The faster of :func:`matmul_rates`: the rate a floor is counted at."""
    return max(matmul_rates(shape, dtype, repeats, device).values())


def attention_pairs(prompt_lengths: Sequence[int], response_lengths: Sequence[int], group: int) -> dict[str, int]:
    """Causal query-key pairs of a step's passes over its rows (grouped by prompt, ``group`` rows
    each): ``attn_pairs`` with each distinct prompt attended once (its rows' responses attend to
    it), ``attn_pairs_unshared`` with every row's whole sequence."""
    tri = lambda n: n * (n + 1) // 2
    responses = sum(r * p + tri(r) for p, r in zip(prompt_lengths, response_lengths, strict=True))
    return {
        "attn_pairs": sum(tri(p) for p in prompt_lengths[::group]) + responses,
        "attn_pairs_unshared": sum(tri(p + r) for p, r in zip(prompt_lengths, response_lengths, strict=True)),
    }


def linear_flops(shape: ModelShape, prompt_tokens: int, response_tokens: int) -> float:
    """A forward's linear layers: the decoder body on every token, the LM head on response tokens."""
    return 2 * (shape.body_params * (prompt_tokens + response_tokens) + shape.head_params * response_tokens)


def attention_flops(shape: ModelShape, pairs: int) -> float:
    """A forward's attention products over ``pairs`` query-key pairs: scores and weighted values,
    2 x query width each, in every layer."""
    return 4 * shape.layers * shape.attn_width * pairs


def phase_flops(step: dict, shape: ModelShape, shared: bool = True, frozen: bool = False) -> dict[str, float]:
    """Matmul FLOPs of one step's phases: ``rollout`` (every distinct prompt once, every response
    token), ``logprobs`` (the reference forward) and ``update`` (the training forward + backward,
    3 forwards). Each pass needs every distinct prompt once (a group's rows share it) and every
    response token; logits only at response tokens. ``shared=False``: the reference and training
    passes run every row's prompt (the floor of a step that does not share). ``frozen``: the
    weights get no gradients (LoRA: only the adapters train, whose products are not counted), so
    the linear layers' backward is the activations' gradients alone (training costs 2 of their
    forwards); attention has no weights, its backward is 2 forwards either way. Records without
    ``attn_pairs`` (tables before attention was counted) count none."""
    tokens = step["tokens"]
    rollout = linear_flops(shape, step["prompt_tokens"], tokens) + attention_flops(shape, step.get("attn_pairs", 0))
    prompt = step["prompt_tokens"] if shared else step["row_prompt_tokens"]
    linear = linear_flops(shape, prompt, tokens)
    attention = attention_flops(shape, step.get("attn_pairs" if shared else "attn_pairs_unshared", 0))
    return {"rollout": rollout, "logprobs": linear + attention, "update": (2 if frozen else 3) * linear + 3 * attention}


def step_flops(step: dict, shape: ModelShape, shared: bool = True, frozen: bool = False) -> float:
    """Matmul FLOPs one step needs: the sum of its :func:`phase_flops`."""
    return sum(phase_flops(step, shape, shared, frozen).values())


def read_bandwidth(repeats: int = 5, mib: int = 512) -> float:
    """Memory read bandwidth of this process's threads, bytes/s: best of ``repeats`` sums of a
    ``mib`` MiB float32 tensor (far larger than any cache)."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()  # warm-up: pages touched
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def decode_steps(step: dict) -> list[tuple[int, int]] | None:
    """``(rows, cached positions read)`` of each decoding step after the first token of a rollout
    whose rows all generate the same number of tokens (fixed lengths, the records' ``tokens`` =
    rows x length); ``None`` for natural lengths, whose per-step rows the records do not keep."""
    rows, tokens = step["rows"], step["tokens"]
    if not rows or tokens % rows:
        return None
    return [(rows, step["row_prompt_tokens"] + rows * t) for t in range(1, tokens // rows)]


def decode_bytes(shape: ModelShape, value_bytes: int) -> tuple[int, int]:
    """What a decoding step reads: every weight once, and per cached position of a row its keys
    and values in every layer (``value_bytes`` each: 4 in float32, 2 in bfloat16)."""
    return (shape.body_params + shape.head_params) * value_bytes, shape.layers * 2 * shape.kv_width * value_bytes


def decode_floor_s(step: dict, shape: ModelShape, bandwidth: float, value_bytes: int) -> float | None:
    """The bandwidth floor of a rollout's decoding steps after its first token (the prefill's):
    the bytes each reads (:func:`decode_bytes`) over ``bandwidth`` (bytes/s). ``None`` where
    :func:`decode_steps` is ``None`` or the shape has no ``kv_width``."""
    steps = decode_steps(step)
    if steps is None or not shape.kv_width:
        return None
    weights, per_position = decode_bytes(shape, value_bytes)
    return sum(weights + per_position * cached for _, cached in steps) / bandwidth


def linear_shapes(shape: ModelShape) -> list[tuple[int, int, int]]:
    """``(out, in, count)`` of a forward's linear layers: each decoder layer's q, k, v, o, gate, up and down, and
    the LM head (a Llama-style model)."""
    layer = [
        (shape.attn_width, shape.hidden, 1),
        (shape.kv_width, shape.hidden, 2),
        (shape.hidden, shape.attn_width, 1),
        (shape.intermediate, shape.hidden, 2),
        (shape.hidden, shape.intermediate, 1),
    ]
    head = (shape.head_params // shape.hidden, shape.hidden, 1)
    return [(n, k, count * shape.layers) for n, k, count in layer] + [head]


def decode_ways(shape: ModelShape, dtype: str, rows: int) -> dict[tuple[int, int], tuple[float, bool]]:
    """``(out, in) -> (seconds, packed)`` for each of the model's linear shapes at a decoding step's ``rows`` rows:
    timed plain and on a packed weight where this build packs, with the weight warm in the caches, the faster way
    kept (as the CPU backend chooses)."""
    from ngrpo_lightning.backends.packing import measure_decode, operands, packing_available
    from ngrpo_lightning.backends.probe import median_seconds

    kind = getattr(torch, dtype)
    ways = {}
    with torch.inference_mode():
        for n, k, _ in linear_shapes(shape):
            if packing_available(kind):
                timed = measure_decode(n, k, kind, rows)
                ways[n, k] = (min(timed.values()), timed["packed_s"] < timed["plain_s"])
            else:
                weight, x = operands(n, k, kind, rows)
                ways[n, k] = (median_seconds(lambda: torch.nn.functional.linear(x, weight), 0.04), False)  # noqa: B023
    return ways


def decode_products_s(shape: ModelShape, dtype: str, rows: int, ways: dict | None = None) -> float:
    """A CPU decoding step's products at ``rows`` rows, each shape the faster way with its weight warm in the caches
    (:func:`decode_ways`, or ``ways`` it gave): their arithmetic alone at the rate this machine multiplies that few
    rows."""
    ways = ways or decode_ways(shape, dtype, rows)
    return sum(count * ways[n, k][0] for n, k, count in linear_shapes(shape))


def decode_products_streamed_s(
    shape: ModelShape, dtype: str, rows: int, ways: dict | None = None, memory_share: float = 0.25
) -> float | None:
    """A CPU decoding step's products at ``rows`` rows as a step runs them: every product of the model on a weight
    of its own, in order, so each weight comes from memory rather than the caches; each shape the faster way
    (:func:`decode_ways`, or ``ways`` it gave). Beside :func:`decode_products_s` it says what reading the weights
    from memory costs at those rows. ``None`` where a copy of the weights would take more than ``memory_share`` of
    the memory available."""
    import psutil

    from ngrpo_lightning.backends.packing import operands, pack, packed_linear
    from ngrpo_lightning.backends.probe import median_seconds

    kind = getattr(torch, dtype)
    size = torch.empty(0, dtype=kind).element_size()
    if (shape.body_params + shape.head_params) * size > memory_share * psutil.virtual_memory().available:
        return None
    ways = ways or decode_ways(shape, dtype, rows)
    *layer, head = linear_shapes(shape)  # a layer's shapes, each `count` times over the model's layers
    products = [(n, k) for _ in range(shape.layers) for n, k, count in layer for _ in range(count // shape.layers)]
    products.append(head[:2])
    inputs = {k: operands(1, k, kind, rows)[1] for _, k in products}
    calls = []  # (product, input, a weight of its own), in a step's order
    linear = torch.nn.functional.linear
    for n, k in products:
        weight = operands(n, k, kind, 1)[0]
        packed = ways[n, k][1]
        calls.append((packed_linear, inputs[k], pack(weight, rows)) if packed else (linear, inputs[k], weight))

    def step() -> None:
        for product, x, weight in calls:
            product(x, weight)

    with torch.inference_mode():
        return median_seconds(step, 1.0, least=5)


def decode_roofline_s(step: dict, shape: ModelShape, rate: float, products_s: float, bandwidth: float,
                      value_bytes: int) -> float | None:  # fmt: skip
    """Generation's roofline: the prefill (and attention's products) at ``rate``, then each decoding step the longer
    of its products at their own rows' rate (``products_s``, :func:`decode_products_s`) and its weights' read at
    ``bandwidth``, plus its keys' and values' read. ``None`` where :func:`decode_steps` is."""
    steps = decode_steps(step)
    if steps is None or not shape.kv_width:
        return None
    weights, per_position = decode_bytes(shape, value_bytes)
    decoded = 2 * (shape.body_params + shape.head_params) * sum(rows for rows, _ in steps)
    prefill = (phase_flops(step, shape)["rollout"] - decoded) / rate
    reads = sum(max(products_s, weights / bandwidth) + per_position * cached / bandwidth for _, cached in steps)
    return prefill + reads
