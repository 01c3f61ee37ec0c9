"""A decoding step that never waits for the host: what HostSyncs sees, every built-in explorer's
step and the engine's bookkeeping free of such waits (their number does not grow with the tokens),
and the device-side pieces that made it so (dense records, the full neighbor table, the answer
marker on the device, counter-based noise) giving the rollouts of the host-side ones."""

import pytest
import torch
from conftest import FullTable, chat_prompt_ids
from scipy import stats
from test_hf_engine_live_rows import BUILT_IN, QUESTIONS

from ngrpo_lightning.explorers import ExplorerStep, NeighborMixingExplorer
from ngrpo_lightning.rollout import HFEngine
from ngrpo_lightning.rollout.answer_marker import AnswerMarker
from ngrpo_lightning.rollout.host_syncs import HostSyncs
from ngrpo_lightning.rollout.records import noise_vectors

SYNC_FREE = {**BUILT_IN, "neighbor": lambda: FullTable(k=3, rho=0.5)}


def test_host_syncs_sees_what_the_host_reads_and_nothing_else():
    x = torch.randn(4, 5)
    mask = x[:, 0] > 0
    with HostSyncs() as syncs:
        torch.where(mask[:, None], x, 0.0).softmax(-1).argmax(-1)
        x.repeat_interleave(2, 0)
        x[torch.tensor([0, 2])] = 1.0
    assert syncs.ops == []
    with HostSyncs() as syncs:
        bool(mask.any())
        mask.nonzero()
        x[mask]
        x.unique()
        x[0, 0].item()
    assert syncs.ops[0] in ("aten.is_nonzero", "aten._local_scalar_dense")  # bool(t): either, by torch version
    assert syncs.ops[1:] == ["aten.nonzero", "aten.index", "aten._unique2", "aten._local_scalar_dense"]


def _syncs(engine, explorer, prompts, ignore):
    with HostSyncs(ignore=ignore) as syncs:
        engine.generate(prompts, explorer, n=2)
    return syncs.ops


@pytest.mark.parametrize(
    ("name", "static"), [(name, False) for name in sorted(SYNC_FREE)] + [("neighbor", True), ("gaussian", True)]
)
def test_the_decoding_loop_does_not_wait_for_the_host_per_token(tiny, name, static):
    """With the host's looks at ended rows far apart, the waits outside the model are those of the
    rollout's start and end: as many for 12 tokens as for 6."""
    model, tok = tiny
    prompts = chat_prompt_ids(tok, QUESTIONS)
    counts = []
    for tokens in (6, 12):
        explorer = SYNC_FREE[name]()
        engine = HFEngine(model, tok, max_new_tokens=tokens, seed=0, checks_every=10**6, static_cache=static)
        engine.generate(prompts[:1], explorer, n=2)  # the explorer's index is built at its first rollout
        counts.append(len(_syncs(engine, explorer, prompts, ignore=[model])))
    assert counts[0] == counts[1] <= 4, counts


def test_the_model_step_does_not_wait_either_on_either_cache(tiny):
    """Inside the model too, the waits are the rollout's start's: the engine hands the growing
    cache's decoding steps their mask ready-made (transformers' own looks at it every step), and
    the static cache's mask has a fixed width."""
    model, tok = tiny
    prompts = chat_prompt_ids(tok, QUESTIONS)
    counts = {}
    for static in (False, True):
        for tokens in (6, 12):
            engine = HFEngine(model, tok, max_new_tokens=tokens, seed=0, checks_every=10**6, static_cache=static)
            counts[static, tokens] = len(_syncs(engine, SYNC_FREE["temperature"](), prompts, ignore=[]))
    assert counts[False, 6] == counts[False, 12], counts
    assert counts[True, 6] == counts[True, 12], counts


def test_a_lazily_filled_neighbor_index_waits_per_token(tiny):
    """The negative control: the CPU's lazy table looks at which anchors are new at every step."""
    model, tok = tiny
    prompts = chat_prompt_ids(tok, QUESTIONS)
    counts = []
    for tokens in (6, 12):
        engine = HFEngine(model, tok, max_new_tokens=tokens, seed=0, checks_every=10**6)
        counts.append(len(_syncs(engine, NeighborMixingExplorer(k=3, rho=0.5), prompts, ignore=[model])))
    assert counts[1] > counts[0]


@pytest.mark.parametrize(
    "options",
    [
        {"rho": 0.5},
        {"rho": 1.0},
        {"rho": 0.5, "emit": "sampled", "top_p": 0.9},
        {"gate": "entropy", "entropy_threshold": 0.5, "top_k": 20},
    ],
)
def test_the_full_neighbor_table_gives_the_rollouts_of_the_lazy_one(tiny, options):
    model, tok = tiny
    prompts = chat_prompt_ids(tok, QUESTIONS)
    batches = []
    for explorer in (NeighborMixingExplorer(k=3, **options), FullTable(k=3, **options)):
        batches.append(HFEngine(model, tok, max_new_tokens=16, seed=3).generate(prompts, explorer, n=2))
    assert explorer.index.complete
    lazy, full = batches
    assert len(lazy.records) > 0
    assert torch.equal(lazy.response_ids, full.response_ids)
    assert torch.equal(lazy.rollout_logprobs, full.rollout_logprobs)
    for field in ("row", "pos", "ids", "weights"):
        assert torch.equal(getattr(lazy.records, field), getattr(full.records, field)), field


