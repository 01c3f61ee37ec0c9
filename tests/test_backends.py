"""Backends (``ngrpo_lightning/backends/``): a run's models are swapped once, by class, and say why
(``describe``); the CPU backend's measured choices are kept per machine and shape; packed and
plain products give the same log-probs and rollouts; ``sdpa_gqa`` is registered by the backend
that chooses it, never at import."""

import copy
import os
import subprocess
import sys

import pytest
import torch
from conftest import chat_prompt_ids

from ngrpo_lightning.backends import CPUBackend, describe
from ngrpo_lightning.backends.lora import LeanLoraLinear
from ngrpo_lightning.backends.packing import BackendLinear, packing_available
from ngrpo_lightning.backends.passes import packed_for_pass
from ngrpo_lightning.backends.probe import Measurements
from ngrpo_lightning.backends.recompute import RecomputingGatedMLP, RecomputingRMSNorm
from ngrpo_lightning.build.components import build_module
from ngrpo_lightning.config import compose
from ngrpo_lightning.explorers import TemperatureExplorer
from ngrpo_lightning.models.loading import load_policy
from ngrpo_lightning.rollout import HFEngine
from ngrpo_lightning.training.forward import response_logprobs, split_lm_head

QUESTIONS = ["What is 7 + 5?", "What is 3 * 4?", "Name a prime number larger than ten."]


def built(tmp_path, *overrides):
    """The module a run builds (``build_module``) for the tiny model."""
    return build_module(
        compose(["model=tiny", "trainer.max_steps=1", "logger=none", f"output_dir={tmp_path}/run", *overrides])
    )


def print_described(model):
    for name, cls, why in describe(model):
        print(f"{name:60s} {cls:16s} {why}")


def assert_no_patched_forward(model):
    patched = [name for name, m in model.named_modules() if "forward" in vars(m)]
    assert not patched, patched


def test_a_run_s_models_are_swapped_by_class_and_say_why(tmp_path, tiny):
    assert {why for _, _, why in describe(tiny[0])} == {"no backend has prepared this model"}
    module = built(tmp_path)
    policy = module.policy
    print_described(policy)
    rows = describe(policy)
    modules = dict(policy.named_modules())
    head = policy.get_output_embeddings()
    layers = policy.config.num_hidden_layers
    decoder = [row for row in rows if modules[row[0]] is not head]
    assert len(decoder) == 7 * layers and len(rows) == len(decoder) + 1  # q k v o gate up down, and the head
    for name, cls, why in decoder:
        assert cls == "BackendLinear" and type(modules[name]) is BackendLinear and why, name
    (head_row,) = [row for row in rows if modules[row[0]] is head]
    # the head packs for decoding only: the log-prob passes read its weight in chunks
    assert head_row[1] == "BackendLinear" and head.decode_only and not head.pack_per_product
    assert "LM head" in head_row[2]
    assert split_lm_head(policy) == (policy.model, head)  # still the chunked log-probs' head
    assert_no_patched_forward(policy)
    # the trained policy recomputes its cheap activations; it loaded with the backend's attention
    assert isinstance(policy.model.norm, RecomputingRMSNorm)
    assert all(isinstance(layer.mlp, RecomputingGatedMLP) for layer in policy.model.layers)
    for name, cls, why in describe(policy, kinds=(RecomputingRMSNorm, RecomputingGatedMLP)):
        assert cls.startswith("Recomputing") and "recomputed in backward" in why, name
    assert policy.config._attn_implementation == module.backend.attention == "sdpa_gqa"
    assert module.reference is not None  # grpo's KL reference: swapped the same way, never recomputing
    assert [(n, c) for n, c, _ in describe(module.reference)] == [(n, c) for n, c, _ in rows]
    assert not any(isinstance(m, (RecomputingRMSNorm, RecomputingGatedMLP)) for m in module.reference.modules())
    assert_no_patched_forward(module.reference)


