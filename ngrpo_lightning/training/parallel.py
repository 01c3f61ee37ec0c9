"""FSDP2 sharding of the policy and reference models (used by ``RLModule.configure_model``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ngrpo_lightning.compat.torch import apply_activation_checkpointing, foreach_mul_, lazy_init_fsdp
from ngrpo_lightning.rollout.batch import RolloutBatch
from ngrpo_lightning.training.forward import DEFAULT_KEEP_SOFTMAX_MIB, DEFAULT_LOGPROB_CHUNK, response_logprobs


@dataclass
class ParallelConfig:
    """How ``configure_model`` shards the models (``trainer.parallel.*``). ``name=fsdp2``: ``fully_shard`` on every
    decoder layer and at the root of the policy and the reference, over the strategy's data-parallel mesh."""

    name: str = "fsdp2"
    data_parallel_size: int | str = "auto"
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    mixed_precision: str = "bf16"  # bf16 (bf16 params, fp32 gradient reduction) | fp32

    def __post_init__(self):
        if self.name != "fsdp2":
            raise ValueError(f"trainer.parallel.name={self.name!r} is unknown: allowed ['fsdp2']")
        if self.mixed_precision not in ("bf16", "fp32"):
            raise ValueError(
                f"trainer.parallel.mixed_precision={self.mixed_precision!r} is unknown: allowed ['bf16', 'fp32']"
            )


class LogprobsForward(torch.nn.Module):
    """The training forward as one module call, so under FSDP2 the input embeddings are rebuilt inside the root's
    forward, where its parameters are unsharded and their gradients reduced."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self,
        batch: RolloutBatch,
        temperature: float,
        with_entropy: bool = False,
        detach_mixture: bool = False,
        chunk_size: int | None = DEFAULT_LOGPROB_CHUNK,
        keep_softmax_mib: float = DEFAULT_KEEP_SOFTMAX_MIB,
        share_prompts: bool | str = False,
        before_head=None,
    ):
        return response_logprobs(
            self.model,
            batch,
            temperature,
            with_entropy=with_entropy,
            detach_mixture=detach_mixture,
            chunk_size=chunk_size,
            keep_softmax_mib=keep_softmax_mib,
            share_prompts=share_prompts,
            before_head=before_head,
        )


def shard_fsdp2(
    models, config: ParallelConfig, mesh, checkpoint: torch.nn.Module | None = None
) -> dict[int, torch.nn.Module]:
    """``fully_shard`` every decoder layer, then a root :class:`LogprobsForward` wrapper, of each model (``None``
    skipped) over ``mesh``; activation checkpointing on ``checkpoint`` if configured. Returns roots by ``id(model)``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if config.mixed_precision == "bf16"
        else MixedPrecisionPolicy()
    )
    kw = {
        "mesh": mesh,
        "mp_policy": mp,
        "offload_policy": CPUOffloadPolicy() if config.cpu_offload else OffloadPolicy(),
    }
    roots = {}
    for model in models:
        if model is None:
            continue
        layers = decoder_layers(model)
        if config.activation_checkpointing and model is checkpoint:
            kinds = tuple({type(layer) for layer in layers})
            apply_activation_checkpointing(model, check_fn=lambda m, kinds=kinds: isinstance(m, kinds))
            layers = decoder_layers(model)
        for layer in layers:
            fully_shard(layer, **kw)
        root = LogprobsForward(model)
        fully_shard(root, **kw)
        lazy_init_fsdp(root)  # the wrapper is the root even if a rollout calls the model first
        roots[id(model)] = root
    return roots


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` that also works on FSDP2's sharded (DTensor) gradients: the total norm is that of the full
    gradient, the same on every rank."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    if math.isfinite(max_norm):
        # read once (one host wait per step); a Python number scales every dtype's gradients in float32 at least
        coef = float((max_norm / (total + 1e-6)).clamp(max=1.0))
        foreach_mul_([p.grad for p in params], coef)
    return total.detach()


def most_over_ranks(n: int, device: torch.device) -> int:
    """The largest ``n`` of all ranks: an all-reduce, which every rank enters as often (``device``: where the process
    group's backend reduces, the GPU under NCCL)."""
    count = torch.tensor([n], device=device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    return int(count.item())


def rank_share(count: float, device: torch.device) -> float:
    """``count`` x ranks / the sum of all ranks' ``count``: the factor turning this rank's mean into its part of the
    global mean once gradients are averaged. An all-reduce, entered by every rank."""
    both = torch.tensor([count, 1.0], device=device, dtype=torch.float64)
    torch.distributed.all_reduce(both)
    total, ranks = both.tolist()
    return count * ranks / total if total > 0 else 1.0


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM (``model.model.layers`` and the like; a peft model's base model's)."""
    if hasattr(model, "get_base_model"):  # LoRA adapters (model.lora): the layers hold them
        model = model.get_base_model()
    for path in ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers", "layers"):
        node = model
        for part in path.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if isinstance(node, torch.nn.ModuleList):
            return list(node)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard them")
