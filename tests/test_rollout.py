"""HFEngine, rollout records and their reconstruction in the training forward."""

import torch
from conftest import chat_prompt_ids

from ngrpo_lightning.explorers import Explorer, ExplorerStep, TemperatureExplorer
from ngrpo_lightning.rollout import HFEngine, InputRecords, build_inputs_embeds, mixture_embeddings
from ngrpo_lightning.rollout.records import NO_NOISE, noise_vectors
from ngrpo_lightning.training.forward import response_logprobs

QUESTIONS = ["What is 7 + 5?", "What is 3 * 4?", "What is 12 - 9?"]


class RandomMixExplorer(Explorer):
    """Test-only explorer exercising every record field: with probability ``rho`` the next
    input mixes the argmax with two random tokens (random weights) plus seeded noise."""

    def __init__(self, rho=0.5, noise=0.3):
        self.rho, self.noise = rho, noise
        self.temperature = 1.0

    def step(self, logits, generator=None):
        b, v = logits.shape
        tokens = torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
        mixed = torch.rand(b, generator=generator) < self.rho
        ids = torch.cat([tokens[:, None], torch.randint(0, v, (b, 2), generator=generator)], 1)
        weights = torch.rand(b, 3, generator=generator).softmax(-1)
        seeds = torch.randint(0, 2**31, (b,), generator=generator)
        return ExplorerStep(
            tokens=tokens,
            mixed=mixed,
            ids=ids,
            weights=weights,
            noise_seed=seeds,
            noise_scale=torch.full((b,), self.noise),
        )


def test_left_padding_masks_and_groups(tiny):
    model, tok = tiny
    prompts = chat_prompt_ids(tok, QUESTIONS)
    batch = HFEngine(model, tok, max_new_tokens=12, seed=0).generate(prompts, TemperatureExplorer(), n=2)
    assert len(batch) == 6 and batch.group_size == 2 and batch.num_groups == 3
    lengths = batch.prompt_mask.sum(-1)
    assert lengths.tolist() == [len(p) for p in prompts for _ in range(2)]
    assert (batch.prompt_mask[:, -1] == 1).all()  # left padded: every prompt ends at the last column
    assert len(batch.records) == 0  # plain sampling records nothing
    # response mask is a prefix; nothing after EOS
    m = batch.response_mask
    assert (m[:, 1:] <= m[:, :-1]).all()
    assert (batch.rollout_logprobs[m == 0] == 0).all() and (batch.rollout_logprobs[m == 1] < 0).all()


def test_rollouts_are_reproducible_with_the_same_seed(tiny):
    model, tok = tiny
    prompts = chat_prompt_ids(tok, QUESTIONS[:2])
    a = HFEngine(model, tok, max_new_tokens=8, seed=3).generate(prompts, TemperatureExplorer(), n=3)
    b = HFEngine(model, tok, max_new_tokens=8, seed=3).generate(prompts, TemperatureExplorer(), n=3)
    assert torch.equal(a.response_ids, b.response_ids)


def test_eos_stops_each_row(tiny):
    model, tok = tiny
    eos = HFEngine(model, tok).eos_ids[0]

    class EosAtRow(Explorer):  # row r emits EOS at step r
        def step(self, logits, generator=None):
            self.t = getattr(self, "t", -1) + 1
            tokens = torch.full((logits.shape[0],), 100)
            tokens[self.t] = eos if self.t < logits.shape[0] else 100
            return ExplorerStep(tokens=tokens)

    batch = HFEngine(model, tok, max_new_tokens=10).generate(chat_prompt_ids(tok, QUESTIONS), EosAtRow())
    assert batch.response_lengths.tolist() == [1, 2, 3]
    assert batch.truncated.tolist() == [False, False, False]
    assert batch.response_ids.shape[1] == 3  # stopped once every row finished


def test_reconstruction_replaces_exactly_the_recorded_positions():
    torch.manual_seed(0)
    emb = torch.randn(20, 8, requires_grad=True)
    ids = torch.randint(0, 20, (2, 5))
    rec = InputRecords(
        row=torch.tensor([1]),
        pos=torch.tensor([1]),
        ids=torch.tensor([[3, 4]]),
        weights=torch.tensor([[0.25, 0.75]]),
        noise_seed=torch.tensor([7]),
        noise_scale=torch.tensor([0.5]),
    )
    out = build_inputs_embeds(emb, ids, rec, response_offset=2)
    expected = 0.25 * emb[3] + 0.75 * emb[4] + 0.5 * noise_vectors(torch.tensor([7]), 8)[0]
    assert torch.allclose(out[1, 3], expected)
    untouched = torch.ones(2, 5, dtype=torch.bool)
    untouched[1, 3] = False
    assert torch.equal(out[untouched], emb[ids][untouched])
    out[1, 3].sum().backward()  # differentiable through E at the mixed position
    assert emb.grad[3].abs().sum() > 0 and emb.grad[4].abs().sum() > 0
    emb.grad = None
    detached = build_inputs_embeds(emb, ids, rec, response_offset=2, detach_mixture=True)
    detached[1, 3].sum().backward()  # the mixed position now sends no gradient into E
    assert emb.grad is None or emb.grad.abs().sum() == 0


def test_noise_is_regenerated_identically_from_seeds():
    a = noise_vectors(torch.tensor([1, 2, 1]), 16)
    assert torch.equal(a[0], a[2]) and not torch.equal(a[0], a[1])
    rec = InputRecords(
        row=torch.tensor([0]),
        pos=torch.tensor([0]),
        ids=torch.tensor([[1]]),
        weights=torch.tensor([[1.0]]),
        noise_seed=torch.tensor([NO_NOISE]),
        noise_scale=torch.tensor([0.0]),
    )
    emb = torch.randn(4, 16)
    assert torch.equal(mixture_embeddings(emb, rec)[0], emb[1])


def test_mixed_rollout_logprobs_are_reproduced_by_the_training_forward(tiny):
    """The records make the training forward see the rollout's inputs: log-probs agree;
    ignoring the records (negative control) changes them after mixed steps."""
    model, tok = tiny
    batch = HFEngine(model, tok, max_new_tokens=16, seed=1).generate(
        chat_prompt_ids(tok, QUESTIONS), RandomMixExplorer(), n=2
    )
    assert len(batch.records) > 5
    mask = batch.response_mask.bool()
    with torch.no_grad():
        logp, _ = response_logprobs(model, batch, 1.0)
        ignored, _ = response_logprobs(model, batch, 1.0, use_records=False)
    assert (logp - batch.rollout_logprobs)[mask].abs().max() < 1e-4
    assert (ignored - batch.rollout_logprobs)[mask].abs().max() > 1e-2


def test_select_renumbers_records(tiny):
    model, tok = tiny
    batch = HFEngine(model, tok, max_new_tokens=8, seed=2).generate(
        chat_prompt_ids(tok, QUESTIONS), RandomMixExplorer(rho=1.0), n=2
    )
    sub = batch.select([4, 5])
    assert len(sub.records) == int((batch.records.row >= 4).sum())
    assert set(sub.records.row.tolist()) <= {0, 1}
    with torch.no_grad():
        logp, _ = response_logprobs(model, sub, 1.0)
    assert (logp - sub.rollout_logprobs)[sub.response_mask.bool()].abs().max() < 1e-4
