"""Decoding on a static KV cache (the CUDA backend's fixed-shape step, rollout/static_cache.py)
against the growing cache: the same tokens, log-probs and records, and rows that end leave the
batch in buckets, for every built-in explorer."""

import shutil

import pytest
import torch
from conftest import chat_prompt_ids
from test_hf_engine_live_rows import (
    BUILT_IN,
    QUESTIONS,
    EndAtStep,
    assert_same_rollouts,
    count_batch_rows,
    how_rollouts_differ,
)

from ngrpo_lightning.backends.width_buckets import bucket_width
from ngrpo_lightning.rollout import HFEngine
from ngrpo_lightning.rollout.static_cache import RowsStaticLayer, WritePositions, batch_buckets
from ngrpo_lightning.training.forward import response_logprobs

EXPLORERS = BUILT_IN
ENDS = [0, 5, 2, 9, 8, 3]


def decode(model, tok, make, static: bool, **kwargs):
    engine = HFEngine(model, tok, max_new_tokens=12, seed=0, static_cache=static, **kwargs)
    explorer = EndAtStep(make(), ENDS, engine.eos_ids[0])
    sizes, handle = count_batch_rows(model)
    try:
        return engine.generate(chat_prompt_ids(tok, QUESTIONS), explorer, n=2), sizes
    finally:
        handle.remove()


def test_batch_buckets():
    assert batch_buckets(6) == [1, 2, 4, 6] and batch_buckets(8) == [1, 2, 4, 8] and batch_buckets(1) == [1]


@pytest.mark.parametrize("name", sorted(EXPLORERS))
def test_static_decoding_gives_the_rollouts_of_the_growing_cache(tiny, name):
    model, tok = tiny
    grown, grown_sizes = decode(model, tok, EXPLORERS[name], static=False)
    fixed, sizes = decode(model, tok, EXPLORERS[name], static=True)
    assert_same_rollouts(fixed, grown)
    # the prefill once per prompt, then the batch in buckets of 6, 4, 2, 1 rows (ended rows top them up)
    assert sizes[0] == 3 and set(sizes[1:]) <= {6, 4, 2, 1} and sizes[1:] == sorted(sizes[1:], reverse=True)
    assert sum(sizes) >= sum(grown_sizes) and min(sizes) < 6
    m = fixed.response_mask.bool()
    with torch.no_grad():  # training rebuilds the inputs the static batch saw
        logp, _ = response_logprobs(model, fixed, 1.0)
    assert (logp - fixed.rollout_logprobs)[m].abs().max() < 1e-4


def test_static_decoding_with_the_host_looking_every_few_steps(tiny):
    model, tok = tiny
    grown, _ = decode(model, tok, EXPLORERS["neighbor"], static=False)
    fixed, sizes = decode(model, tok, EXPLORERS["neighbor"], static=True, checks_every=4)
    assert_same_rollouts(fixed, grown)
    assert set(sizes[1:]) <= {6, 4, 2, 1}


def test_a_static_layer_moves_rows_in_place():
    layer = RowsStaticLayer(max_cache_len=5, capacity=4)
    keys = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 1, 3, 2)
    layer.update(keys, keys + 100)
    buffer = layer.key_buffer
    layer.select_rows(torch.tensor([0, 0, 1, 1]))  # a group's prefill repeated to its samples
    assert layer.keys.shape[0] == 4 and layer.key_buffer is buffer  # the same storage: a graph's addresses hold
    assert torch.equal(layer.keys[:, :, :3], keys.repeat_interleave(2, 0))
    layer.select_rows(torch.tensor([3, 0]))  # a row moves to where another leaves
    assert torch.equal(layer.keys[:, :, :3], keys[[1, 0]]) and torch.equal(layer.values[:, :, :3], keys[[1, 0]] + 100)


