"""LoRA adapters (model.lora): checked settings, the reference from the same weights, a run
that trains and checkpoints the adapters only, and adapters that leave the framework."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import TINY_JOB, chat_prompt_ids, trained_lora

from ngrpo_lightning.commands.cli import main
from ngrpo_lightning.models import lora
from ngrpo_lightning.models.loading import load_policy

peft = pytest.importorskip("peft")

LORA_JOB = [
    *(o for o in TINY_JOB if not o.startswith("logger.")),
    "logger=none",
    "model.lora.enabled=true",
    "validate_before_fit=false",
    "data.val_size=0",
]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.lora.rank=0"], "model.lora.rank=0 is out of range"),
        (["model.lora.alpha=0"], "model.lora.alpha=0 is out of range"),
        (["model.lora.dropout=1.0"], "model.lora.dropout=1.0 is out of range: allowed [0, 1)"),
        (["+model.lora.rnak=8"], "model.lora has unknown keys ['rnak']"),
        (["model.lora.target_modules=[q_proj,qkv]"], "['qkv'] are not linear layers of LlamaForCausalLM"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(overrides, message, capsys, tmp_path):
    job = ["model=tiny", "logger=none", f"output_dir={tmp_path}", "model.lora.enabled=true"]
    assert main(["train", *job, *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err
    if "target_modules" in overrides[0]:  # the model's own linear layers are listed
        assert "['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']" in err


def test_only_the_adapters_get_gradients():
    policy = lora.apply(load_policy("tiny")[0], lora.LoraSettings(enabled=True, rank=4))
    ids = torch.randint(0, 1000, (2, 10), generator=torch.Generator().manual_seed(2))
    policy(input_ids=ids).logits.float().log_softmax(-1).mean().backward()
    grads = {name: p.grad for name, p in policy.named_parameters() if p.grad is not None}
    assert grads and all(lora.is_adapter_weight(name) for name in grads)
    assert any(g.abs().sum() > 0 for name, g in grads.items() if "lora_B" in name)  # B = 0 at start: A's are 0


def test_the_lean_training_forward_gives_peft_s_values_bit_for_bit():
    from peft.tuners.lora.layer import Linear

    from ngrpo_lightning.backends.lora import LeanLoraLinear, lean_lora_layers
    from ngrpo_lightning.backends.swap import original_class

    policy = trained_lora()
    assert lean_lora_layers(policy) == 7 * policy.config.num_hidden_layers
    ids = torch.randint(0, policy.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))

    def forward_backward():
        policy.zero_grad(set_to_none=True)
        logits = policy(input_ids=ids).logits
        logits.float().log_softmax(-1).mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

    layers = [m for m in policy.modules() if isinstance(m, Linear)]
    assert layers and all(isinstance(m, LeanLoraLinear) and "forward" not in vars(m) for m in layers)
    assert lean_lora_layers(policy) == 0  # swapped once
    lean, lean_grads = forward_backward()
    for m in layers:
        m.__class__ = original_class(m)  # peft's own layer and forward
    assert all(type(m) is Linear for m in layers)
    peft_out, peft_grads = forward_backward()
    assert torch.equal(lean, peft_out)
    assert lean_grads.keys() == peft_grads.keys() and all(torch.equal(lean_grads[k], peft_grads[k]) for k in lean_grads)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"), id="on_a_gpu"
        ),
    ],
)
def test_float32_adapters_on_a_bfloat16_model_multiply_in_bfloat16_without_casting_activations(device):
    """peft keeps adapters in float32 on a bfloat16 model and casts every adapted layer's input to
    float32 and its sum back; the lean layer casts the small adapter weights instead (as autocast
    would). Those activation-sized casts are gone (the model's own, its norms', remain), and the
    outputs and the adapters' gradients are as close to the float64 model's as peft's are: the
    bfloat16 base model, not the adapter's rounding, sets the error."""
    import copy

    from peft.tuners.lora.layer import Linear
    from torch.utils._python_dispatch import TorchDispatchMode

    from ngrpo_lightning.backends.lora import lean_lora_layers
    from ngrpo_lightning.backends.swap import original_class

    # peft draws A from the global generator: seeded, so the bound below does not depend on the tests
    # run before (at some draws the bfloat16 adapters' largest gradient error passes 1.5x peft's,
    # on either lean path: a few in 26 seeds, each path)
    torch.manual_seed(0)
    policy = lora.apply(load_policy("tiny", dtype="bfloat16")[0], lora.LoraSettings(enabled=True, rank=16))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.3, generator=torch.Generator().manual_seed(0))
    assert {p.dtype for n, p in policy.named_parameters() if p.requires_grad} == {torch.float32}  # peft's default
    policy.to(device)
    ids = torch.randint(0, policy.config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(1)).to(device)

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten._to_copy:
                self.sizes.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    def forward_backward(model):
        model.zero_grad(set_to_none=True)
        with Casts() as casts:
            logits = model(input_ids=ids).logits
        logits.float().log_softmax(-1).mean().backward()
        grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach().double(), grads, casts.sizes

    truth, truth_grads, _ = forward_backward(copy.deepcopy(policy).double())
    layers = [m for m in policy.modules() if isinstance(m, Linear)]
    peft_out, peft_grads, peft_casts = forward_backward(policy)
    lean_lora_layers(policy)
    assert all(type(m) is not original_class(m) for m in layers)
    lean, lean_grads, lean_casts = forward_backward(policy)
    activation = ids.numel() * policy.config.hidden_size
    wide = [sum(size >= activation for size in casts) for casts in (lean_casts, peft_casts)]
    assert wide[1] - wide[0] >= len(layers)  # peft cast each adapted layer's input to float32 (and most sums back)

    def error(value, reference):
        return float((value - reference).norm() / reference.norm())

    assert error(lean, truth) <= 1.5 * error(peft_out, truth)
    assert lean_grads.keys() == peft_grads.keys() == truth_grads.keys()
    lean_errors = [error(lean_grads[k], truth_grads[k]) for k in truth_grads]
    peft_errors = [error(peft_grads[k], truth_grads[k]) for k in truth_grads]
    assert max(lean_errors) <= 1.5 * max(peft_errors) and sum(lean_errors) <= 1.5 * sum(peft_errors)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradient_checkpointing_gives_the_adapters_the_same_gradients(dtype):
    """Lean layers on either path: peft's ops (float32) and the fused product (float32 adapters on
    a bfloat16 model), the prepared model's recomputation inside."""
    from ngrpo_lightning.backends import Backend

    policy = trained_lora() if dtype == "float32" else trained_lora(std=0.3).to(torch.bfloat16)
    if dtype == "bfloat16":
        for p in policy.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # peft's float32 adapters on the bfloat16 model
    Backend(dtype=getattr(torch, dtype)).prepare(policy, trains=True)
    ids = torch.randint(0, policy.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    embeds = policy.get_input_embeddings()(ids)  # frozen: the checkpointed layers' input needs no gradient

    def grads():
        policy.zero_grad(set_to_none=True)
        policy(inputs_embeds=embeds).logits.float().log_softmax(-1).mean().backward()
        return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

    policy.train()
    plain = grads()
    policy.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False}
    )  # as model.gradient_checkpointing
    checkpointed = grads()
    assert plain and plain.keys() == checkpointed.keys()
    assert any(g.abs().sum() > 0 for g in checkpointed.values())
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7)
    if dtype == "bfloat16":
        adapted = next(m for m in policy.modules() if isinstance(m, peft.tuners.lora.LoraLayer))
        assert type(adapted(embeds).grad_fn).__name__ == "LoraProductBackward"  # one node per layer


