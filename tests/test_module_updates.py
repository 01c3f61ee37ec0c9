"""RLModule updates: micro-batching does not change the gradient."""

import math

import pytest
import torch
from conftest import fake_step

from ngrpo_lightning.objectives import GRPO, GSPO
from ngrpo_lightning.training.planning import UpdatePlan


@pytest.mark.parametrize(
    "objective",
    [
        GRPO(kl_coef=0.0, loss_agg="token-mean"),
        GRPO(kl_coef=0.0, loss_agg="seq-mean-token-mean"),
        GRPO(kl_coef=0.0, loss_agg="seq-mean-token-sum-norm", norm_length=7),
        GSPO(clip_low=0.2, clip_high=0.2),
    ],
    ids=lambda o: f"{o.registered_name}-{o.loss_agg}",
)
def test_micro_batches_give_the_whole_batch_gradient(objective):
    torch.manual_seed(0)
    step = fake_step(
        list("aabbcc"), [1, 0, 1, 1, 0, 1], lengths=[1, 4, 2, 3, 4, 4]
    )  # 10 tokens in rows 0-3, 8 in rows 4-5
    mask = step.batch.response_mask
    logp = (-torch.rand(mask.shape) * mask).requires_grad_()
    old, adv = logp.detach() + 0.05 * torch.randn(mask.shape), torch.randn(6)
    (whole,) = torch.autograd.grad(objective(logp, old, None, adv, mask)[0], logp)
    plan = UpdatePlan(micro_batch_size=4)
    summed = torch.zeros_like(logp)
    for rows, weight in plan.micro_batches(step.batch, token_level=objective.loss_agg == "token-mean"):
        loss, _ = objective(logp[rows], old[rows], None, adv[rows], mask[rows])
        summed += torch.autograd.grad(loss * weight, logp)[0]
    assert torch.allclose(summed, whole, atol=1e-6)


def test_truncated_importance_sampling_weights_the_policy_gradient(tiny):
    """train.tis_cap: tokens whose rollout log-prob is below the trainer's get weight
    min(p_train / p_rollout, cap); with agreeing log-probs the update is unchanged."""
    from conftest import ScriptedReward, fake_step, tiny_rl

    step = fake_step(["a", "a", "b", "b"], torch.tensor([1.0, 0.0, 1.0, 0.0]))
    module, _ = tiny_rl(tiny, ScriptedReward([1]), tis_cap=2.0)
    step.advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    step.old_logp = step.batch.rollout_logprobs.clone()
    advantages, stats = module._tis_advantages(step, step.old_logp)
    mask = step.batch.response_mask.bool()
    assert torch.allclose(advantages[mask], (step.advantages[:, None] * mask)[mask])  # no mismatch: weight 1
    assert stats["tis_weight_mean"] == pytest.approx(1.0)
    step.batch.rollout_logprobs[0] -= 0.1  # row 0: p_train / p_rollout = e^0.1
    step.batch.rollout_logprobs[2] -= 5.0  # row 2: e^5, capped at 2
    advantages, stats = module._tis_advantages(step, step.old_logp)
    assert torch.allclose(advantages[0][mask[0]], torch.full((3,), math.exp(0.1)))
    assert torch.allclose(advantages[2][mask[2]], torch.full((3,), 2.0))
    assert stats["tis_clipped_frac"] == pytest.approx(0.25)


