"""A policy FSDP2 shards decodes on a copy of its gathered weights (rollout/sharded_decoding.py)
and gives the rollouts of decoding through the policy itself: two processes on gloo, the tiny
model sharded between them, full fine-tuning and LoRA, the copy's steps replayed on the graphs'
buffers (``graphs="rerun"``, the CPU's check), and again after the weights moved."""

import contextlib
import os
import socket
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from ngrpo_lightning.backends.base import Backend
from ngrpo_lightning.backends.cuda import CUDABackend


class CopyingBackend(Backend):
    """The base backend that decodes a sharded policy on a copy, as the CUDA backend does on a GPU."""

    def decodes_sharded_on_copy(self, copy_bytes, device):
        return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str, adapters: bool, device: str, measuring: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        from conftest import chat_prompt_ids
        from test_hf_engine_live_rows import QUESTIONS
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor

        from ngrpo_lightning.backends.base import BACKENDS
        from ngrpo_lightning.backends.cpu import CPUBackend
        from ngrpo_lightning.backends.probe import Measurements
        from ngrpo_lightning.explorers import TopKMixExplorer
        from ngrpo_lightning.models import lora
        from ngrpo_lightning.models.loading import load_policy
        from ngrpo_lightning.rollout import HFEngine
        from ngrpo_lightning.training.parallel import ParallelConfig, shard_fsdp2

        torch.manual_seed(0)
        policy, tok = load_policy("tiny")
        policy.to(device)
        if adapters:
            policy = lora.apply(policy, lora.LoraSettings(enabled=True, rank=4, alpha=8, target_modules="all-linear"))
            with torch.no_grad():  # B starts at zero: give the adapters something to merge
                for name, p in policy.named_parameters():
                    if "lora_B" in name:
                        p.normal_(std=0.05)
        # on the CPU the base backend's modules, the copy's steps on the graphs' buffers; on a GPU the
        # CUDA backend's choice (a copy: the tiny model is far under its share) and graphs recorded,
        # against its eager baseline, which decodes through the policy
        backend, eager, copying, graphs = (
            (
                BACKENDS["cuda"],
                partial(BACKENDS["cuda"], disable=["decode_graphs"]),
                partial(BACKENDS["cuda"], enable=["decoding_copy", "whole_step_graphs"]),
                None,
            )
            if device == "cuda"
            else (Backend, Backend, CopyingBackend, "rerun")
        )
        if device == "cpu" and measuring:  # the CPU backend's own choice, its products timed afresh at the copy
            copying = partial(CPUBackend, measurements=Measurements(Path(out)))
        backend(torch.float32).prepare(policy, trains=True, sharded=True)
        mesh = init_device_mesh(device, (world,))
        root = shard_fsdp2([policy], ParallelConfig(mixed_precision="fp32"), mesh)[id(policy)]
        prompts = chat_prompt_ids(tok, QUESTIONS)
        through = HFEngine(policy, tok, max_new_tokens=8, seed=rank, sharded_root=root, backend=eager(torch.float32))
        on_copy = HFEngine(
            policy, tok, max_new_tokens=8, seed=rank, sharded_root=root, backend=copying(torch.float32),
            static_cache=True, graphs=graphs,
        )  # fmt: skip
        made, explorers = {}, {}  # one explorer per engine, as a run keeps one
        for step in range(2):
            for name, engine in (("through", through), ("copy", on_copy)):
                explorer = explorers.setdefault(name, TopKMixExplorer(k=3, rho=0.5))
                # the copy is built at its first rollout, as in a run's validation: under inference mode
                validating = torch.inference_mode() if (name, step) == ("copy", 0) else contextlib.nullcontext()
                engine.policy_version = step  # as the run tells it before each rollout
                with validating:
                    made[name, step] = engine.generate(prompts, explorer, n=2)
            kept = on_copy._copy.model
            made["copy sum", step] = sum(p.double().sum().item() for p in kept.parameters())
            made["addresses", step] = [p.data_ptr() for p in kept.parameters()]
            made["graphs", step] = id(on_copy.decoding.caches.graphs.get(6))
            with torch.no_grad():  # an optimizer step moves the trained weights (each rank its shards)
                for p in policy.parameters():
                    if p.requires_grad:
                        (p.to_local() if isinstance(p, DTensor) else p).mul_(1.5)
        # the weights moved above, but the policy version did not: a rollout at version 1 (a validation's
        # next batch) gathers nothing, and the next version's rewrites the copy
        copy = on_copy._copy.model
        for version in ("same", "next"):
            on_copy.policy_version = 1 if version == "same" else 2
            on_copy.generate(prompts, explorers["copy"], n=2)
            made["copy sum", version] = sum(p.double().sum().item() for p in copy.parameters())
        # a second engine on the policy (Pass@k's beside the rollouts') decodes the same copy
        beside = HFEngine(policy, tok, max_new_tokens=8, seed=rank, sharded_root=root, backend=on_copy.backend)
        beside.policy_version = 2
        made["beside"] = beside.generate(prompts, TopKMixExplorer(k=3, rho=0.5), n=2).stats["rollout/sharded_on_copy"]
        made["shared"] = beside._copy is on_copy._copy and beside._copy.model is copy
        made["dtype"], made["tied"] = copy.dtype, copy.lm_head.weight is copy.get_input_embeddings().weight
        made["refused"] = through._copy.refused
        # the rollouts-ahead worker's copy: a plain model of the gathered weights (LoRA: of the base, gathered
        # once, with adapters of its own), written from a snapshot the training thread gathers (every rank)
        from ngrpo_lightning.rollout.worker_copy import worker_copy

        worker = worker_copy(policy, eager(torch.float32), root)
        snapshot = worker.snapshot(policy)
        made["snapshot"] = {name: tuple(t.shape) for name, t in snapshot.items()}
        worker.load(snapshot)
        for name, model, sharded in (("worker", worker.model, None), ("worker's reference", policy, root)):
            engine = HFEngine(
                model, tok, max_new_tokens=8, seed=rank, sharded_root=sharded, backend=eager(torch.float32)
            )
            made[name] = engine.generate(prompts, TopKMixExplorer(k=3, rho=0.5), n=2)
        with torch.no_grad():  # the trainer moves on: the snapshot's tensors are its own, not the policy's
            for p in policy.parameters():
                if p.requires_grad:
                    (p.to_local() if isinstance(p, DTensor) else p).mul_(1.5)
        before = sum(t.double().sum().item() for t in worker.model.parameters())
        worker.load(snapshot)
        made["worker kept its version"] = before == sum(t.double().sum().item() for t in worker.model.parameters())
        torch.save(made, f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def _run(tmp_path, adapters: bool, device: str = "cpu", measuring: bool = False) -> list[dict]:
    pytest.importorskip("peft")
    world = 2 if device == "cpu" else 1  # one GPU: FSDP2 over one process, its modules and hooks all the same
    args = (world, _free_port(), str(tmp_path), adapters, device, measuring)
    mp.spawn(_worker, args=args, nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False, map_location="cpu") for r in range(world)]


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_a_sharded_policy_decodes_on_a_copy_as_through_itself(tmp_path, adapters):
    from test_hf_engine_live_rows import assert_same_rollouts

    for made in _run(tmp_path, adapters):
        assert made["refused"]  # the base backend decodes through the policy: the baseline
        assert made["dtype"] == torch.float32  # FSDP2's compute dtype
        assert made["tied"]  # the tiny model's LM head is its embedding: one tensor in the copy too
        for step in range(2):
            copy, through = made["copy", step], made["through", step]
            assert copy.stats["rollout/graphs_whole_step"] == 1.0 and "rollout/graphs_whole_step" not in through.stats
            assert copy.stats["rollout/sharded_on_copy"] == 1.0 and through.stats["rollout/sharded_on_copy"] == 0.0
            assert bool(copy.records.row.numel())  # the mixtures were recorded
            # the second time after the weights moved: a copy left as it was would give other log-probs
            assert_same_rollouts(copy, through)
        # rewritten in place, not remade: graphs recorded on the copy stay valid
        assert made["addresses", 0] == made["addresses", 1] and made["graphs", 0] == made["graphs", 1]
        # rewritten when the policy version moved, not at a rollout of the version it holds
        assert made["copy sum", 0] != made["copy sum", 1] == made["copy sum", "same"] != made["copy sum", "next"]
        assert made["beside"] == 1.0 and made["shared"]  # one copy of the weights, not one per engine
        assert_same_rollouts(made["worker"], made["worker's reference"])
        assert made["worker kept its version"]
        # a LoRA job carries its adapters alone (whole: gathered), a full fine-tuning job every weight
        shapes = made["snapshot"]
        assert all(".lora_" in name for name in shapes) == adapters
        assert ("model.norm.weight" in shapes) != adapters
        assert all(shape[0] == 4 for name, shape in shapes.items() if "lora_A" in name)  # rank 4: not half of it


