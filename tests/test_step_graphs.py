"""Whole decoding steps (the model, the explorer and the bookkeeping) on the buffers a CUDA graph
replays from (rollout/step_graphs.py): on the CPU, ``graphs="rerun"`` runs each step on them and
checks that no step replaces a tensor the next one reads; the rollouts are those of the plain
static path, rows leaving in buckets included, for every built-in explorer."""

import pytest
import torch
from conftest import FullTable, chat_prompt_ids
from test_hf_engine_live_rows import BUILT_IN, QUESTIONS, assert_same_rollouts, count_batch_rows, how_rollouts_differ

from ngrpo_lightning.explorers import (
    Explorer,
    NeighborMixingExplorer,
    TemperatureExplorer,
    declares_capturable,
)
from ngrpo_lightning.rollout import HFEngine
from ngrpo_lightning.rollout.decode_graphs import DecodeGraphs
from ngrpo_lightning.rollout.step_graphs import StepGraphs, fingerprint
from ngrpo_lightning.training.forward import response_logprobs

ENDS = [0, 5, 2, 9, 8, 3]  # row r emits EOS at step ENDS[r]
# every built-in explorer; neighbor mixing with its full table, which it always has on a GPU
CAPTURABLE = {**BUILT_IN, "neighbor": lambda: FullTable(k=3, rho=0.5)}


class EndsOnTheDevice(Explorer):
    """Wraps an explorer and makes row ``r`` emit EOS at step ``ends[r]``, counting its steps in a
    tensor it updates in place: state a recorded step keeps."""

    sync_free = capturable = True

    def __init__(self, inner: Explorer, ends: list[int], eos: int, rebind: bool = False):
        self.inner, self.ends, self.eos, self.rebind = inner, torch.tensor(ends), eos, rebind
        self.temperature, self.answer_start = inner.temperature, inner.answer_start
        self.count = torch.zeros((), dtype=torch.long)

    def prepare(self, embeddings):
        self.inner.set_special_ids(self._special_ids)
        self.inner.prepare(embeddings)
        self.count.zero_()

    def step(self, logits, generator=None):
        step = self.inner.step(logits, generator)
        step.tokens = torch.where(self.ends == self.count, self.eos, step.tokens)
        if self.rebind:  # a new tensor each step: what a recorded step cannot follow
            self.count = self.count + 1
        else:
            self.count += 1
        return step


def rollouts(model, tok, make, graphs, times: int = 1, **kwargs):
    engine = HFEngine(model, tok, max_new_tokens=12, seed=0, static_cache=True, graphs=graphs)
    sizes, handle = count_batch_rows(model)
    try:
        prompts = chat_prompt_ids(tok, QUESTIONS)
        explorer = EndsOnTheDevice(make(), ENDS, engine.eos_ids[0], **kwargs)  # one for every rollout
        made = [engine.generate(prompts, explorer, n=2) for _ in range(times)]
    finally:
        handle.remove()
    return made, sizes, engine, explorer


@pytest.mark.parametrize("name", sorted(CAPTURABLE))
def test_whole_steps_on_the_graphs_buffers_give_the_rollouts_of_the_plain_static_path(tiny, name):
    model, tok = tiny
    (plain,), _, _, _ = rollouts(model, tok, CAPTURABLE[name], graphs=None)
    (replayed,), sizes, engine, _ = rollouts(model, tok, CAPTURABLE[name], graphs="rerun")
    assert isinstance(engine.decoding.caches.graphs[6], StepGraphs)  # the whole step, not the model's only
    with pytest.raises(TypeError, match="step"):  # never the model's step alone
        engine.decoding.caches.graphs[6](None, None, None, None)
    assert replayed.stats["rollout/graphs_whole_step"] == 1.0 and "rollout/graphs_whole_step" not in plain.stats
    assert_same_rollouts(replayed, plain)
    assert torch.equal(replayed.rollout_logprobs, plain.rollout_logprobs)  # the same kernels on the same values
    assert replayed.response_lengths.tolist() == [1, 6, 3, 10, 9, 4]
    assert set(sizes[1:]) <= {6, 4, 2, 1} and min(sizes[1:]) < 6  # rows left, in buckets
    m = replayed.response_mask.bool()
    with torch.no_grad():  # training rebuilds the inputs the steps saw from the records they kept
        logp, _ = response_logprobs(model, replayed, 1.0)
    assert (logp - replayed.rollout_logprobs)[m].abs().max() < 1e-4


