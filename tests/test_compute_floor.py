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

    from ngrpo_lightning.models.loading import resolve_model_path

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


def test_the_linear_shapes_are_the_models_linear_layers(tiny):
    model, shape = tiny
    linears = sorted(tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear))
    listed = sorted((n, k) for n, k, count in compute_floor.linear_shapes(shape) for _ in range(count))
    assert listed == linears


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


def test_a_steps_phases_add_up_to_it_the_update_three_reference_forwards(tiny):
    _, shape = tiny
    step = {"tokens": 64, "prompt_tokens": 30, "row_prompt_tokens": 60}
    step |= compute_floor.attention_pairs([15, 15, 15, 15], [16] * 4, 2)
    for frozen in (False, True):
        phases = compute_floor.phase_flops(step, shape, frozen=frozen)
        assert list(phases) == ["rollout", "logprobs", "update"]
        assert sum(phases.values()) == compute_floor.step_flops(step, shape, frozen=frozen)
    full, frozen = compute_floor.phase_flops(step, shape), compute_floor.phase_flops(step, shape, frozen=True)
    assert full["update"] == 3 * full["logprobs"]  # a forward and a backward of two forwards
    assert full["update"] - frozen["update"] == compute_floor.linear_flops(shape, 30, 64)  # no weight gradients
    assert full["logprobs"] == frozen["logprobs"]  # the reference is the same forward either way


# ------------------------------------------------------------------ decoding's reads (the bandwidth floor)
SHAPE = compute_floor.ModelShape(
    body_params=1000, head_params=500, hidden=8, intermediate=16, layers=2, attn_width=8, kv_width=4
)