def test_a_lora_run_swaps_peft_s_layers_and_leaves_the_adapter_matrices_plain(tmp_path):
    peft = pytest.importorskip("peft")

    module = built(tmp_path, "model.lora.enabled=true")
    policy = module.policy
    print_described(policy)
    adapted = {name: m for name, m in policy.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert len(adapted) == 7 * policy.config.num_hidden_layers
    for name, cls, why in describe(policy, kinds=(peft.tuners.lora.LoraLayer,)):
        assert isinstance(adapted[name], LeanLoraLinear) and cls == "LeanLinear" and "LoRA" in why, name
    modules = dict(policy.named_modules())
    adapters = [row for row in describe(policy) if ".lora_A." in row[0] or ".lora_B." in row[0]]
    assert len(adapters) == 2 * len(adapted)
    for name, cls, why in adapters:
        assert cls == "Linear" and type(modules[name]) is torch.nn.Linear and "LoRA adapter matrix" in why, name
    bases = [row for row in describe(policy) if row[0].endswith(".base_layer")]
    assert len(bases) == len(adapted) and all(cls == "BackendLinear" and why for _, cls, why in bases)
    assert module.reference is None  # the policy with its adapters off
    assert_no_patched_forward(policy)


def test_the_cpu_backend_measures_once_per_machine_and_shape(tmp_path):
    if not packing_available(torch.float32):
        pytest.skip("no oneDNN packing here: nothing to measure")
    first = Measurements(tmp_path)
    a, _ = load_policy("tiny")
    CPUBackend(torch.float32, measurements=first).prepare(a, trains=True)
    assert first.measured > 0 and first.path.exists()
    assert all("measured on this CPU" in why for _, cls, why in describe(a) if cls == "BackendLinear")

    second = Measurements(tmp_path)  # another run on the same machine: the answers are read back
    b, _ = load_policy("tiny")
    CPUBackend(torch.float32, measurements=second).prepare(b, trains=True)
    assert second.measured == 0
    assert describe(b) == describe(a)  # the same choices, for the same reasons
    choices = [(m.pack_once, m.pack_per_product) for m in a.modules() if isinstance(m, BackendLinear)]
    assert choices == [(m.pack_once, m.pack_per_product) for m in b.modules() if isinstance(m, BackendLinear)]


@pytest.fixture
def measured_tiny(tmp_path):
    """The tiny policy prepared by a CPU backend that measured this machine into ``tmp_path``: (model, backend)."""
    if not packing_available(torch.float32):
        pytest.skip("no oneDNN packing here: nothing to measure")
    model, _ = load_policy("tiny")
    backend = CPUBackend(torch.float32, measurements=Measurements(tmp_path))
    backend.prepare(model, trains=True)
    return model, backend


def test_the_run_header_counts_the_shapes_as_the_swapped_layers_compute_them(measured_tiny):
    """The header's line on oneDNN products agrees with the layers the backend swapped in: per distinct
    shape, how many pack for decoding and for frozen passes and run training on oneDNN, and whether
    the LM head's log-prob products do; the head is not counted among the shapes."""
    model, backend = measured_tiny
    head = model.get_output_embeddings()
    shapes = {tuple(m.weight.shape): m for m in model.modules() if isinstance(m, BackendLinear) and m is not head}
    count = lambda flag: sum(getattr(m, flag) for m in shapes.values())
    total = len(shapes)
    (line,) = [n for n in backend.startup_notes() if n.startswith("oneDNN products")]
    expected = (
        f"decoding {count('pack_once')}/{total} shapes packed, frozen passes {count('pack_frozen')}/{total} "
        f"packed, training {count('pack_per_product')}/{total}; the LM head's log-prob products "
        + ("on oneDNN" if head.pack_logits else "plain")
    )
    assert line.endswith(expected), (line, expected)
    assert CPUBackend(torch.float32, packing="off").startup_notes() == backend.startup_notes()[:-1]


def test_each_kind_of_product_packs_only_where_its_own_answer_says_packed_is_faster():
    """``packing.choose`` on given answers: each of decoding, a frozen pass and training follows its
    own measurement, at the margin; rows are bucketed to powers of two (training at most 1,024);
    the LM head is judged on decoding and on its log-prob chunks alone."""
    from ngrpo_lightning.backends.packing import MARGIN, TRAIN_ROWS_TIMED, choose

    class Answers(dict):
        def get(self, key, measure):
            self.asked = [*getattr(self, "asked", []), key]
            return self[key]

    answers = Answers(
        {
            "decode:float32:96x64:32": {"plain_s": 1.0, "packed_s": MARGIN},  # at the margin: packed
            "frozen:float32:96x64:1024": {"plain_s": 1.0, "packed_s": MARGIN + 0.01},  # just above it: plain
            "train-onednn:float32:96x64:1024": {"plain_s": 1.0, "packed_s": 0.5},
            "logits-and-grads:float32:96x64:512": {"plain_s": 1.0, "packed_s": 0.5},
        }
    )
    choice = choose(answers, 96, 64, torch.float32, 20, 5000)
    assert choice[:3] == (True, False, True) and not choice.logits
    assert answers.asked == [*answers][:3] and TRAIN_ROWS_TIMED == 1024
    assert "decoding 32 rows packed" in choice.why and "frozen pass 1024 rows plain" in choice.why
    answers.asked = []
    head = choose(answers, 96, 64, torch.float32, 17, 5000, head_rows=300)
    assert head == (True, False, False, head.why, True) and "log-prob chunks 512 rows packed" in head.why
    assert answers.asked == ["decode:float32:96x64:32", "logits-and-grads:float32:96x64:512"]
    assert not choose(answers, 96, 64, torch.float32, 17, 5000, head_rows=0).logits  # not chunked: nothing to pack


def test_the_cpu_backend_packs_the_head_s_log_prob_chunks_only_where_packed_logits_is_on(tiny):
    from ngrpo_lightning.backends.packing import BackendLinear

    if not packing_available(torch.float32):
        pytest.skip("no oneDNN packing here")
    for switch, expected in (({"enable": ["packed_logits"]}, True), ({"disable": ["packed_logits"]}, False)):
        model = copy.deepcopy(tiny[0])
        CPUBackend(torch.float32, packing="on", **switch).prepare(model, trains=True)
        head = model.get_output_embeddings()
        assert isinstance(head, BackendLinear) and head.pack_logits is expected
        assert all(not m.pack_logits for m in model.modules() if isinstance(m, BackendLinear) and m is not head)


def test_a_run_records_its_choices_and_a_resumed_run_makes_the_same_ones_without_measuring(measured_tiny, tmp_path):
    """What the backend measured is recorded as data (checkpoints and MLflow keep it); a backend
    given that record decides from it, measuring nothing, whatever this machine would measure now."""
    _, first = measured_tiny
    record = first.recorded_choices()
    assert record["packing"] == "auto" and record["measured"]
    # another machine's record: every product faster packed, whatever this one measures
    other = {key: {**answer, "packed_s": 0.0} for key, answer in record["measured"].items()}
    resumed = CPUBackend(torch.float32, measurements=Measurements(tmp_path / "elsewhere"))
    resumed.use_recorded({"packing": "auto", "measured": other})
    b, _ = load_policy("tiny")
    resumed.prepare(b, trains=True)
    assert resumed.measurements.measured == 0 and not (tmp_path / "elsewhere").exists()
    swapped = [m for m in b.modules() if isinstance(m, BackendLinear)]
    assert swapped and all(m.pack_once for m in swapped)
    assert resumed.recorded_choices()["measured"] == other  # and it records them again


@pytest.mark.skipif(not packing_available(torch.float32), reason="this CPU build has no oneDNN packing")
def test_packed_and_plain_products_give_the_same_log_probs_and_rollouts(tiny):
    model, tok = tiny
    on = CPUBackend(torch.float32, packing="on").prepare(copy.deepcopy(model), trains=True)
    off = CPUBackend(torch.float32, packing="off").prepare(copy.deepcopy(model), trains=True)
    swapped = [m for m in on.modules() if isinstance(m, BackendLinear)]
    assert all(m.pack_once and m.pack_per_product != m.decode_only for m in swapped)  # the head: decoding only
    assert not any(m.pack_once or m.pack_per_product for m in off.modules() if isinstance(m, BackendLinear))
    prompts = chat_prompt_ids(tok, QUESTIONS)
    greedy = TemperatureExplorer(0.0)
    rollouts = [HFEngine(m, tok, max_new_tokens=12, seed=0).generate(prompts, greedy, n=2) for m in (on, off)]
    assert torch.equal(rollouts[0].response_ids, rollouts[1].response_ids)
    assert torch.equal(rollouts[0].response_mask, rollouts[1].response_mask)
    torch.testing.assert_close(rollouts[0].rollout_logprobs, rollouts[1].rollout_logprobs, rtol=0, atol=1e-4)

    batch = rollouts[1]
    with torch.no_grad():
        plain, _ = response_logprobs(off, batch)
        per_product, _ = response_logprobs(on, batch)  # the policy's passes: packed per product
        with packed_for_pass(on, rows=len(batch)):  # the frozen reference's pass: packed once
            once, _ = response_logprobs(on, batch)
    mask = batch.response_mask.bool()
    assert plain[mask].abs().min() > 0
    torch.testing.assert_close(per_product, plain, rtol=0, atol=1e-4)
    torch.testing.assert_close(once, plain, rtol=0, atol=1e-4)
    torch.testing.assert_close(plain[mask], batch.rollout_logprobs[mask], rtol=0, atol=1e-4)


REGISTERED = """
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

def known():
    return "sdpa_gqa" in AttentionInterface._global_mapping, "sdpa_gqa" in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping

import ngrpo_lightning.backends.attention as attention
print(known())
import ngrpo_lightning.backends, ngrpo_lightning.models.loading  # noqa: E401
print(known())
attention.register()
print(known())
attention.register()  # idempotent
print(known())
"""


def test_sdpa_gqa_is_registered_by_register_not_at_import():
    out = subprocess.run([sys.executable, "-c", REGISTERED], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["(False,", "False)"] * 2 + ["(True,", "True)"] * 2, out.stdout + out.stderr


def test_half_precision_on_a_cpu_without_fast_half_products_is_warned_with_the_measured_rates():
    """Restricted to AVX2 (no native bfloat16 products), the CPU backend warns at start-up, naming
    both rates it measured; in float32 it has nothing to warn about."""
    code = (
        "import torch\n"
        "from ngrpo_lightning.backends import CPUBackend\n"
        "print(CPUBackend(torch.bfloat16).startup_notes())\n"
        "print(CPUBackend(torch.float32).startup_notes())\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    half, single = proc.stdout.strip().splitlines()[-2:]
    assert "warning: model.dtype=bfloat16" in half and "GFLOP/s against" in half and "float32 is faster" in half
    assert "warning" not in single and "speed-ups on:" in single


def test_a_gpu_run_decodes_from_cuda_graphs_and_the_alternatives_are_selected_by_name():
    from ngrpo_lightning.backends import select_backend
    from ngrpo_lightning.backends.cuda import CUDABackend, CUDACompileBackend

    backend = select_backend("auto", torch.bfloat16, "gpu")  # chosen, not run: no GPU needed
    assert type(backend) is CUDABackend and backend.static_decoding and backend.decode_graphs == "cuda"
    # whole steps are off until measured on a GPU (backends/speedups.py)
    assert backend.summary().endswith("the model's step from CUDA graphs") and not backend.decode_whole_steps
    whole = select_backend("auto", torch.bfloat16, "gpu", enable=["whole_step_graphs"])
    assert whole.decode_whole_steps and whole.summary().endswith("decoding whole steps from CUDA graphs")
    eager = select_backend("auto", torch.bfloat16, "gpu", disable=["decode_graphs"])
    assert not eager.static_decoding and eager.decode_graphs is None
    compiled = select_backend("cuda_compile", torch.bfloat16, "gpu")
    assert isinstance(compiled, CUDACompileBackend) and compiled.static_decoding and compiled.decode_graphs == "compile"
    with pytest.raises(ValueError, match=r"computes on cuda, and this run on cpu .*allowed auto or \['cpu'\]"):
        select_backend("cuda_compile", torch.float32, "cpu")


def test_under_fsdp2_the_cuda_backend_says_how_rollouts_decode(tiny):
    """A sharded policy decodes on a copy of its gathered weights where it fits the GPU, else through
    itself (rollout/sharded_decoding.py, tests/test_sharded_decoding.py): the run's header says so,
    once, for the policy. Prepared on the CPU: the decoding settings stay those of one GPU."""
    from ngrpo_lightning.backends.cuda import CUDABackend

    model, _ = tiny
    backend = CUDABackend(torch.float32, enable=["decoding_copy"])  # off by default until measured on a GPU
    notes = backend.startup_notes()
    backend.prepare(copy.deepcopy(model), sharded=True)  # the reference: nothing to say
    assert backend.startup_notes() == notes
    backend.prepare(copy.deepcopy(model), trains=True, sharded=True)
    assert backend.static_decoding and backend.decode_graphs == "cuda"  # the copy decodes as on one GPU
    (note,) = backend.startup_notes()[len(notes) :]
    assert "under FSDP2 rollouts decode on a copy" in note and "25% of the GPU" in note and "eagerly" in note
    assert CUDABackend(torch.float32).static_decoding  # the class is untouched