def test_the_cpu_backend_s_copy_built_under_inference_mode_times_its_products_and_decodes_alike(tmp_path):
    """A run's first rollout is its validation's, under inference mode: the copy is still a model of
    normal tensors, and the CPU backend times its products, backward included, as it builds it."""
    from test_hf_engine_live_rows import assert_same_rollouts

    for made in _run(tmp_path, adapters=False, measuring=True):
        assert any(tmp_path.glob("cpu-*.json"))  # products timed afresh
        for step in range(2):
            assert made["copy", step].stats["rollout/sharded_on_copy"] == 1.0
            assert_same_rollouts(made["copy", step], made["through", step])


def _gathered_worker(rank: int, world: int, port: int, out: str) -> None:
    """What an engine of its own loads from a sharded LoRA policy, and what a bfloat16-sharded policy's
    copy holds: two checks of the gathered weights, in one pair of processes."""
    import copy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        from conftest import chat_prompt_ids
        from test_hf_engine_live_rows import QUESTIONS
        from torch.distributed.device_mesh import init_device_mesh

        from ngrpo_lightning.explorers import TopKMixExplorer
        from ngrpo_lightning.models import lora
        from ngrpo_lightning.models.loading import load_policy
        from ngrpo_lightning.rollout import HFEngine
        from ngrpo_lightning.rollout.engine import full_named_tensors
        from ngrpo_lightning.rollout.vllm_engine import _made_outside_inference
        from ngrpo_lightning.training.parallel import ParallelConfig, shard_fsdp2

        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        policy, tok = load_policy("tiny")
        policy = lora.apply(policy, lora.LoraSettings(enabled=True, rank=4, alpha=8, target_modules="all-linear"))
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.05)
        plain = copy.deepcopy(policy)
        Backend(torch.float32).prepare(policy, trains=True, sharded=True)
        shard_fsdp2([policy], ParallelConfig(mixed_precision="fp32"), mesh)
        gathered = dict(full_named_tensors(policy))  # a collective, on every rank
        with torch.inference_mode():  # as vLLM's sync writes them, inside a validation's rollout too
            in_inference = dict(_made_outside_inference(full_named_tensors(policy)))

        # a policy FSDP2 computes with in bfloat16 (float32 shards): the copy it decodes on
        half, _ = load_policy("tiny")
        Backend(torch.float32).prepare(half, trains=True, sharded=True)
        root = shard_fsdp2([half], ParallelConfig(mixed_precision="bf16"), mesh)[id(half)]
        engine = HFEngine(
            half, tok, max_new_tokens=8, seed=rank, sharded_root=root, backend=CopyingBackend(torch.float32),
            static_cache=True, graphs="rerun",
        )  # fmt: skip
        rows = engine.generate(chat_prompt_ids(tok, QUESTIONS), TopKMixExplorer(k=3, rho=0.5), n=2).response_ids
        if rank == 0:
            saved = {"sharded": gathered, "plain": dict(full_named_tensors(plain)), "in inference mode": in_inference}
            saved |= {"bf16 copy dtype": engine._copy.model.dtype, "bf16 rows": rows.shape[0]}
            torch.save(saved, f"{out}/gathered.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def gathered(tmp_path_factory) -> dict:
    pytest.importorskip("peft")
    out = tmp_path_factory.mktemp("gathered")
    mp.spawn(_gathered_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return torch.load(out / "gathered.pt", weights_only=False)


def test_a_sharded_lora_policy_gives_an_engine_its_whole_merged_weights(gathered):
    """What an engine with weights of its own (vLLM) loads from a LoRA policy FSDP2 shards: whole
    tensors, the adapters merged, as from the same policy unsharded (they had come out as shards),
    also when the sync runs under inference mode (a run's validation; the state dict of FSDP2's
    DTensors cannot be made there: each tensor is made outside it)."""
    sharded, plain = gathered["sharded"], gathered["plain"]
    assert sharded.keys() == plain.keys() and "model.layers.0.self_attn.q_proj.weight" in sharded
    for name, tensor in sharded.items():
        assert type(tensor) is torch.Tensor, name
        torch.testing.assert_close(tensor, plain[name], msg=name)
        torch.testing.assert_close(gathered["in inference mode"][name], tensor, rtol=0, atol=0, msg=name)


def test_the_copy_holds_the_weights_in_fsdp2s_compute_dtype(gathered):
    assert gathered["bf16 copy dtype"] == torch.bfloat16  # what FSDP2 gathers to compute with, not its float32 shards
    assert gathered["bf16 rows"] == 6


def test_the_cpu_backend_keeps_a_copy_only_where_every_process_s_copy_is_a_minor_share_of_memory():
    import psutil

    from ngrpo_lightning.backends.cpu import CPUBackend

    memory = psutil.virtual_memory().total
    backend = CPUBackend(torch.float32)
    assert backend.decodes_sharded_on_copy(memory // 16, torch.device("cpu"))
    assert not backend.decodes_sharded_on_copy(memory // 4, torch.device("cpu"))
    assert not Backend(torch.float32).decodes_sharded_on_copy(1, torch.device("cpu"))  # a device nobody weighed


def test_the_cuda_backend_keeps_a_copy_only_where_it_is_a_minor_share_of_the_gpu():
    assert CUDABackend(torch.bfloat16).copy_within_share is None  # off by default until measured on a GPU
    backend = CUDABackend(torch.bfloat16, enable=["decoding_copy"])
    if not torch.cuda.is_available():
        assert not backend.decodes_sharded_on_copy(1, torch.device("cpu"))  # no GPU to replay graphs on
        pytest.skip("the share of a GPU's memory needs a GPU")
    total = torch.cuda.get_device_properties(0).total_memory  # pragma: no cover - no GPU in CI
    assert backend.decodes_sharded_on_copy(total // 8, torch.device("cuda", 0))
    assert not backend.decodes_sharded_on_copy(total // 2, torch.device("cuda", 0))
    backend.decode_graphs = None  # decode_graphs off: nothing to record, no copy
    assert not backend.decodes_sharded_on_copy(total // 8, torch.device("cuda", 0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_on_a_gpu_a_sharded_policy_decodes_on_a_copy_from_graphs(tmp_path, adapters):  # pragma: no cover - no GPU in CI
    """FSDP2 over one GPU: the CUDA backend takes the copy and replays whole steps from CUDA graphs;
    its rollouts are those of its eager baseline through the policy (float32: the copy's joined
    q|k|v product sums in another order, so log-probs agree to rounding)."""
    from test_hf_engine_live_rows import assert_same_rollouts

    (made,) = _run(tmp_path, adapters, device="cuda")
    assert made["refused"]  # decode_graphs off: through the policy
    for step in range(2):
        copy, through = made["copy", step], made["through", step]
        assert copy.stats["rollout/graphs_whole_step"] == 1.0 and copy.stats["rollout/sharded_on_copy"] == 1.0
        assert through.stats["rollout/sharded_on_copy"] == 0.0
        assert_same_rollouts(copy, through, logprob_tolerance=1e-4)
    assert made["addresses", 0] == made["addresses", 1] and made["graphs", 0] == made["graphs", 1]


def test_a_module_no_plain_copy_holds_sends_rollouts_through_the_policy(tiny, caplog):
    """A policy with a module its architecture's plain copy lacks (a wrapper, an adapter kind the copy
    cannot merge) decodes through itself, and the run says why, rather than stopping."""
    import copy

    from ngrpo_lightning.rollout.sharded_decoding import DecodeCopy

    model, _ = tiny
    policy = copy.deepcopy(model)
    built = DecodeCopy(policy, CopyingBackend(torch.float32))
    assert built._build(policy)  # an unsharded policy as its own root: every weight already whole
    assert len(built._targets) == len(list(policy.parameters()))  # the tied LM head counted once
    policy.model.extra = torch.nn.Linear(4, 4)
    refused = DecodeCopy(policy, CopyingBackend(torch.float32))
    with caplog.at_level("WARNING", logger="ngrpo_lightning.rollout.sharded_decoding"):
        assert not refused._build(policy)
    assert refused.refused and refused.model is None and "model.extra" in caplog.text
