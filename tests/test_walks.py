"""Walks over a model's modules made at every rollout and pass (models/walks.py): the modules and
modes ``modules()`` and ``train()`` give, from one loop."""

import copy

import torch

from ngrpo_lightning.models import lora
from ngrpo_lightning.models.walks import modules_of, set_training


def test_a_flat_walk_finds_the_modules_modules_finds_in_its_order(tiny):
    """Each module once (a module shared by two parents, a child set to None), in the same order,
    for a peft model too."""
    policy = lora.apply(copy.deepcopy(tiny[0]), lora.LoraSettings(enabled=True, rank=4))
    assert [id(m) for m in modules_of(policy)] == [id(m) for m in policy.modules()]
    shared = torch.nn.Linear(2, 2)
    odd = torch.nn.Sequential(shared, torch.nn.Sequential(shared, torch.nn.ReLU()), shared)
    odd.register_module("gone", None)
    assert [id(m) for m in modules_of(odd)] == [id(m) for m in odd.modules()]
    assert len(modules_of(odd)) == 4


def test_a_walk_leaves_out_the_children_a_module_prunes_and_nothing_else():
    """``prune(module)`` is called on each module reached, in order; the children it returns are not
    walked into (their own children neither), the rest keep ``modules()``'s order."""
    inner = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    kept = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(torch.nn.Sequential(inner, kept), torch.nn.Tanh())
    reached = []

    def prune(module):
        reached.append(module)
        return (inner,) if module is model[0] else None

    walked = modules_of(model, prune=prune)
    assert [id(m) for m in walked] == [id(m) for m in reached]
    assert [id(m) for m in walked] == [id(model), id(model[0]), id(kept), id(model[1])]


def test_set_training_leaves_every_module_in_the_mode_train_would(tiny):
    policy = lora.apply(copy.deepcopy(tiny[0]), lora.LoraSettings(enabled=True, rank=4))
    policy.train()
    set_training(policy, False)
    assert not any(m.training for m in policy.modules())
    set_training(policy, True)
    assert all(m.training for m in policy.modules())


def test_a_module_with_its_own_train_gets_it_called():
    """A class whose ``train`` does more than set flags (peft's DoRA layers clear a cache; a
    transformers model with hub kernels re-casts them) makes the walk call ``model.train``."""

    class Counting(torch.nn.Linear):
        calls = 0

        def train(self, mode=True):
            Counting.calls += 1
            return super().train(mode)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(Counting(2, 2)))
    set_training(model, False)
    assert Counting.calls == 1 and not any(m.training for m in model.modules())
    set_training(model, True)
    assert Counting.calls == 2 and all(m.training for m in model.modules())


def test_a_transformers_model_s_train_is_its_flags_unless_it_uses_hub_kernels(tiny):
    from ngrpo_lightning.models.walks import _train_is_the_flag

    model = copy.deepcopy(tiny[0])
    assert _train_is_the_flag(model)
    model._use_kernels = True  # what transformers' use_kernels reads (setting it needs the kernels package)
    assert model.use_kernels and not _train_is_the_flag(model)