def test_tis_cap_is_checked(tiny):
    from conftest import ScriptedReward, tiny_rl

    from ngrpo_lightning.objectives import GSPO

    with pytest.raises(ValueError, match=r"train.tis_cap=0 is out of range: allowed \(0.0, inf\]"):
        tiny_rl(tiny, ScriptedReward([1]), tis_cap=0)
    with pytest.raises(ValueError, match=r"train.tis_level=token needs an objective that takes per-token"):
        tiny_rl(tiny, ScriptedReward([1]), objective=GSPO(), tis_cap=2.0, tis_level="token")
    with pytest.raises(ValueError, match=r"train.tis_mode='clip' is unknown: allowed \['mask', 'truncate'\]"):
        tiny_rl(tiny, ScriptedReward([1]), tis_cap=2.0, tis_mode="clip")
    module, _ = tiny_rl(tiny, ScriptedReward([1]), objective=GSPO(), tis_cap=2.0)  # auto: sequence weights
    assert module.tis_level == "geometric"
    module, _ = tiny_rl(tiny, ScriptedReward([1]), max_staleness=1)  # stale rollouts are always corrected
    assert (module.tis_cap, module.tis_level, module.tis_mode) == (2.0, "token", "truncate")


@pytest.mark.parametrize(
    "level, mode, row0, row2",
    [  # row 0: each of its 3 tokens has ratio e^0.1; row 2: e^0.5 (above the cap of 1.5 per token)
        ("token", "truncate", [math.exp(0.1)] * 3, [1.5] * 3),
        ("token", "mask", [math.exp(0.1)] * 3, [0.0] * 3),
        ("sequence", "truncate", [math.exp(0.3)] * 3, [1.5] * 3),  # the product of the tokens' ratios
        ("sequence", "mask", [math.exp(0.3)] * 3, [0.0] * 3),
        ("geometric", "truncate", [math.exp(0.1)] * 3, [1.5] * 3),  # their geometric mean
    ],
)
def test_importance_weights_per_token_or_sequence(tiny, level, mode, row0, row2):
    """train.tis_level / tis_mode: the weight of a row's tokens from its ratios p_train / p_rollout."""
    from conftest import ScriptedReward, fake_step, tiny_rl

    step = fake_step(["a", "a", "b", "b"], torch.tensor([1.0, 0.0, 1.0, 0.0]))
    module, _ = tiny_rl(tiny, ScriptedReward([1]), tis_cap=1.5, tis_level=level, tis_mode=mode)
    step.advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    step.old_logp = step.batch.rollout_logprobs.clone()
    mask = step.batch.response_mask.bool()
    step.batch.rollout_logprobs[0] -= 0.1
    step.batch.rollout_logprobs[2] -= 0.5
    advantages, stats = module._tis_advantages(step, step.old_logp)
    advantages = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(mask)
    assert advantages[0][mask[0]].tolist() == pytest.approx(row0, rel=1e-5)
    assert advantages[2][mask[2]].tolist() == pytest.approx(row2, rel=1e-5)
    assert advantages[1][mask[1]].tolist() == pytest.approx([-1.0] * 3)  # no mismatch: weight 1
    assert stats["tis_weight_max"] == pytest.approx(max(row0 + row2 + [1.0]), rel=1e-5)


