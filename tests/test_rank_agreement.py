"""Several processes: every rank runs as many micro-batches as the rank with the most
(``UpdatePlan.agree``), since under FSDP2 each micro-batch's forward and backward are collectives.
Ranks cut their rows differently (a token budget over other lengths, replayed rows); a rank with
fewer splits its largest micro-batches, and where its rows run out runs a row again with weight 0.
The gradient is the same."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from conftest import fake_step

from ngrpo_lightning.objectives import GRPO, GSPO
from ngrpo_lightning.training.planning import UpdatePlan


@pytest.mark.parametrize("objective", [GRPO(kl_coef=0.0, loss_agg="token-mean"), GSPO()], ids=["token-mean", "gspo"])
@pytest.mark.parametrize("budget", [None, 12], ids=["rows", "token budget"])
@pytest.mark.parametrize("extra", [0, 2, 7], ids=["as many", "more", "more than its rows"])
def test_as_many_micro_batches_as_another_rank_give_the_same_gradient(objective, budget, extra):
    torch.manual_seed(0)
    step = fake_step(list("aabbcc"), [1, 0, 1, 1, 0, 1], lengths=[1, 4, 2, 3, 4, 4])
    mask = step.batch.response_mask
    logp = (-torch.rand(mask.shape) * mask).requires_grad_()
    old, adv = logp.detach() + 0.05 * torch.randn(mask.shape), torch.randn(6)
    (whole,) = torch.autograd.grad(objective(logp, old, None, adv, mask)[0], logp)
    own = len(list(UpdatePlan(micro_batch_size=2, max_tokens_per_micro_batch=budget).micro_batches(step.batch, True)))
    plan = UpdatePlan(micro_batch_size=2, max_tokens_per_micro_batch=budget)
    plan.agree = lambda n: n + extra  # another rank cut its rows into `extra` more
    groups = list(plan.micro_batches(step.batch, token_level=objective.loss_agg == "token-mean"))
    assert len(groups) == own + extra
    counted = sorted(r for rows, weight in groups if weight > 0 for r in rows.tolist())
    assert counted == list(range(6))  # every row once in a micro-batch that counts
    assert sum(weight == 0 for _, weight in groups) == max(0, own + extra - 6)  # rows ran out: passes of weight 0
    summed = torch.zeros_like(logp)
    for rows, weight in groups:
        loss, _ = objective(logp[rows], old[rows], None, adv[rows], mask[rows])
        summed += torch.autograd.grad(loss * weight, logp)[0]
    assert torch.allclose(summed, whole, atol=1e-6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(rank: int):
    """Rank 0's 6 rows, rank 1's 2 (a step's rollouts, as the forward reads them)."""
    return fake_step([str(i // 2) for i in range(6 if rank == 0 else 2)], [1.0] * (6 if rank == 0 else 2))


def _mean_logprob(forward, batch) -> torch.Tensor:
    logp, _ = forward(batch, 1.0)
    return logp.sum() / batch.response_mask.sum()


def _worker(rank: int, world: int, port: int, out: str) -> None:
    """Rank 0 cuts its 6 rows into 3 micro-batches of 2, rank 1 its 2 rows into 1. Each micro-batch
    is a forward and backward of the tiny model FSDP2 shards over both."""
    from functools import partial

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from ngrpo_lightning.models.loading import load_policy
        from ngrpo_lightning.training.parallel import ParallelConfig, most_over_ranks, rank_share, shard_fsdp2

        torch.manual_seed(0)
        policy, _ = load_policy("tiny")
        root = shard_fsdp2([policy], ParallelConfig(mixed_precision="fp32"), init_device_mesh("cpu", (world,)))
        forward = root[id(policy)]
        plan = UpdatePlan(micro_batch_size=2)
        plan.agree = partial(most_over_ranks, device=torch.device("cpu"))
        plan.rank_share = partial(rank_share, device=torch.device("cpu"))
        step, passes = _rows(rank), 0
        for rows, weight in plan.micro_batches(step.batch, token_level=True):
            (_mean_logprob(forward, step.select(rows).batch) * weight).backward()
            passes += 1
        grads = {n: p.grad.full_tensor() for n, p in policy.named_parameters() if p.grad is not None}
        torch.save({"passes": passes, "grads": grads}, f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_with_different_micro_batch_counts_train_as_their_rows_say(tmp_path):
    """Without the agreement the second rank would leave FSDP2's collectives early: gloo fails,
    NCCL hangs. With it both run 3 passes, and the gradient is that of the token mean over both
    ranks' rows (18 tokens and 6), as one process computes it, not the mean of the ranks' means."""
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    made = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [m["passes"] for m in made] == [3, 3]
    from ngrpo_lightning.models.loading import load_policy
    from ngrpo_lightning.training.forward import response_logprobs

    torch.manual_seed(0)
    plain, _ = load_policy("tiny")
    both = [_rows(rank).batch for rank in range(2)]
    total = sum(batch.response_mask.sum() for batch in both)
    for batch in both:  # the global batch's token mean
        (response_logprobs(plain, batch, 1.0)[0].sum() / total).backward()
    assert made[0]["grads"].keys() == {n for n, p in plain.named_parameters() if p.grad is not None}
    for name, p in plain.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(made[0]["grads"][name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_several_processes_share_prompts_where_every_rank_would_and_then_always_split(tiny):
    """A pass that shares a group's prompt runs the decoder twice, else once, as its rows decide:
    with several processes a pass shares only where no rank refuses, and then splits its prompts
    from its responses even where its own rows repeat none, with the values of the plain pass."""
    from conftest import ScriptedReward, tiny_rl

    from ngrpo_lightning.training.forward import response_logprobs, shared_prompts

    module, _ = tiny_rl(tiny, ScriptedReward([1]))
    for refusals, share, agreed in ((0, True, "always"), (1, True, False), (1, False, False)):
        module.plan.agree = lambda n, most=refusals: max(n, most)  # the most refusals of all ranks
        assert module._agreed_sharing(share) == agreed
    distinct = fake_step(list("abcd"), [1, 0, 1, 0], group_size=1).batch
    assert shared_prompts(distinct) is None
    first, inverse = shared_prompts(distinct, always=True)
    assert first.tolist() == inverse.tolist() == [0, 1, 2, 3]
    model, calls = module.policy, []
    hook = model.model.register_forward_pre_hook(lambda *args: calls.append(1))
    plain, _ = response_logprobs(model, distinct, 1.0, share_prompts=True)  # no prompt repeats: one pass
    assert len(calls) == 1
    split, _ = response_logprobs(model, distinct, 1.0, share_prompts="always")
    assert len(calls) == 3  # the prompts' pass and the responses'
    hook.remove()
    torch.testing.assert_close(split, plain, rtol=1e-5, atol=1e-5)