@pytest.mark.parametrize("name", sorted(CAPTURABLE))
def test_a_whole_step_never_waits_for_the_device(tiny, name):
    """What a CUDA graph records must not read the device from the host: the waits of a rollout
    of whole steps, the model's included, are its start's and end's, as many at 12 tokens as at 6."""
    from ngrpo_lightning.rollout.host_syncs import HostSyncs

    model, tok = tiny
    prompts = chat_prompt_ids(tok, QUESTIONS)
    counts = []
    for tokens in (6, 12):
        engine = HFEngine(
            model, tok, max_new_tokens=tokens, seed=0, checks_every=10**6, static_cache=True, graphs="rerun"
        )
        explorer = CAPTURABLE[name]()
        engine.generate(prompts[:1], explorer, n=2)  # the explorer's index is built at its first rollout
        with HostSyncs() as syncs:
            engine.generate(prompts, explorer, n=2)
        assert isinstance(engine.decoding.caches.graphs[6], StepGraphs)
        counts.append(len(syncs.ops))
    assert counts[0] == counts[1], counts


def test_the_user_written_explorer_of_the_docs_runs_as_a_whole_step(tiny, monkeypatch):
    from test_explorer_rollouts import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "docs" / "examples"))
    from top_two_blend import TopTwoBlend

    model, tok = tiny
    (plain,), _, _, _ = rollouts(model, tok, lambda: TopTwoBlend(rho=0.5), graphs=None)
    (replayed,), _, engine, _ = rollouts(model, tok, lambda: TopTwoBlend(rho=0.5), graphs="rerun")
    assert isinstance(engine.decoding.caches.graphs[6], StepGraphs) and len(replayed.records) > 5
    assert_same_rollouts(replayed, plain)


def test_kept_step_graphs_serve_the_next_rollout_and_an_explorer_with_other_settings_records_again(tiny):
    model, tok = tiny
    make = CAPTURABLE["topk_gumbel"]
    plain, _, _, _ = rollouts(model, tok, make, graphs=None, times=2)
    replayed, _, engine, explorer = rollouts(model, tok, make, graphs="rerun", times=1)
    first = engine.decoding.caches.graphs[6]
    prompts = chat_prompt_ids(tok, QUESTIONS)
    replayed.append(engine.generate(prompts, explorer, n=2))
    assert engine.decoding.caches.graphs[6] is first  # the same explorer, settings and tensors: kept
    for a, b in zip(replayed, plain):  # the second rollout on the kept state and buffers, refilled
        assert_same_rollouts(a, b)
    explorer.inner.rho = 0.25
    engine.generate(prompts, explorer, n=2)
    assert engine.decoding.caches.graphs[6] is not first  # rho was read when the step was recorded


def test_an_explorer_that_replaces_its_state_is_refused_by_the_check_and_runs_between_model_steps_undeclared(tiny):
    model, tok = tiny
    with pytest.raises(RuntimeError, match="EndsOnTheDevice declares capturable, but its step replaced a tensor"):
        rollouts(model, tok, CAPTURABLE["temperature"], graphs="rerun", rebind=True)

    class Undeclared(EndsOnTheDevice):  # a step of its own, no declaration: the model's step only
        def step(self, logits, generator=None):
            return super().step(logits, generator)

    engine = HFEngine(model, tok, max_new_tokens=4, seed=0, static_cache=True, graphs="rerun")
    explorer = Undeclared(TemperatureExplorer(), ENDS, engine.eos_ids[0], rebind=True)
    batch = engine.generate(chat_prompt_ids(tok, QUESTIONS), explorer, n=2)
    assert type(engine.decoding.caches.graphs[6]) is DecodeGraphs and batch.stats["rollout/graphs_whole_step"] == 0.0


