"""UpdateMemoryCheck: the start-of-fit estimate of what the update keeps, and its warning."""

import pytest
import torch
from conftest import ScriptedReward, tiny_rl, tiny_trainer

from ngrpo_lightning.backends.recompute import tallying_kept
from ngrpo_lightning.callbacks import UpdateMemoryCheck
from ngrpo_lightning.callbacks.update_memory import UpdateMemory, kept_bytes_per_token
from ngrpo_lightning.rollout.batch import RolloutBatch
from ngrpo_lightning.training.forward import response_logprobs


def test_the_probe_predicts_what_a_longer_training_forward_keeps(tiny):
    """Per-token bytes from the 128-token probe x the tokens of a 4 x (24 + 200)-token batch
    against that batch's own tally (softmax recomputed on both: it is counted apart)."""
    module, _ = tiny_rl(tiny, ScriptedReward([1, 0]))
    per_token = kept_bytes_per_token(module)
    rows, prompt, response = 4, 24, 200
    ids = torch.randint(3, 1000, (rows, prompt + response))
    batch = RolloutBatch(
        prompt_ids=ids[:, :prompt],
        prompt_mask=torch.ones(rows, prompt, dtype=torch.long),
        response_ids=ids[:, prompt:],
        response_mask=torch.ones(rows, response, dtype=torch.long),
        rollout_logprobs=torch.zeros(rows, response),
    )
    policy = module.policy
    skip = frozenset(t.untyped_storage().data_ptr() for t in [*policy.parameters(), *policy.buffers()])
    kept = {}
    with tallying_kept(kept, skip):
        response_logprobs(policy, batch, with_entropy=True, keep_softmax_mib=0)
    assert per_token > 0
    assert sum(kept.values()) == pytest.approx(per_token * rows * (prompt + response), rel=0.2)


def test_advice_names_a_budget_that_fits_or_says_none_does():
    est = UpdateMemory(kept_per_token=1024, tokens=10_000, softmax=0, optimizer=0, available=5_000_000)
    assert est.needed == 14_336_000 and not est.fits  # 1.4 x what the forward keeps
    assert est.budget_that_fits() == 2560  # 0.75 x 5e6 / 1433.6 = 2616, rounded down to 256
    check = UpdateMemoryCheck(rows_per_step=32, max_new_tokens=1024, longest_sequence=1100)
    assert "optim.max_tokens_per_micro_batch=2560" in check.advice(est)
    long_prompts = UpdateMemoryCheck(rows_per_step=32, max_new_tokens=1024, longest_sequence=4096 + 1024)
    assert "optim.micro_batch_size=2" in long_prompts.advice(est)  # 2560 tokens: 2 responses of 1024
    too_long = UpdateMemoryCheck(rows_per_step=32, max_new_tokens=4096, longest_sequence=5000)
    assert "model.gradient_checkpointing=true" in too_long.advice(est)


def test_fit_warns_before_training_when_the_update_cannot_fit(tiny):
    module, datamodule = tiny_rl(tiny, ScriptedReward([1, 0]))
    check = UpdateMemoryCheck(rows_per_step=4, max_new_tokens=6, longest_sequence=4096 + 6, available_bytes=1)
    with pytest.warns(UserWarning, match=r"the update needs about .* more than 90% of the 0.0 GiB available"):
        tiny_trainer(1, callbacks=[check]).fit(module, datamodule)
    assert module.trainer.global_step == 1  # a warning: the run goes on
    est = check.estimate
    assert est.tokens == 4 * 6 and est.kept_per_token > 0
    trainable = sum(p.numel() * 4 for p in module.policy.parameters())
    assert est.optimizer == 3 * trainable  # gradients + two AdamW moments, none allocated at the start


def test_a_run_that_fits_says_nothing(tiny, recwarn):
    module, datamodule = tiny_rl(tiny, ScriptedReward([1, 0]))
    check = UpdateMemoryCheck(rows_per_step=4, max_new_tokens=6, longest_sequence=4096 + 6)
    tiny_trainer(1, callbacks=[check]).fit(module, datamodule)
    assert check.estimate.fits
    assert not [w for w in recwarn if "the update needs" in str(w.message)]


def test_ngrpo_train_checks_its_update(tmp_path):
    from ngrpo_lightning.build.trainer import build_trainer
    from ngrpo_lightning.config import compose

    cfg = compose([f"output_dir={tmp_path}", "logger=none"])
    (check,) = [cb for cb in build_trainer(cfg).callbacks if isinstance(cb, UpdateMemoryCheck)]
    assert check.rows_per_step == cfg.data.prompts_per_step * cfg.rollout.group_size
    assert check.longest_sequence == cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens


def test_a_training_forward_hands_freed_memory_back_between_the_decoder_and_the_head(tiny, monkeypatch):
    """The backend's ``release_memory`` (``release_freed_memory`` on the CPU) runs once in a training forward, after
    the decoder and before the chunked LM head; a frozen pass (no gradients) goes straight on; the values agree."""
    from ngrpo_lightning.training import forward

    module, _ = tiny_rl(tiny, ScriptedReward([1, 0]))
    events = []
    module.policy.model.norm.register_forward_hook(lambda *_: events.append("decoder"))
    monkeypatch.setattr(module.backend, "release_memory", lambda: events.append("release"))
    head = forward.chunked_token_logprobs
    monkeypatch.setattr(forward, "chunked_token_logprobs", lambda *a, **k: events.append("head") or head(*a, **k))
    ids = torch.randint(3, 1000, (2, 10))
    batch = RolloutBatch(
        prompt_ids=ids[:, :4],
        prompt_mask=torch.ones(2, 4, dtype=torch.long),
        response_ids=ids[:, 4:],
        response_mask=torch.ones(2, 6, dtype=torch.long),
        rollout_logprobs=torch.zeros(2, 6),
    )
    trained, _ = module._logprobs(module.policy, batch, 1.0, with_entropy=True)
    assert events == ["decoder", "release", "head"]
    events.clear()
    with torch.no_grad():
        frozen, _ = module._logprobs(module.policy, batch, 1.0)
    assert events == ["decoder", "head"]
    assert torch.equal(trained.detach(), frozen)


def test_a_step_hands_freed_memory_back_before_its_update_not_before_the_frozen_passes(tiny, monkeypatch):
    """Within a step the backend's ``release_memory`` runs twice: before the update (the step's peak) and in the
    update's forward before the LM head; not before the reward or the log-prob passes, which reuse the rollout's
    freed pages (handing them back would only fault them in again)."""
    module, dm = tiny_rl(tiny, ScriptedReward([1, 0]))
    events = []
    monkeypatch.setattr(module.backend, "release_memory", lambda: events.append("release"))
    phase = module._phase
    monkeypatch.setattr(module, "_phase", lambda name: events.append(name) or phase(name))
    tiny_trainer(1).fit(module, datamodule=dm)
    assert events == ["reward", "logprobs", "release", "update", "release"]
