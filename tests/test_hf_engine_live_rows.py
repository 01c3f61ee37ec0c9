"""HFEngine drops ended rows from the decoding batch: outputs stay in their original rows,
explorers still see every row, and rollouts are those of a batch that never shrinks."""

import pytest
import torch
from conftest import chat_prompt_ids

from ngrpo_lightning.explorers import (
    Explorer,
    GaussianEmbedNoiseExplorer,
    GaussianNoiseExplorer,
    GumbelSoftExplorer,
    NeighborMixingExplorer,
    OrthogonalNoiseExplorer,
    TemperatureExplorer,
    TopKGumbelMixExplorer,
    TopKMixExplorer,
)
from ngrpo_lightning.rollout import HFEngine
from ngrpo_lightning.training.forward import response_logprobs

QUESTIONS = ["What is 7 + 5?", "What is 3 * 4?", "What is 12 - 9?"]
BUILT_IN = {  # every built-in explorer, as its config files set it up (mixing often, to exercise the records)
    "temperature": lambda: TemperatureExplorer(temperature=1.0, top_p=0.9),
    "greedy": lambda: TemperatureExplorer(temperature=0.0),
    "neighbor": lambda: NeighborMixingExplorer(k=3, rho=0.5),
    "gaussian": lambda: GaussianNoiseExplorer(sigma=0.5),
    "gumbel": lambda: GumbelSoftExplorer(top_k=4, tau=0.5),
    "topk": lambda: TopKMixExplorer(k=3, rho=0.5),
    "topk_gumbel": lambda: TopKGumbelMixExplorer(k=3, rho=0.5),
    "gaussian_embed_noise": lambda: GaussianEmbedNoiseExplorer(k=3, rho=0.5),
    "orthogonal_noise": lambda: OrthogonalNoiseExplorer(k=3, rho=0.5),
}


class EndAtStep(Explorer):
    """Wraps an explorer and makes row ``r`` emit EOS at step ``ends[r]`` (per-row state keyed on
    the row index); records the batch width it is shown at every step."""

    def __init__(self, inner: Explorer, ends: list[int], eos: int):
        self.inner, self.ends, self.eos = inner, torch.tensor(ends), eos
        self.temperature = inner.temperature
        self.widths = []

    def prepare(self, embeddings):
        self.inner.set_special_ids(self._special_ids)
        self.inner.prepare(embeddings)
        self.t = 0

    def step(self, logits, generator=None):
        self.widths.append(logits.shape[0])
        step = self.inner.step(logits, generator)
        step.tokens = torch.where(self.ends == self.t, self.eos, step.tokens)
        self.t += 1
        return step


def count_batch_rows(model):
    """A forward pre-hook on the model recording the batch size of every forward."""
    sizes = []
    handle = model.register_forward_pre_hook(
        lambda m, args, kwargs: sizes.append(kwargs["inputs_embeds"].shape[0]), with_kwargs=True
    )
    return sizes, handle


def rollout(model, tok, explorer_factory, ends, drop, seed=0, n=2, max_new_tokens=12, drop_min_frac=0.0):
    engine = HFEngine(
        model, tok, max_new_tokens=max_new_tokens, seed=seed, drop_finished_rows=drop, drop_min_frac=drop_min_frac
    )
    explorer = EndAtStep(explorer_factory(), ends, engine.eos_ids[0])
    sizes, handle = count_batch_rows(model)
    try:
        batch = engine.generate(chat_prompt_ids(tok, QUESTIONS), explorer, n=n)
    finally:
        handle.remove()
    return batch, explorer.widths, sizes


def assert_same_rollouts(a, b, logprob_tolerance: float = 1e-5):
    """The same tokens and records; log-probs (and mixture weights) up to float rounding, by
    default that of another batch composition."""
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.truncated, b.truncated)
    assert (a.rollout_logprobs - b.rollout_logprobs).abs().max() <= logprob_tolerance
    for field in ("row", "pos", "ids", "noise_seed"):
        assert torch.equal(getattr(a.records, field), getattr(b.records, field)), field
    assert torch.allclose(a.records.weights, b.records.weights, atol=logprob_tolerance)