@pytest.mark.parametrize(
    "objective",
    [
        GRPO(kl_coef=0.0, loss_agg="token-mean"),
        GRPO(kl_coef=0.0, loss_agg="seq-mean-token-mean"),
        GRPO(kl_coef=0.0, loss_agg="seq-mean-token-sum"),
        GRPO(kl_coef=0.0, loss_agg="seq-mean-token-sum-norm"),
        GSPO(clip_low=0.2, clip_high=0.2),
    ],
    ids=lambda o: f"{o.registered_name}-{o.loss_agg}",
)
def test_token_budget_micro_batches_give_the_whole_batch_gradient(tiny, objective):
    """optim.max_tokens_per_micro_batch: rows grouped by length, each micro-batch cut to its own
    longest sequence in the forward; the policy's gradient equals the whole batch's, with the
    groups' prompts shared or not."""
    from conftest import ScriptedReward, tiny_rl

    from ngrpo_lightning.training.settings import OptimConfig

    step = fake_step(list("aabbcc"), [1, 0, 1, 1, 0, 1], lengths=[1, 5, 2, 3, 5, 4])
    step.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0])
    grads = []
    # the first is the plain forward; the others share each group's prompt (the backend's share_prompts)
    for budget, size, share in ((None, 0, False), (None, 0, True), (16, 0, True), (9, 2, True)):
        module, _ = tiny_rl(tiny, ScriptedReward([1]), objective=objective)
        module.optim = OptimConfig(lr=1e-2, max_tokens_per_micro_batch=budget, micro_batch_size=size)
        module.backend.share_prompts = share
        assert module._shares_prompts(module.policy) == share
        module.plan = UpdatePlan(micro_batch_size=size, max_tokens_per_micro_batch=budget)
        torch.manual_seed(0)
        with torch.no_grad():
            old = module._logprobs_no_grad(module.policy, step.batch) + 0.01  # a fixed behaviour policy
        groups = list(module.plan.micro_batches(step.batch, objective.loss_agg == "token-mean"))
        if budget:
            lengths = step.batch.prompt_mask.sum(-1) + step.batch.response_mask.sum(-1)
            assert len(groups) > 1 and all(len(r) * lengths[r].max() <= budget for r, _ in groups)
        for rows, weight in groups:
            mb = step.select(rows)
            logp, _ = module._logprobs(module.policy, mb.batch, 1.0)
            assert logp.shape == mb.batch.response_ids.shape  # padded back to the update's width
            loss, _ = objective(logp, old[rows], None, mb.advantages, mb.batch.response_mask)
            (loss * weight).backward()
        grads.append(torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None]))
    for g in grads[1:]:  # equal up to fp32 summation order
        assert (g - grads[0]).norm() <= 1e-5 * grads[0].norm()


def test_gradient_checkpointing_on_one_device_keeps_the_gradient(tiny):
    """model.gradient_checkpointing: decoder activations recomputed in backward, same gradient."""
    from conftest import ScriptedReward, tiny_rl

    from ngrpo_lightning.build.components import build_module
    from ngrpo_lightning.config import compose

    module = build_module(compose(["model=tiny", "model.gradient_checkpointing=true", "logger=none"]))
    assert module.policy.is_gradient_checkpointing
    assert module.reference is None or not module.reference.is_gradient_checkpointing

    step = fake_step(list("aabb"), [1, 0, 1, 0], lengths=[3, 1, 2, 3])
    grads = []
    for checkpointing in (False, True):
        plain, _ = tiny_rl(tiny, ScriptedReward([1]))
        if checkpointing:
            plain.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        plain.policy.train()
        logp, _ = plain._logprobs(plain.policy, step.batch, 1.0)
        (logp * step.batch.response_mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in plain.policy.parameters() if p.grad is not None]))
    assert (grads[1] - grads[0]).norm() <= 1e-5 * grads[0].norm()


