"""A training pass waits for the device only before its layers start: from its first decoder
layer through the LM head, the loss and the backward, the host never has to read the device, so
on a GPU the host keeps queueing while the device runs (and the pass could be recorded as a
graph). Counted in torch's dispatcher (``HostSyncs``), so checked on the CPU."""

import math
from dataclasses import replace

import pytest
import torch
from conftest import fake_step

from ngrpo_lightning.backends.base import Backend
from ngrpo_lightning.backends.recompute import recomputing
from ngrpo_lightning.metrics.training import host_floats
from ngrpo_lightning.objectives import GRPO, GSPO, masked_max, masked_min
from ngrpo_lightning.rollout.host_syncs import HostSyncs
from ngrpo_lightning.training.forward import response_logprobs, shared_prompts


class PassWaits(HostSyncs):
    """The waits before and after ``layer`` (a pass's first decoder layer) first runs."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.started, self.before, self.after = False, [], []
        self._hooks.append(layer.register_forward_pre_hook(self._start))

    def _start(self, *_):
        self.started = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._waits(func, args, kwargs):
            (self.after if self.started else self.before).append(str(func.overloadpacket))
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def policy():
    from ngrpo_lightning.models.loading import load_policy

    model, _ = load_policy("tiny", attn_implementation="sdpa")  # the attention the CUDA backend runs
    Backend(dtype=model.dtype).prepare(model, trains=True)
    return model


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("objective", [GRPO(kl_coef=0.01), GSPO(kl_coef=0.01)], ids=["grpo", "gspo"])
def test_a_training_pass_waits_for_the_device_only_before_its_layers_start(policy, objective, share_prompts):
    batch = fake_step([0, 0, 1, 1], [1.0, 0.0, 0.0, 1.0], lengths=[3, 2, 3, 1]).batch  # a mixed step in every row
    groups = torch.tensor([0, 0, 2, 2])  # two groups of two samples: their prompts are shared
    batch = replace(batch, prompt_ids=batch.prompt_ids[groups], prompt_mask=batch.prompt_mask[groups])
    assert (shared_prompts(batch) is not None) and len(batch.records) == 4
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0])
    with torch.no_grad():
        old, _ = response_logprobs(policy, batch, share_prompts=share_prompts)
    ref = old - 0.1 * batch.response_mask
    with PassWaits(policy.model.layers[0]) as waits, recomputing():
        logp, _ = response_logprobs(policy, batch, share_prompts=share_prompts, with_entropy=True)
        loss, metrics = objective(logp, old + 0.05 * batch.response_mask, ref, advantages, batch.response_mask)
        loss.backward()
    assert waits.before  # the pass's preparation reads the device (widths, a group's prompts, masks)
    assert waits.after == [], f"waits inside the pass: {waits.after}"
    policy.zero_grad(set_to_none=True)
    assert {"ratio_min", "ratio_max", "clip_frac_low", "clip_frac_high"} <= set(metrics)


def test_masked_min_and_max_are_those_of_the_masked_entries_and_empty_without_any():
    values = torch.tensor([[3.0, float("nan"), -2.0], [7.0, 1.0, float("inf")]])
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]])
    assert masked_min(values, mask).item() == -2.0 and masked_max(values, mask).item() == 3.0
    none = torch.zeros_like(mask)
    assert masked_min(values, none, empty=1.0).item() == 1.0 and masked_max(values, none).item() == 0.0
    with HostSyncs() as syncs:
        masked_max(values, mask)
    assert syncs.ops == []


@pytest.mark.parametrize("empty_row", [False, True])
def test_the_objectives_ratio_statistics_are_those_of_the_tokens_trained_on(empty_row):
    """GRPO's token and GSPO's sequence ratio statistics equal the boolean-indexed ones they replace
    (the masked entries only; 1 and no clipping when there are none)."""
    torch.manual_seed(0)
    logp, old = torch.randn(4, 5) * 0.1, torch.randn(4, 5) * 0.1
    mask = (torch.rand(4, 5) > 0.3).long()
    mask[2] = 0 if empty_row else mask[2]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    _, grpo = GRPO(kl_coef=0.0)(logp, old, None, adv, mask)
    ratio = torch.exp(logp - old)[mask.bool()]
    assert grpo["ratio_min"].item() == ratio.min().item() and grpo["ratio_max"].item() == ratio.max().item()
    _, gspo = GSPO(kl_coef=0.0, clip_low=0.01, clip_high=0.01)(logp, old, None, adv, mask)
    has = mask.sum(-1) > 0
    seq = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1))[has]
    a = adv[has]
    assert gspo["ratio_min"].item() == seq.min().item() and gspo["ratio_max"].item() == seq.max().item()
    assert gspo["ratio_mean"].item() == pytest.approx(seq.mean().item(), rel=1e-6)
    assert gspo["clip_frac_low"].item() == pytest.approx(((seq < 0.99) & (a < 0)).float().mean().item())
    assert gspo["clip_frac_high"].item() == pytest.approx(((seq > 1.01) & (a > 0)).float().mean().item())
    _, nothing = GSPO(kl_coef=0.0)(logp, old, None, adv, torch.zeros_like(mask))
    assert nothing["ratio_mean"].item() == nothing["ratio_min"].item() == nothing["ratio_max"].item() == 1.0
    assert nothing["clip_frac_low"].item() == nothing["clip_frac_high"].item() == 0.0


def test_host_floats_reads_the_same_floats_in_one_read_per_device():
    values = {
        "bf16": torch.tensor(1 / 3, dtype=torch.bfloat16),
        "f32": torch.tensor([math.pi]),
        "count": torch.tensor(2**40 + 1),
        "flag": torch.tensor(True),
        "number": 0.1,
        "integer": 7,
    }
    read = host_floats(values)
    assert list(read) == list(values)  # the given order
    assert read == {k: float(v) for k, v in values.items()}  # bit for bit what float(v) reads
    with HostSyncs() as syncs:
        host_floats({"a": torch.tensor(1.0), "b": torch.tensor(2.0)})
    assert "aten._local_scalar_dense" not in syncs.ops  # no .item() per value


def test_cutting_and_selecting_a_batch_reads_the_device_once_for_its_records():
    batch = fake_step([0, 0, 1, 1], [1.0, 0.0, 0.0, 1.0], lengths=[3, 2, 3, 1]).batch
    with HostSyncs() as syncs:
        part = batch.select(torch.tensor([1, 3]))
    assert syncs.ops.count("aten.nonzero") == 1 and "aten.index" not in syncs.ops
    assert torch.equal(part.records.row, torch.tensor([0, 1]))
    assert torch.equal(part.records.ids, batch.records.ids[[1, 3]])
    with HostSyncs() as syncs:
        cut = batch.select(torch.tensor([1, 3])).trim()
    assert syncs.ops.count("aten.nonzero") == 2 and "aten.index" not in syncs.ops  # select's and trim's
    assert cut.response_ids.shape[1] == 2 and len(cut.records) == len(part.records)


@pytest.mark.parametrize("token_level", [True, False])
def test_micro_batch_shares_are_read_once_and_are_the_floats_read_one_by_one(token_level):
    from ngrpo_lightning.training.planning import UpdatePlan

    batch = fake_step(list("aabbcc"), [1, 0, 1, 1, 0, 1], lengths=[1, 4, 2, 3, 4, 4]).batch
    plan = UpdatePlan(micro_batch_size=4)
    with HostSyncs() as syncs:
        groups = list(plan.micro_batches(batch, token_level))
    assert "aten._local_scalar_dense" not in syncs.ops and len(groups) == 2
    tokens = batch.response_mask.sum()
    for rows, share in groups:  # as each micro-batch read its share before: a float32 tensor's item()
        one = batch.response_mask[rows].sum() / tokens if token_level else torch.tensor(len(rows) / len(batch))
        assert share == one.item()
    empty = replace(batch, **{k: getattr(batch, k)[:0] for k in ("prompt_ids", "prompt_mask", "response_ids")})
    empty = replace(empty, response_mask=batch.response_mask[:0], rollout_logprobs=batch.rollout_logprobs[:0])
    assert len(empty) == 0 and list(plan.micro_batches(empty, token_level)) == []