def fixed_step(rows=4, length=5, prompt=3):
    pairs = compute_floor.attention_pairs([prompt] * rows, [length] * rows, group=2)
    counts = dict(rows=rows, tokens=rows * length, row_prompt_tokens=rows * prompt, prompt_tokens=rows // 2 * prompt)
    return counts | pairs


def test_decoding_steps_read_every_rows_cache():
    assert compute_floor.decode_steps(fixed_step()) == [(4, 12 + 4 * t) for t in range(1, 5)]
    assert compute_floor.decode_steps({**fixed_step(), "tokens": 19}) is None  # natural lengths: rows unknown per step


def test_the_decoding_floor_is_the_bytes_every_decoding_step_reads_over_the_bandwidth():
    step = fixed_step()  # 4 rows x 5 tokens: 4 decoding steps after the prefill's token
    reads = [1500 * 2 + 2 * 2 * 4 * 2 * (12 + 4 * t) for t in range(1, 5)]  # weights, then every row's cache
    assert compute_floor.decode_floor_s(step, SHAPE, 10.0, 2) == pytest.approx(sum(reads) / 10.0)
    assert compute_floor.decode_floor_s({**step, "tokens": 19}, SHAPE, 10.0, 2) is None


def test_the_roofline_takes_the_longer_of_a_decoding_steps_products_and_weights_read():
    step, rate, bandwidth = fixed_step(), 1e3, 1e4  # a step reads its weights in 0.3 s
    rollout = compute_floor.phase_flops(step, SHAPE)["rollout"]
    prefill = (rollout - 2 * 1500 * 4 * 4) / rate  # 4 decoding steps of 4 rows, every weight per token
    # products faster than the weights' read: the bandwidth floor of the decoding steps
    quick = compute_floor.decode_roofline_s(step, SHAPE, rate, 1e-9, bandwidth, 2)
    assert quick == pytest.approx(prefill + compute_floor.decode_floor_s(step, SHAPE, bandwidth, 2))
    # products slower: each step's products, then its keys' and values' read
    cache = sum(2 * 2 * 4 * 2 * (12 + 4 * t) for t in range(1, 5)) / bandwidth
    assert compute_floor.decode_roofline_s(step, SHAPE, rate, 7.0, bandwidth, 2) == pytest.approx(prefill + 28 + cache)
    assert compute_floor.decode_roofline_s({**step, "tokens": 19}, SHAPE, rate, 7.0, bandwidth, 2) is None


def test_a_decoding_steps_products_are_timed_at_its_rows(tiny):
    _, shape = tiny
    assert 0 < compute_floor.decode_products_s(shape, "float32", rows=4) < 1.0


def test_a_decoding_steps_products_streamed_are_timed_on_a_weight_each_within_the_memory_allowed(tiny):
    _, shape = tiny
    assert 0 < compute_floor.decode_products_streamed_s(shape, "float32", rows=4) < 1.0
    # a copy of the weights that would take more than the share of memory allowed: not measured
    assert compute_floor.decode_products_streamed_s(shape, "float32", rows=4, memory_share=1e-12) is None


def test_a_floor_row_leaves_out_the_first_and_the_profiled_step_and_divides_by_their_flops():
    import floor
    import workloads

    step = lambda t, extra=0.0: fixed_step() | {
        "step_s": t, "gen_s": t / 4, "reward_s": 0.0, "logprobs_s": t / 4, "update_s": t / 2,
        "rss_bytes": 2**30, "graph_record_s": extra, "logprob_diff_max": 0.0,
    }  # fmt: skip
    profiled = step(50.0) | {"rss_bytes": 2**32}  # the profiler's own records: not the loop's peak
    phases = {"rollout": {"products_s": 0.5}, "reward": {"products_s": None}, "update": {"products_s": 1.5}}
    run = {"steps": [step(9.0, 1.0), step(2.0), step(4.0), profiled], "profile": {"step": 3, "phases": phases}}
    run |= {"peak_rss_bytes": 2**30, "tree_peak_rss_bytes": 2**31, "wall_s": 70.0}
    rate = 1e3
    row = floor.summary(
        {"mode": "full"}, [run], workloads.side_by_side(), {"shape": SHAPE, "rate": rate, "bandwidth": 10.0}
    )
    assert row["step_s"] == 3.0  # the median of steps 1 and 2: the first (warm-up) and the profiled one left out
    flops = compute_floor.step_flops(fixed_step(), SHAPE)
    assert row["floor_s"] == pytest.approx(flops / rate) and row["x_floor"] == pytest.approx(3.0 * rate / flops)
    assert row["warmup_s"] == 6.0 and row["graph_record_s"] == 1.0 and row["startup_s"] == 5.0
    assert row["gen_x_floor"] == pytest.approx(0.75 / compute_floor.decode_floor_s(fixed_step(), SHAPE, 10.0, 4))
    assert row["steal_pct"] is None  # the run said nothing of stolen time
    assert row["loop_rss_gib"] == 1.0 and row["cmd_rss_gib"] == 1.0
    assert row["products_x_floor"] == pytest.approx(2.0 / row["floor_s"])  # the profiled step's products alone
    assert "gen_x_roofline" not in row  # no decoding products measured (a GPU's floor)
    floor_ = {"shape": SHAPE, "rate": rate, "bandwidth": 10.0, "products": 0.5}
    row = floor.summary({"mode": "full"}, [run], workloads.side_by_side(), floor_)
    roof = compute_floor.decode_roofline_s(fixed_step(), SHAPE, rate, 0.5, 10.0, 4)
    assert row["gen_x_roofline"] == pytest.approx(0.75 / roof)
    passes = (flops - compute_floor.phase_flops(fixed_step(), SHAPE)["rollout"]) / rate
    assert row["x_roofline"] == pytest.approx(3.0 / (roof + passes))
    assert "gen_x_streamed" not in row  # no products measured as a step streams their weights
    slow = 1e6  # a step's products longer than its weights' read at that bandwidth
    row = floor.summary({"mode": "full"}, [run], workloads.side_by_side(), floor_ | {"streamed": slow})
    streamed = compute_floor.decode_roofline_s(fixed_step(), SHAPE, rate, slow, 10.0, 4)
    assert streamed > roof and row["gen_x_streamed"] == pytest.approx(0.75 / streamed)
    assert row["gen_x_roofline"] == pytest.approx(0.75 / roof)  # the roofline itself unchanged


def test_the_floor_is_counted_at_the_faster_way_the_machine_multiplies():
    """``matmul_rates`` times each way (torch.matmul; oneDNN's packed product where this build
    has it) and the floor divides by the faster, so a library's narrow kernels never set it."""
    import floor
    from common import stolen_pct

    from ngrpo_lightning.backends.packing import packing_available

    shape = compute_floor.ModelShape(0, 0, hidden=64, intermediate=96)
    rates = compute_floor.matmul_rates(shape, "float32", repeats=2)
    assert rates["plain"] > 0 and ("packed" in rates) == packing_available(torch.float32)
    first = {"shape": shape, "rate": max(rates.values()), "rates": rates, "bandwidth": None}
    again = {**first, "rates": {way: 2 * r for way, r in rates.items()}, "rate": 2 * first["rate"]}
    best = floor.better_floor(first, again)
    assert best["rate"] == 2 * first["rate"] and best["rates"] == again["rates"] and best["bandwidth"] is None
    # decoding products: the shorter of the two times, and none where neither measured them
    assert best["products"] is None and best["streamed"] is None
    best = floor.better_floor(first | {"products": 2.0, "streamed": 3.0}, again | {"products": 1.0})
    assert best["products"] == 1.0 and best["streamed"] == 3.0
    # a host that gave a quarter of the interval's CPU time to other machines
    before = {"user": 100, "system": 0, "idle": 0, "steal": 0}
    assert stolen_pct(before, {"user": 130, "system": 0, "idle": 60, "steal": 30}) == pytest.approx(25.0)
    assert stolen_pct({}, before) is None