def test_a_caches_layers_share_where_a_step_writes():
    """The first layer works out the step's positions and advances the one counter; every layer
    writes its own keys and values there. One position computation per step, not one per layer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Aranges(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Aranges.calls += func.__name__.startswith("arange")
            return func(*args, **(kwargs or {}))

    positions = WritePositions()
    layers = [RowsStaticLayer(6, 2, positions, leads=i == 0) for i in range(3)]
    prefill = [torch.randn(2, 1, 4, 3) for _ in layers]
    step = [torch.randn(2, 1, 1, 3) for _ in layers]
    for layer, states in zip(layers, prefill):
        layer.update(states, -states)
    with Aranges():
        for layer, states in zip(layers, step):
            layer.update(states, -states)
    assert Aranges.calls == 1
    assert positions.length.item() == 5 and all(layer.get_seq_length() is positions.length for layer in layers)
    for layer, first, then in zip(layers, prefill, step):
        assert torch.equal(layer.keys[:, :, :4], first) and torch.equal(layer.keys[:, :, 4:5], then)
        assert torch.equal(layer.values[:, :, 4:5], -then) and not layer.keys[:, :, 5:].any()


@pytest.mark.parametrize("name", ["greedy", "neighbor", "gaussian"])
def test_the_graphs_buffers_carry_every_input_of_the_step(tiny, name):
    """``graphs="rerun"`` runs each decoding step on the buffers a CUDA graph would replay from
    (copied in before each step): the same rollout as the plain static path, buckets included."""
    model, tok = tiny
    plain, _ = decode(model, tok, EXPLORERS[name], static=True)
    replayed, sizes = decode(model, tok, EXPLORERS[name], static=True, graphs="rerun")
    assert_same_rollouts(replayed, plain)
    assert torch.equal(replayed.rollout_logprobs, plain.rollout_logprobs)  # the same kernels on the same values
    assert set(sizes[1:]) <= {6, 4, 2, 1} and "rollout/graph_warmup_s" in replayed.stats
    with pytest.raises(ValueError, match="replay='cpu': allowed 'cuda', 'compile', 'rerun'"):
        from ngrpo_lightning.rollout.decode_graphs import DecodeGraphs

        DecodeGraphs(model, None, "cpu")


@pytest.mark.skipif(
    not shutil.which("g++") and not shutil.which("c++"), reason="torch.compile's CPU code needs a C++ compiler"
)
def test_the_compiled_step_gives_the_rollouts_of_the_plain_static_step(tiny):
    """``graphs="compile"``: the decoding step compiled by torch.compile (on a CPU, no CUDA graphs):
    the rollout of the plain static path, buckets included, one compiled step for every bucket,
    and no compilation again on a second rollout."""
    model, tok = tiny
    prompts = chat_prompt_ids(tok, QUESTIONS)
    rollouts = {}
    for graphs in (None, "compile"):  # two rollouts from each engine
        engine = HFEngine(model, tok, max_new_tokens=12, seed=0, static_cache=True, graphs=graphs)
        rollouts[graphs] = [
            engine.generate(prompts, EndAtStep(EXPLORERS["gaussian"](), ENDS, engine.eos_ids[0]), n=2) for _ in range(2)
        ]
    for compiled, plain in zip(rollouts["compile"], rollouts[None]):
        assert_same_rollouts(compiled, plain, logprob_tolerance=1e-4)
    first, second = rollouts["compile"]
    assert first.stats["rollout/graph_warmup_s"] > 0
    assert second.stats["rollout/graph_warmup_s"] == 0  # kept: the buckets' steps are compiled already


def test_compiling_through_the_cpu_backends_packed_products_is_refused_with_the_way_out():
    from ngrpo_lightning.backends.cpu import CPUBackend
    from ngrpo_lightning.models.loading import load_policy

    model, tok = load_policy("tiny")  # a copy of its own: the backend swaps its layers
    backend = CPUBackend(torch.float32, packing="on")
    backend.prepare(model)
    engine = HFEngine(model, tok, max_new_tokens=4, seed=0, backend=backend, static_cache=True, graphs="compile")
    with pytest.raises(ValueError, match=r"packed .* products: decode with backend.disable=\[packed_products\]"):
        engine.generate(chat_prompt_ids(tok, QUESTIONS), EXPLORERS["greedy"](), n=1)


def compiled_differs(compiled, eager, tolerance: float = 1e-3) -> str | None:
    """How a compiled rollout differs from eager beyond rounding, or ``None``. Inductor's fused
    kernels round otherwise, and a draw or an entropy gate that sits within that rounding of its
    threshold goes the other way (on an H200, 2026-11-27, one row of ``orthogonal_noise``'s
    diverged: 99% of the tokens the same): every row must be eager's up to its first different
    token, log-probs within ``tolerance`` there, and nine tokens in ten the same."""
    same = compiled.response_ids == eager.response_ids
    agreed = same.long().cumprod(1).bool() & eager.response_mask.bool()  # each row's common prefix
    gap = (compiled.rollout_logprobs - eager.rollout_logprobs)[agreed].abs().max().item() if agreed.any() else 0.0
    share = same.float().mean().item()
    if gap <= tolerance and share >= 0.9:
        return None
    return f"tokens {share:.0%} the same, log-prob gap {gap:.2g} before the rows part"


def test_cuda_graph_decoding_equals_eager_decoding_on_a_gpu(tiny_on_a_gpu):  # pragma: no cover - no GPU in CI
    model, tok = tiny_on_a_gpu
    prompts = chat_prompt_ids(tok, QUESTIONS)
    differ = {}  # explorer -> how its replayed rollouts differed (all named at once: a GPU run is rare)
    for name in sorted(EXPLORERS):
        runs = [
            HFEngine(model, tok, max_new_tokens=12, seed=0, static_cache=True, graphs=graphs).generate(
                prompts, EXPLORERS[name](), n=2
            )
            for graphs in (False, "cuda", "compile")
        ]
        m = runs[1].response_mask.bool()
        with torch.no_grad():  # training rebuilds, on the GPU, the inputs the replayed steps saw
            logp, _ = response_logprobs(model, runs[1], 1.0)
        how = how_rollouts_differ(runs[1], runs[0])  # recorded graphs replay eager's kernels
        if how:
            differ[f"{name}/cuda"] = how
        how = compiled_differs(runs[2], runs[0])
        if how:
            differ[f"{name}/compile"] = how
        rebuilt = (logp - runs[1].rollout_logprobs)[m].abs().max().item()
        if rebuilt >= 1e-3:
            differ[f"{name}/rebuilt"] = f"training's log-probs {rebuilt:.2g} from the rollout's"
    assert not differ, differ


def test_graphs_false_runs_the_static_cache_eagerly_whatever_the_backend_says(tiny):
    """The CUDA backend replays from graphs by default; ``graphs=False`` keeps its static cache
    and runs each step as it is (a measurement's baseline): nothing recorded, here on the CPU."""
    from ngrpo_lightning.backends import CUDABackend

    model, tok = tiny
    engine = HFEngine(model, tok, max_new_tokens=12, seed=0, backend=CUDABackend(), graphs=False)
    assert engine.decoding.static and engine.decoding.replay is None
    fixed = engine.generate(chat_prompt_ids(tok, QUESTIONS), EXPLORERS["gaussian"](), n=2)
    grown = HFEngine(model, tok, max_new_tokens=12, seed=0).generate(
        chat_prompt_ids(tok, QUESTIONS), EXPLORERS["gaussian"](), n=2
    )
    assert_same_rollouts(fixed, grown)
    assert engine.decoding.caches.graphs == {} and "rollout/graph_warmup_s" not in fixed.stats


def test_the_engine_keeps_its_static_cache_and_graphs_across_rollouts(tiny):
    """Rollouts of other prompt widths reuse the kept cache (the same storage, restarted) and the
    graphs recorded on it; a longer rollout gets a longer cache; a weight that moves (a new tensor,
    not an in-place update) gets its graphs recorded again. The rollouts are those of the growing
    cache, one after another from the same engine."""
    model, tok = tiny
    short, long = chat_prompt_ids(tok, QUESTIONS), chat_prompt_ids(tok, [q + " Explain." * 40 for q in QUESTIONS])
    assert max(map(len, long)) > max(map(len, short)) + 64
    grown = HFEngine(model, tok, max_new_tokens=12, seed=0)
    kept = HFEngine(model, tok, max_new_tokens=12, seed=0, static_cache=True, graphs="rerun")
    storages, graphs = [], []
    for prompts, max_new in ((short, 12), (short, 8), (long, 12)):
        make = EXPLORERS["gaussian"]
        assert_same_rollouts(
            kept.generate(prompts, make(), n=2, max_new_tokens=max_new),
            grown.generate(prompts, make(), n=2, max_new_tokens=max_new),
        )
        cache = kept.decoding.caches.kept[6]
        storages.append(cache.layers[0].key_buffer.data_ptr())
        graphs.append(kept.decoding.caches.graphs[6])
        length = cache.layers[0].max_cache_len
        assert length % 64 == 0 and bucket_width(length) == length  # a GPU's attention reads it in place
    assert storages[0] == storages[1] and graphs[0] is graphs[1]  # the second rollout fit the kept cache
    assert storages[2] != storages[1] and graphs[2] is not graphs[1]  # the third needed a longer one
    assert kept.decoding.caches.kept[6].layers[0].max_cache_len >= max(map(len, long)) + 12
    head = model.get_output_embeddings()
    original = head.weight
    try:
        head.weight = torch.nn.Parameter(original.detach().clone())  # the same values at a new address
        assert_same_rollouts(
            kept.generate(short, EXPLORERS["greedy"](), n=2), grown.generate(short, EXPLORERS["greedy"](), n=2)
        )
        assert kept.decoding.caches.graphs[6] is not graphs[2]  # recorded again: the old graphs read the old address
    finally:
        head.weight = original


def test_the_engine_keeps_the_caches_of_the_two_batch_sizes_used_last(tiny):
    """Rollouts of three batch sizes in turn: the engine keeps the caches (and graphs) of the two
    used last; the third size's cache is let go, memory and all, and made again when that size
    comes back. Every rollout is the growing cache's."""
    import gc
    import weakref

    model, tok = tiny
    prompts = chat_prompt_ids(tok, QUESTIONS)
    grown = HFEngine(model, tok, max_new_tokens=6, seed=0)
    kept = HFEngine(model, tok, max_new_tokens=6, seed=0, static_cache=True, graphs="rerun")
    made = {}
    for n in (1, 2, 1, 3, 1):  # batch sizes 3, 6, 3, 9, 3
        make = EXPLORERS["gaussian"]
        assert_same_rollouts(kept.generate(prompts, make(), n=n), grown.generate(prompts, make(), n=n))
        rows = 3 * n
        made.setdefault(rows, []).append(weakref.ref(kept.decoding.caches.kept[rows]))
        caches = kept.decoding.caches
        assert set(caches.graphs) == set(caches.kept) and len(caches.kept) <= 2
    assert list(kept.decoding.caches.kept) == [9, 3]  # the last used last
    gc.collect()
    assert made[6][0]() is None  # the third size's cache was let go, its graphs with it
    assert made[3][0]() is made[3][1]() is not None and made[3][1]() is made[3][2]()  # size 3 was never the oldest
    with pytest.raises(ValueError, match="keep=0"):
        type(kept.decoding.caches)(keep=0)


@pytest.mark.parametrize("half", [False, True], ids=["float32", "bfloat16-float32-adapters"])
def test_lora_decoding_from_graphs_keeps_its_merged_weights_where_the_graphs_read_them(tiny, half):
    """A LoRA policy decodes on merged copies W + scale B A. Replayed from graphs, those keep their
    storage across rollouts (rewritten in place after an update), so the graphs recorded in the
    first rollout serve the next ones; the rollouts are those of merging anew each time. On a
    bfloat16 model with float32 adapters (a GPU's LoRA run) the training passes between rollouts
    cast the adapters anew after each optimizer step: caches the rollout's step never reads, which
    must not have the graphs recorded again."""
    from conftest import trained_lora

    from ngrpo_lightning.backends.cuda import CUDABackend

    _, tok = tiny
    policy = trained_lora()
    if half:
        policy.to(torch.bfloat16)
        for p in policy.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # peft's float32 adapters on the bfloat16 model
    backend = CUDABackend(policy.dtype, enable=["fewer_kernels_per_layer"])  # gate and up joined too
    backend.on_device(backend.prepare(policy, trains=half))  # the lean LoRA layers, plain products (as on a GPU)
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
    ids = torch.randint(0, policy.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    prompts = chat_prompt_ids(tok, QUESTIONS)
    replayed = HFEngine(policy, tok, max_new_tokens=12, seed=0, static_cache=True, graphs="rerun")
    anew = HFEngine(policy, tok, max_new_tokens=12, seed=0, static_cache=True)
    graphs = []
    for update in range(3):
        if update == 2 and not half:  # a training step changes the adapters in place
            with torch.no_grad():
                for name, param in policy.named_parameters():
                    if "lora_B" in name:
                        param.mul_(-1.5)
        elif update and half:  # a training step: its passes cast the changed adapters again
            policy.train()
            policy(input_ids=ids).logits.float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        a = replayed.generate(prompts, EXPLORERS["gaussian"](), n=2)
        b = anew.generate(prompts, EXPLORERS["gaussian"](), n=2)
        assert_same_rollouts(a, b)
        graphs.append(replayed.decoding.caches.graphs[6])
    assert graphs[0] is graphs[1] is graphs[2]  # never recorded again
    # o and down keep their own; q, k and v write theirs into their attention's one copy, gate and up
    # into their MLP's
    kept = [getattr(m, "_kept", None) for m in policy.modules()] + [
        getattr(m, "_joint_kept", None) for m in policy.modules()
    ]
    assert sum(t is not None for t in kept) == 4 * policy.config.num_hidden_layers


def test_the_tensor_addresses_graphs_rely_on_cover_weights_and_a_layers_kept_merged_copy():
    """What ``DecodeGraphs.current`` compares: every parameter and buffer, and the copies the
    backend's layers hold for a pass (LoRA's merged weights); unchanged by training's in-place
    updates and by a kept copy rewritten in place, changed when a copy is made anew."""
    from conftest import trained_lora

    from ngrpo_lightning.backends import Backend
    from ngrpo_lightning.backends.lora import LeanLoraLinear
    from ngrpo_lightning.backends.passes import packed_for_pass
    from ngrpo_lightning.rollout.decode_graphs import tensor_addresses

    policy = trained_lora()
    Backend().prepare(policy, trains=True)
    tensors = [*policy.parameters(), *policy.buffers()]
    with packed_for_pass(policy, rows=2, decoding=True, keep=True):
        first = tensor_addresses(policy)
    assert {(t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors} <= set(first)
    layer = next(m for m in policy.modules() if isinstance(m, LeanLoraLinear))
    kept = layer._kept
    assert (kept.data_ptr(), tuple(kept.shape), kept.dtype) in first  # the merged copy the step reads
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)  # an optimizer step: in place
    with packed_for_pass(policy, rows=2, decoding=True, keep=True):
        assert tensor_addresses(policy) == first and layer._kept is kept  # rewritten in place
    layer._kept = None  # a copy made anew (the old one still held: another address)
    with packed_for_pass(policy, rows=2, decoding=True, keep=True):
        assert tensor_addresses(policy) != first