def test_without_whole_step_graphs_the_models_step_is_recorded_alone_whatever_the_explorer_declares(tiny):
    from ngrpo_lightning.backends.cuda import CUDABackend

    model, tok = tiny
    prompts = chat_prompt_ids(tok, QUESTIONS)
    batches = {}
    whole, model_step = CUDABackend(enable=["whole_step_graphs"]), CUDABackend(disable=["whole_step_graphs"])
    for name, backend in (("whole", whole), ("model_step", model_step)):  # chosen, not run on a GPU: "rerun"
        engine = HFEngine(model, tok, max_new_tokens=6, seed=0, backend=backend, graphs="rerun")
        batches[name] = engine.generate(prompts, CAPTURABLE["gaussian"](), n=2)
        held = type(engine.decoding.caches.graphs[6])
        assert held is (StepGraphs if name == "whole" else DecodeGraphs), held
    assert_same_rollouts(batches["whole"], batches["model_step"])


def test_what_declares_a_step_capturable():
    class OwnStep(TemperatureExplorer):  # replaces the step it inherits a declaration for
        def step(self, logits, generator=None):
            return super().step(logits, generator)

    class SameStep(TemperatureExplorer):  # changes settings only: the declaration holds
        def __init__(self):
            super().__init__(temperature=0.7)

    assert declares_capturable(TemperatureExplorer()) and declares_capturable(SameStep())
    assert not declares_capturable(OwnStep())
    lazy = NeighborMixingExplorer(k=3)  # on a CPU its table fills lazily: its steps look at the host
    lazy.prepare(torch.randn(50, 8))
    full = NeighborMixingExplorer(k=3, precompute=True)
    full.prepare(torch.randn(50, 8))
    assert not declares_capturable(lazy) and declares_capturable(full)


def test_an_explorers_fingerprint_holds_its_settings_and_where_its_tensors_lie():
    a, b = NeighborMixingExplorer(k=3, precompute=True), NeighborMixingExplorer(k=3, precompute=True)
    e = torch.randn(50, 8)
    a.prepare(e)
    b.prepare(e)
    assert fingerprint(a) != fingerprint(b)  # each built its own table
    before = fingerprint(a)
    a.prepare(e)
    assert fingerprint(a) == before  # the index kept
    a.rho = 0.3
    assert fingerprint(a) != before


def test_recorded_whole_steps_give_the_eager_rollouts_on_a_gpu(tiny_on_a_gpu):  # pragma: no cover - no GPU in CI
    """Recorded whole steps replay eager's kernels and draw the generator's next numbers: the same
    rollouts as the static cache run eagerly, rows leaving in buckets, for every built-in explorer;
    a second rollout replays the kept graphs without recording again."""
    model, tok = tiny_on_a_gpu
    prompts = chat_prompt_ids(tok, QUESTIONS)
    differ = {}  # explorer -> how its replayed rollouts differed (all named at once: a GPU run is rare)
    for name in sorted(CAPTURABLE):
        runs = {}
        for graphs in (False, "cuda"):
            engine = HFEngine(model, tok, max_new_tokens=12, seed=0, static_cache=True, graphs=graphs)
            explorer = EndsOnTheDevice(CAPTURABLE[name](), ENDS, engine.eos_ids[0])
            explorer.ends, explorer.count = explorer.ends.cuda(), explorer.count.cuda()
            runs[graphs] = [engine.generate(prompts, explorer, n=2) for _ in range(2)]
        assert isinstance(engine.decoding.caches.graphs[6], StepGraphs)
        warmups = [run.stats["rollout/graph_warmup_s"] for run in runs["cuda"]]
        assert warmups[0] > 0 == warmups[1], warmups  # the second rollout replays the kept graphs
        for i, (replayed, eager) in enumerate(zip(runs["cuda"], runs[False])):
            how = how_rollouts_differ(replayed, eager)
            if how:
                differ[f"{name}/{i}"] = how
    assert not differ, differ
