"""A policy FSDP2 shards decodes on a copy of its gathered weights (rollout/sharded_decoding.py)
and gives the rollouts of decoding through the policy itself: two processes on gloo, the tiny
model sharded between them, full fine-tuning and LoRA, the copy's steps replayed on the graphs'
buffers (``graphs="rerun"``, the CPU's check), and again after the weights moved."""

import os
import socket

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


def _worker(rank: int, world: int, port: int, out: str, adapters: bool, precision: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        from conftest import chat_prompt_ids
        from test_hf_engine_live_rows import QUESTIONS
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor

        from ngrpo_lightning.explorers import TopKMixExplorer
        from ngrpo_lightning.models import lora
        from ngrpo_lightning.models.loading import load_policy
        from ngrpo_lightning.rollout import HFEngine
        from ngrpo_lightning.training.parallel import ParallelConfig, shard_fsdp2

        torch.manual_seed(0)
        policy, tok = load_policy("tiny")
        if adapters:
            policy = lora.apply(policy, lora.LoraSettings(enabled=True, rank=4, alpha=8, target_modules="all-linear"))
            with torch.no_grad():  # B starts at zero: give the adapters something to merge
                for name, p in policy.named_parameters():
                    if "lora_B" in name:
                        p.normal_(std=0.05)
        Backend(torch.float32).prepare(policy, trains=True, sharded=True)
        mesh = init_device_mesh("cpu", (world,))
        root = shard_fsdp2([policy], ParallelConfig(mixed_precision=precision), mesh)[id(policy)]
        prompts = chat_prompt_ids(tok, QUESTIONS)
        through = HFEngine(policy, tok, max_new_tokens=8, seed=rank, sharded_root=root, backend=Backend(torch.float32))
        on_copy = HFEngine(
            policy, tok, max_new_tokens=8, seed=rank, sharded_root=root, backend=CopyingBackend(torch.float32),
            static_cache=True, graphs="rerun",
        )  # fmt: skip
        made, explorers = {}, {}  # one explorer per engine, as a run keeps one
        for step in range(2):
            for name, engine in (("through", through), ("copy", on_copy)):
                explorer = explorers.setdefault(name, TopKMixExplorer(k=3, rho=0.5))
                made[name, step] = engine.generate(prompts, explorer, n=2)
            kept = on_copy._copy.model
            made["addresses", step] = [p.data_ptr() for p in kept.parameters()]
            made["graphs", step] = id(on_copy._caches.graphs.get(6))
            with torch.no_grad():  # an optimizer step moves the trained weights (each rank its shards)
                for p in policy.parameters():
                    if p.requires_grad:
                        (p.to_local() if isinstance(p, DTensor) else p).mul_(1.5)
        copy = on_copy._copy.model
        made["dtype"], made["tied"] = copy.dtype, copy.lm_head.weight is copy.get_input_embeddings().weight
        made["refused"] = through._copy.refused
        torch.save(made, f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def _run(tmp_path, adapters: bool, precision: str = "fp32") -> list[dict]:
    pytest.importorskip("peft")
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), adapters, precision), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


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
            assert bool(copy.records.row.numel())  # the mixtures were recorded
            # the second time after the weights moved: a copy left as it was would give other log-probs
            assert_same_rollouts(copy, through)
        # rewritten in place, not remade: graphs recorded on the copy stay valid
        assert made["addresses", 0] == made["addresses", 1] and made["graphs", 0] == made["graphs", 1]


def test_the_copy_holds_the_weights_in_fsdp2s_compute_dtype(tmp_path):
    for made in _run(tmp_path, adapters=False, precision="bf16"):
        assert made["dtype"] == torch.bfloat16  # what FSDP2 gathers to compute with, not its float32 shards
        assert made["copy", 0].response_ids.shape[0] == 6


def test_the_cuda_backend_keeps_a_copy_only_where_it_is_a_minor_share_of_the_gpu():
    backend = CUDABackend(torch.bfloat16)
    if not torch.cuda.is_available():
        assert not backend.decodes_sharded_on_copy(1, torch.device("cpu"))  # no GPU to replay graphs on
        pytest.skip("the share of a GPU's memory needs a GPU")
    total = torch.cuda.get_device_properties(0).total_memory  # pragma: no cover - no GPU in CI
    assert backend.decodes_sharded_on_copy(total // 8, torch.device("cuda", 0))
    assert not backend.decodes_sharded_on_copy(total // 2, torch.device("cuda", 0))
    backend.decode_graphs = None  # cuda_eager: nothing to record, no copy
    assert not backend.decodes_sharded_on_copy(total // 8, torch.device("cuda", 0))