def test_the_reference_is_the_base_model_with_the_adapters_off():
    base, _ = load_policy("tiny")
    policy = trained_lora(std=0.5)  # trained adapters: the policy differs from its base
    ids = torch.randint(0, base.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = base(input_ids=ids).logits
        adapted = policy(input_ids=ids).logits
        with policy.disable_adapter():
            reference = policy(input_ids=ids).logits
    assert not torch.allclose(adapted, expected, atol=1e-3)
    torch.testing.assert_close(reference, expected, rtol=1e-6, atol=1e-6)
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter_weight(name) for name in trainable)


@pytest.mark.parametrize("lean", [False, True], ids=["peft's layers", "lean layers"])
def test_adapters_off_gives_peft_disable_adapters_outputs_and_puts_everything_back(lean):
    """``lora.adapters_off``: the base model's outputs, bit for bit those under peft's
    ``disable_adapter()``; afterwards the adapted outputs again, a layer that was off still off,
    and ``requires_grad`` never touched."""
    from ngrpo_lightning.backends import Backend

    policy = trained_lora(std=0.5)
    if lean:
        Backend().prepare(policy, trains=True)
    ids = torch.randint(0, policy.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    layers = [m for m in policy.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    layers[-1]._disable_adapters = True  # one layer off on its own, before and after
    grads = {name: p.requires_grad for name, p in policy.named_parameters()}
    with torch.no_grad():
        adapted = policy(input_ids=ids).logits
        with policy.disable_adapter():
            expected = policy(input_ids=ids).logits
        layers[-1]._disable_adapters = True  # peft's context turned every layer back on
        with lora.adapters_off(policy):
            assert all(m.disable_adapters for m in layers)
            assert {name: p.requires_grad for name, p in policy.named_parameters()} == grads
            reference = policy(input_ids=ids).logits
        after = policy(input_ids=ids).logits
    assert torch.equal(reference, expected) and not torch.allclose(reference, adapted, atol=1e-3)
    assert torch.equal(after, adapted)
    assert layers[-1].disable_adapters and not any(m.disable_adapters for m in layers[:-1])


def test_an_unpacked_rollout_multiplies_by_merged_weights():
    """Where nothing is packed (a GPU rollout; here the CPU backend with packing off), each adapted
    layer still runs one product per token, on W + scale B A: no base or adapter product runs,
    the rollout is the adapted policy's, and the training forward is back afterwards."""
    from ngrpo_lightning.backends import CPUBackend
    from ngrpo_lightning.backends.lora import LeanLoraLinear
    from ngrpo_lightning.explorers import TemperatureExplorer
    from ngrpo_lightning.models.loading import load_tokenizer
    from ngrpo_lightning.rollout import HFEngine

    policy, tok = trained_lora(std=0.5), load_tokenizer("tiny")
    CPUBackend(packing="off").prepare(policy, trains=True)
    adapted = [m for m in policy.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    inner = [sub for m in adapted for sub in m.modules() if isinstance(sub, torch.nn.Linear)]
    engine = HFEngine(policy, tok, max_new_tokens=6)
    prompts = chat_prompt_ids(tok, ["What is 7 + 5?", "What is 3 * 4?"])
    calls = []
    hooks = [m.register_forward_pre_hook(lambda m, args: calls.append(m)) for m in inner]
    try:
        merged = engine.generate(prompts, TemperatureExplorer(0.0), n=2)
    finally:
        for hook in hooks:
            hook.remove()
    assert not calls  # one merged product per adapted layer
    with mock.patch.object(LeanLoraLinear, "merge_adapter_name", lambda module: None):  # three products
        unmerged = engine.generate(prompts, TemperatureExplorer(0.0), n=2)
    assert torch.equal(merged.response_ids, unmerged.response_ids)
    torch.testing.assert_close(merged.rollout_logprobs, unmerged.rollout_logprobs, atol=1e-4, rtol=1e-4)
    assert all(isinstance(m, LeanLoraLinear) and m._merged is None for m in adapted)  # the training forward
    assert not any("forward" in vars(m) for m in policy.modules())


def test_a_lora_run_trains_checkpoints_and_exports_the_adapters_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *LORA_JOB, "trainer.max_steps=2"]) == 0
    ckpt = torch.load(tmp_path / "outputs/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    keys = [k.removeprefix("policy.") for k in ckpt["state_dict"] if k.startswith("policy.")]
    layers = load_policy("tiny")[0].config.num_hidden_layers
    assert len(keys) == layers * 7 * 2 and all(lora.is_adapter_weight(k) for k in keys)  # A and B of 7 linears
    assert len(ckpt["optimizer_states"][0]["state"]) == len(keys)  # AdamW moments for the adapters only
    assert ckpt["ngrpo"]["base_model"]["weights_sha256"]

    assert main(["train", *LORA_JOB, "trainer.max_steps=3", "resume=last"]) == 0  # continues on the same base

    # the tiny random model earns no reward, so its adapters stay at B = 0: give them values, as
    # training would, to check that what leaves the framework is what the checkpoint holds
    path = tmp_path / "outputs/checkpoints/last.ckpt"
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    gen = torch.Generator().manual_seed(0)
    for key, value in ckpt["state_dict"].items():
        if "lora_B" in key:
            value.copy_(torch.randn(value.shape, generator=gen) * 0.5)
    torch.save(ckpt, path)

    assert main(["export", "outputs", "adapters", "--no-mlflow"]) == 0
    assert main(["export", "outputs", "merged", "--no-mlflow", "--merge"]) == 0
    assert (Path("adapters") / "adapter_config.json").exists() and not (Path("adapters") / "config.json").exists()
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(1))
    from transformers import AutoModelForCausalLM

    from ngrpo_lightning.checkpoints.trained_policy import find_checkpoint, load_trained_policy, read_checkpoint

    trained, _ = load_trained_policy(read_checkpoint(find_checkpoint("outputs")))
    outside = peft.PeftModel.from_pretrained(load_policy("tiny")[0], "adapters")
    merged = AutoModelForCausalLM.from_pretrained("merged")
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        torch.testing.assert_close(outside(input_ids=ids).logits, expected, rtol=0, atol=0)
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(load_policy("tiny")[0](input_ids=ids).logits, expected, atol=1e-4)


def test_resume_on_a_changed_base_model_is_refused_naming_both(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    base, tokenizer = load_policy("tiny")
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    job = [*LORA_JOB, f"model.name_or_path={tmp_path / 'base'}"]
    assert main(["train", *job, "trainer.max_steps=1"]) == 0
    with torch.no_grad():
        base.model.embed_tokens.weight.add_(0.01)  # another base model under the same name
    base.save_pretrained(tmp_path / "base")
    assert main(["train", *job, "trainer.max_steps=2", "resume=last"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume: the checkpoint's reference is the base model" in err
    assert err.count("weights sha256") == 2  # the checkpoint's base and this run's, both named
    # eval and export load the adapters on the base model the same way, and refuse it the same way
    assert main(["eval", "model=outputs", "n=1", "limit=1", "max_new_tokens=2", "logger=none"]) == 2
    err = capsys.readouterr().err
    assert "cannot eval: the checkpoint's reference is the base model" in err and err.count("weights sha256") == 2
    assert main(["export", "outputs", str(tmp_path / "hf"), "--no-mlflow"]) == 2
    err = capsys.readouterr().err
    assert "cannot export: the checkpoint's reference is the base model" in err and err.count("weights sha256") == 2
    assert not (tmp_path / "hf").exists()


def test_the_ngrpo_lora_preset_trains_with_neighbor_mixing(tmp_path, monkeypatch):
    from ngrpo_lightning.config import compose

    cfg = compose(["experiment=ngrpo-lora"])
    assert cfg.model.lora.enabled and cfg.explorer.name == "neighbor" and cfg.objective.name == "grpo"
    monkeypatch.chdir(tmp_path)
    job = [o for o in LORA_JOB if o != "model.lora.enabled=true"]
    assert main(["train", "experiment=ngrpo-lora", *job, "trainer.max_steps=1"]) == 0
    ckpt = torch.load(tmp_path / "outputs/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    assert all(lora.is_adapter_weight(k.removeprefix("policy.")) for k in ckpt["state_dict"] if k.startswith("policy."))


def test_the_fused_lora_product_s_gradients_are_the_derivatives_of_its_output():
    """``LoraProduct`` (float32 adapters on a half model) writes ``base + scale B A x_a`` into
    ``base`` and computes its own backward: checked against finite differences in float64, with
    the adapter's input apart from the base's (dropout) and rows of more than one dimension."""
    from ngrpo_lightning.backends.lora import LoraProduct

    g = torch.Generator().manual_seed(0)
    base, x_a = torch.randn(2, 3, 5, generator=g, dtype=torch.float64), torch.randn(2, 3, 4, generator=g).double()
    A, B = torch.randn(2, 4, generator=g).double(), torch.randn(5, 2, generator=g).double()
    for t in (base, x_a, A, B):
        t.requires_grad_()

    def product(base, x_a, A, B):  # in float64 the copies that multiply are the parameters' values
        return LoraProduct.apply(base.clone(), x_a, A.detach(), B.detach(), A, B, 0.75)

    with torch.no_grad():
        expected = base + 0.75 * x_a @ A.t() @ B.t()
    torch.testing.assert_close(product(base, x_a, A, B), expected)
    assert torch.autograd.gradcheck(product, (base, x_a, A, B))


def test_float32_adapters_are_cast_once_per_change_and_never_read_stale():
    """On a bfloat16 model the lean layers keep their adapters' bfloat16 copies from one pass to the
    next (a step's log-prob pass and its update's micro-batches cast nothing again) and cast them
    anew once an optimizer step or a load changes the adapters: the output after the step is the
    one a layer that had never cast gives, bit for bit, and differs from the one before."""
    from peft.tuners.lora.layer import Linear
    from torch.utils._python_dispatch import TorchDispatchMode

    from ngrpo_lightning.backends import Backend

    policy = lora.apply(load_policy("tiny", dtype="bfloat16")[0], lora.LoraSettings(enabled=True, rank=4))
    Backend(dtype=torch.bfloat16).prepare(policy, trains=True)
    layers = [m for m in policy.modules() if isinstance(m, Linear)]
    ids = torch.randint(0, policy.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    adapter_sizes = {p.numel() for n, p in policy.named_parameters() if p.requires_grad}

    class Casts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten._to_copy and args[0].numel() in adapter_sizes:
                self.count += 1
            return func(*args, **(kwargs or {}))

    def forward(grad=True):
        with Casts() as casts, torch.set_grad_enabled(grad):
            logits = policy(input_ids=ids).logits
        return logits, casts.count

    first, casts = forward()
    assert casts == 2 * len(layers)
    assert first.grad_fn is not None and all(m._cast is not None for m in layers)
    first.float().logsumexp(-1).mean().backward()
    again, casts = forward(grad=False)
    assert casts == 0 and torch.equal(again, first.detach())
    torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=10.0).step()
    stepped, casts = forward(grad=False)
    assert casts == 2 * len(layers) and not torch.equal(stepped, first.detach())
    for m in layers:
        m._cast_key = None  # as if never cast
    assert torch.equal(forward(grad=False)[0], stepped)
    zero_b = {n: torch.zeros_like(p) for n, p in policy.named_parameters() if "lora_B" in n}
    policy.load_state_dict(zero_b, strict=False)
    loaded, casts = forward(grad=False)
    assert casts == 2 * len(layers)  # B loaded in place: cast again
    with lora.adapters_off(policy), torch.no_grad():
        assert torch.equal(loaded, policy(input_ids=ids).logits)  # B = 0: the base model's outputs