def test_the_answer_marker_on_the_device_agrees_with_the_host_one():
    generator = torch.Generator().manual_seed(0)
    host, device = AnswerMarker([3, 4]), AnswerMarker([3, 4]).rows(6, "cpu")
    for _ in range(40):
        tokens = torch.randint(2, 6, (6,), generator=generator)
        emitted = torch.rand(6, generator=generator) < 0.8
        steps = [
            ExplorerStep(
                tokens=tokens, mixed=torch.ones(6, dtype=torch.bool), ids=tokens[:, None], weights=torch.ones(6, 1)
            )
            for _ in range(2)
        ]
        host.unmix(steps[0], range(6), emitted)
        device.unmix(steps[1], emitted)
        assert torch.equal(steps[0].mixed, steps[1].mixed)
    assert 0 < int(device.answered.sum()) < 6  # the stream exercised both outcomes


def test_noise_from_seeds_is_standard_normal_and_independent():
    z = noise_vectors(torch.arange(1000), 301)  # an odd width: the last pair is cut
    assert z.shape == (1000, 301) and z.dtype == torch.float32
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1.0) < 0.01
    assert stats.kstest(z.flatten().numpy(), "norm").pvalue > 1e-3
    assert stats.kstest(z[:, 300].numpy(), "norm").pvalue > 1e-3  # each component over seeds too
    between_seeds = torch.corrcoef(z[:200]) - torch.eye(200)
    between_components = torch.corrcoef(z.T) - torch.eye(301)
    assert float(between_seeds.abs().max()) < 0.3 and float(between_components.abs().max()) < 0.2
    big = torch.tensor([2**62 - 1, 2**32, 0])
    assert torch.equal(noise_vectors(big, 8)[0], noise_vectors(big.flip(0), 8)[2])  # a row depends on its seed alone
    assert not torch.equal(noise_vectors(big, 8)[1], noise_vectors(big, 8)[2])  # the seed's high bits count


def test_noise_made_with_the_kept_component_hashes_is_the_noise_made_without_them():
    import math

    from ngrpo_lightning.rollout import records

    seeds = torch.tensor([7, 2**40 + 3, 0])

    def uncached(dim: int) -> torch.Tensor:  # noise_vectors as it was, every hash made anew
        lo, hi = seeds & records.MASK32, (seeds >> 32) & records.MASK32
        key = records._hash32(lo ^ records._hash32(hi ^ 0x9E3779B9))[:, None]
        pairs = (dim + 1) // 2
        bits = records._hash32(key ^ records._hash32(torch.arange(2 * pairs))[None])
        radius = torch.sqrt(-2.0 * torch.log((bits[:, 0::2].double() + 1.0) / 2.0**32))
        angle = (2.0 * math.pi / 2.0**32) * bits[:, 1::2].double()
        return torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], -1).flatten(1)[:, :dim].float()

    hashes = records.ComponentHashes()  # a decoding loop's (DecodeState's)
    with torch.inference_mode():  # kept from a rollout's inference mode, read by training after it
        assert torch.equal(noise_vectors(seeds, 9, hashes), uncached(9))
    for dim in (9, 10, 64):  # a kept width again, a width of the same pairs, a new one
        assert torch.equal(noise_vectors(seeds, dim, hashes), uncached(dim))
        assert torch.equal(noise_vectors(seeds, dim), uncached(dim))  # none kept: made at the call
    assert sorted(count for count, _ in hashes.kept) == [10, 64]
    assert not any(t.is_inference() for t in hashes.kept.values())


def test_an_explorer_that_may_wait_is_named_once_where_waits_cost(tiny, caplog):
    from test_hf_engine_live_rows import EndAtStep

    model, tok = tiny
    prompts = chat_prompt_ids(tok, QUESTIONS[:1])
    waits = EndAtStep(BUILT_IN["temperature"](), ends=[3, 5], eos=tok.eos_token_id)  # declares nothing
    with caplog.at_level("INFO", logger="ngrpo_lightning.rollout.hf_engine"):
        HFEngine(model, tok, max_new_tokens=4, checks_every=1).generate(prompts, waits, n=2)
        assert "sync_free" not in caplog.text  # looking every step: a wait costs nothing more
        engine = HFEngine(model, tok, max_new_tokens=4, checks_every=8)
        for _ in range(2):
            engine.generate(prompts, waits, n=2)
        engine.generate(prompts, SYNC_FREE["gaussian"](), n=2)
    lines = [r.getMessage() for r in caplog.records if "sync_free" in r.getMessage()]
    assert len(lines) == 1 and "EndAtStep" in lines[0]


def test_the_documented_explorer_is_sync_free():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "docs" / "examples"))
    try:
        from top_two_blend import TopTwoBlend
    finally:
        sys.path.pop(0)
    explorer = TopTwoBlend(rho=0.5)
    with HostSyncs() as syncs:
        explorer.step(torch.randn(8, 100), torch.Generator().manual_seed(0))
    assert explorer.sync_free and syncs.ops == []


def test_cuda_graph_decoding_does_not_wait_for_the_host_on_a_gpu(tiny_on_a_gpu):  # pragma: no cover - no GPU in CI
    """On the GPU itself, the model's replayed step included: as many waits for 12 tokens as for 6."""
    model, tok = tiny_on_a_gpu
    prompts = chat_prompt_ids(tok, QUESTIONS)
    for name in ("neighbor", "gaussian", "topk"):
        counts = []
        for tokens in (6, 12):
            explorer = SYNC_FREE[name]()
            engine = HFEngine(model, tok, max_new_tokens=tokens, checks_every=10**6, static_cache=True, graphs="cuda")
            engine.generate(prompts[:1], explorer, n=2)
            counts.append(len(_syncs(engine, explorer, prompts, ignore=[])))
        assert counts[0] == counts[1], (name, counts)