def how_rollouts_differ(a, b, logprob_tolerance: float = 1e-5) -> str | None:
    """``None`` where :func:`assert_same_rollouts` holds, else how far apart they are (a GPU test
    names every explorer that differs at once: a GPU run is rare)."""
    try:
        assert_same_rollouts(a, b, logprob_tolerance)
    except AssertionError:
        same = (a.response_ids == b.response_ids).float().mean().item()
        gap = (a.rollout_logprobs - b.rollout_logprobs).abs().max().item()
        return f"tokens {same:.0%} the same, log-prob gap {gap:.2g}"
    return None


ENDS = [0, 5, 2, 20, 8, 3]  # row r ends at step ENDS[r]; row 3 runs to the limit


def test_ended_rows_leave_the_batch_and_keep_their_outputs(tiny):
    model, tok = tiny
    dropped, widths, sizes = rollout(model, tok, lambda: TemperatureExplorer(temperature=1.0), ENDS, drop=True)
    kept, kept_widths, kept_sizes = rollout(model, tok, lambda: TemperatureExplorer(temperature=1.0), ENDS, drop=False)
    assert dropped.response_lengths.tolist() == [1, 6, 3, 12, 9, 4]
    assert dropped.truncated.tolist() == [False, False, False, True, False, False]
    assert_same_rollouts(dropped, kept)  # same tokens: the sampling generator is consumed identically
    # the prefill ran once per prompt (3 prompts x n=2), then the model ran on the live rows
    # only; the explorer always saw all 6 rows
    assert sizes == [3, 5, 5, 4, 3, 3, 2, 2, 2, 1, 1, 1] and kept_sizes == [3] + [6] * 11
    assert widths == kept_widths == [6] * 12
    m = dropped.response_mask.bool()
    assert (dropped.response_ids[~m] == tok.pad_token_id).all() and (dropped.rollout_logprobs[~m] == 0).all()
    with torch.no_grad():
        logp, _ = response_logprobs(model, dropped, 1.0)
    assert (logp - dropped.rollout_logprobs)[m].abs().max() < 1e-4


def test_ended_rows_can_leave_together_once_they_are_a_share_of_the_batch(tiny):
    model, tok = tiny
    sampler = lambda: TemperatureExplorer(temperature=1.0)  # noqa: E731
    deferred, widths, sizes = rollout(model, tok, sampler, ENDS, drop=True, drop_min_frac=0.5)
    assert_same_rollouts(deferred, rollout(model, tok, sampler, ENDS, drop=True)[0])
    # rows 0, 2, 5 end at steps 0, 2, 3: half of 6, they leave after step 3; rows 1 and 4 (steps
    # 5 and 8) are half of the remaining 3 only together, after step 8
    assert sizes == [3, 6, 6, 6, 3, 3, 3, 3, 3, 1, 1, 1] and widths == [6] * 12
    with pytest.raises(ValueError, match=r"rollout\.hf\.drop_min_frac=1\.5 is out of range"):
        HFEngine(model, tok, drop_min_frac=1.5)


def test_mixed_steps_keep_their_rows_and_positions(tiny):
    model, tok = tiny
    make = lambda: NeighborMixingExplorer(k=3, rho=0.5)  # noqa: E731
    dropped, _, sizes = rollout(model, tok, make, ENDS, drop=True)
    kept, _, _ = rollout(model, tok, make, ENDS, drop=False)
    assert min(sizes) < 6 and len(dropped.records) > 10
    assert set(dropped.records.row.tolist()) == set(range(6))
    lengths = dropped.response_lengths
    assert (dropped.records.pos < lengths[dropped.records.row]).all()  # no record after a row ended
    assert_same_rollouts(dropped, kept)
    with torch.no_grad():  # the training forward rebuilds the inputs the shrinking batch saw
        logp, _ = response_logprobs(model, dropped, 1.0)
    assert (logp - dropped.rollout_logprobs)[dropped.response_mask.bool()].abs().max() < 1e-4