@pytest.mark.parametrize("adapters", [False, True], ids=["reference", "lora"])
def test_the_reference_pass_runs_on_packed_weights(tiny, monkeypatch, adapters):
    """The KL reference's log-probs (a frozen copy, or the LoRA policy with its adapters off) come
    from weights packed once for the pass where the backend chose it, equal to the plain pass's to
    float rounding; with packing off, nothing is packed."""
    import copy

    from conftest import ScriptedReward, tiny_rl

    from ngrpo_lightning.backends import CPUBackend
    from ngrpo_lightning.models import lora
    from ngrpo_lightning.objectives import GRPO
    from ngrpo_lightning.training import logprob_passes as module_file  # where the frozen passes pack
    from ngrpo_lightning.training.module import RLModule

    packed_layers = []
    original = module_file.packed_for_pass

    def counting(*args, **kwargs):
        ctx = original(*args, **kwargs)

        class Spy:
            def __enter__(self):
                packed_layers.append(ctx.__enter__())

            def __exit__(self, *exc):
                return ctx.__exit__(*exc)

        return Spy()

    monkeypatch.setattr(module_file, "packed_for_pass", counting)
    step = fake_step(list("aabb"), [1, 0, 1, 0])
    results = []
    for packing in ("on", "off"):
        backend = CPUBackend(packing=packing)
        policy, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
        if adapters:
            policy = lora.apply(policy, lora.LoraSettings(enabled=True, rank=4, alpha=8))
            kwargs = {"adapters": True}
        else:
            kwargs = {"reference": backend.prepare(RLModule.reference_from(policy))}
        backend.prepare(policy, trains=True)
        module, _ = tiny_rl(
            (policy, tokenizer), ScriptedReward([1]), objective=GRPO(kl_coef=0.1), backend=backend, **kwargs
        )
        assert module.backend is backend
        results.append(module.prepare(step).ref_logp)
    assert packed_layers[0] >= 7 * tiny[0].config.num_hidden_layers  # every linear of every layer
    assert packed_layers[1] == 0
    mask = step.batch.response_mask.bool()
    assert results[0][mask].abs().min() > 0
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_a_file_backed_reference_frees_each_weight_it_packs(tiny, tmp_path, tied):
    """A file-backed reference whose layers the backend packs once per pass: each decoder weight is
    freed once packed (one copy per pass, not two); the LM head, read as a weight by the chunked
    log-probs, stays; the log-probs equal the in-memory reference's to float rounding."""
    import copy

    from conftest import ScriptedReward, tiny_rl

    from ngrpo_lightning.backends import CPUBackend, file_weights
    from ngrpo_lightning.objectives import GRPO
    from ngrpo_lightning.training.module import RLModule

    policy, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    if not tied:
        policy.lm_head.weight = torch.nn.Parameter(policy.lm_head.weight.detach() * 1.5)
    step = fake_step(list("aabb"), [1, 0, 1, 0])
    results, live = [], []
    backend = CPUBackend(packing="on")
    for reference in (RLModule.reference_from(policy), file_weights.frozen_copy_to_file(policy, tmp_path)):
        backend.prepare(reference)
        module, _ = tiny_rl(
            (policy, tokenizer), ScriptedReward([1]), objective=GRPO(kl_coef=0.1), reference=reference, backend=backend
        )
        original = module._logprobs_no_grad

        def seen(model, batch, original=original, reference=reference):  # weights in memory during its pass
            if model is reference:
                live.append(sum(p.numel() for p in model.parameters() if p.untyped_storage().nbytes() > 4))
            return original(model, batch)

        module._logprobs_no_grad = seen
        results.append(module.prepare(step).ref_logp)
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-5)
    linears = sum(
        m.weight.numel() for name, m in policy.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in name
    )
    assert live[0] - live[1] == linears  # every decoder linear's plain weight freed; embeddings and head kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_clipping_scales_every_gradient_with_one_read_of_the_norm(dtype):
    """The clipped gradients are each gradient times the clipping coefficient in float32 (as a
    Python number scales them), and the host reads the device once per step, not per parameter."""
    from ngrpo_lightning.rollout.host_syncs import HostSyncs
    from ngrpo_lightning.training.parallel import clip_grad_norm

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for shape in [(5, 3), (7,), (2, 2, 2)]]
    for p in params:
        p.grad = torch.randn(p.shape).to(dtype)
    before = [p.grad.clone() for p in params]
    with HostSyncs() as syncs:
        total = clip_grad_norm(params, max_norm=0.5)
    assert syncs.ops == ["aten._local_scalar_dense"]
    expected_total = torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in before]))
    assert torch.allclose(total.float(), expected_total, rtol=1e-2)
    coef = min(1.0, float(0.5 / (total + 1e-6)))
    assert coef < 1.0  # the case that clips
    for p, g in zip(params, before):
        assert torch.equal(p.grad, g.mul(coef))  # the per-parameter scaling of before, bit for bit
    kept = [p.grad.clone() for p in params]
    clip_grad_norm(params, max_norm=math.inf)  # no clipping: the norm only
    assert all(torch.equal(p.grad, g) for p, g in zip(params, kept))