def test_sampled_rollouts_are_reproducible_from_the_seed(tiny):
    model, tok = tiny
    make = lambda: TemperatureExplorer(temperature=1.0)  # noqa: E731
    a, _, _ = rollout(model, tok, make, ENDS, drop=True, seed=5)
    b, _, _ = rollout(model, tok, make, ENDS, drop=True, seed=5)
    c, _, _ = rollout(model, tok, make, ENDS, drop=True, seed=6)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)


@pytest.mark.slow
def test_greedy_with_eos_equals_generate_on_the_packaged_model(smollm2):
    """Responses of very different lengths, EOS on: the same tokens and lengths as ``generate``."""
    model, tok = smollm2
    questions = [
        "Answer with one word: what colour is the sky on a clear day?",
        "Explain in detail how a bicycle works, part by part.",
        "Reply with just the number: what is 2 + 2?",
        "Write a short story about a lighthouse keeper.",
    ]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in questions
    ]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    sizes, handle = count_batch_rows(model)
    try:
        batch = HFEngine(model, tok, max_new_tokens=48).generate(prompts, TemperatureExplorer(temperature=0.0))
    finally:
        handle.remove()
    lengths = batch.response_lengths.tolist()
    assert min(lengths) < 10 and max(lengths) == 48 and min(sizes) < len(prompts)  # rows did leave the batch
    tok.padding_side = "left"
    enc = tok.pad({"input_ids": prompts}, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=48, do_sample=False)[:, enc["input_ids"].shape[1] :]
    eos = set(HFEngine(model, tok).eos_ids)
    for i, n in enumerate(lengths):
        row = out[i].tolist()
        expected = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        assert n == expected and batch.response_ids[i, :n].tolist() == row[:n], i
    with torch.no_grad():
        logp, _ = response_logprobs(model, batch, 1.0)
    assert (logp - batch.rollout_logprobs)[batch.response_mask.bool()].abs().max() < 1e-4


@pytest.mark.parametrize("drop", [True, False])
def test_the_host_looking_every_few_steps_gives_the_same_rollouts_for_every_built_in_explorer(tiny, drop):
    """``checks_every`` (the CUDA backend's ``decode_checks_every``): ended rows are marked on the
    device and the host looks every few steps; rows leave and the loop ends later, the rollout
    (tokens, log-probs, lengths, records) is the same, for every built-in explorer."""
    model, tok = tiny
    explorers = BUILT_IN
    ends = [0, 5, 2, 9, 8, 3]  # every row ends: the loop's last step is row 3's
    for name, make in explorers.items():
        each, _, each_sizes = rollout(model, tok, make, ends, drop=drop)
        engine = HFEngine(model, tok, max_new_tokens=12, seed=0, drop_finished_rows=drop, checks_every=4)
        explorer = EndAtStep(make(), ends, engine.eos_ids[0])
        sizes, handle = count_batch_rows(model)
        try:
            every4 = engine.generate(chat_prompt_ids(tok, QUESTIONS), explorer, n=2)
        finally:
            handle.remove()
        assert_same_rollouts(every4, each)
        assert torch.equal(every4.rollout_logprobs, each.rollout_logprobs) or drop, name
        assert every4.response_ids.shape[1] == 10 and not every4.truncated.any(), name  # trimmed to the last end
        assert len(sizes) == 12 and len(each_sizes) == 10, name  # looked at step 4, 8, 12: ran 2 steps past the end
        if drop:
            assert sum(sizes) > sum(each_sizes), name  # ended rows left later
    from ngrpo_lightning.backends import CPUBackend, CUDABackend

    assert CPUBackend().decode_checks_every == 1 and CUDABackend().decode_checks_every == 8  # the backend's choice
    # the CUDA backend's static cache, its graphs' buffers rerun on the CPU (recording needs a GPU)
    engine = HFEngine(
        model, tok, max_new_tokens=12, seed=0, drop_finished_rows=drop, backend=CUDABackend(), graphs="rerun"
    )
    make = explorers["neighbor"]
    assert_same_rollouts(
        engine.generate(chat_prompt_ids(tok, QUESTIONS), EndAtStep(make(), ends, engine.eos_ids[0]), n=2),
        rollout(model, tok, make, ends, drop=drop)[0],
    )
    with pytest.raises(ValueError, match="checks_every=0 is out of range"):
        HFEngine(model, tok, checks_every=0)
