"""The backend contract: one object decides how a run's models compute on its device.

A backend is chosen once, when a run is built (:func:`~ngrpo_lightning.backends.select_backend`,
from ``trainer.accelerator``, the model's dtype and the machine), and applied once to each model
(:meth:`Backend.prepare`): one pass over the modules that swaps, explicitly, those that compute
differently (:mod:`.swap`). Every choice it makes gives the same values, bit for bit or to float
rounding, so none of them is a config key: the user picks a device and a dtype, the backend
picks how. Where the right choice depends on the machine, a backend measures it
(:mod:`.cpu`). ``describe(model)`` says, per linear layer, what was chosen and why.

What this base class does is what every device gets:

- recomputation: a trained model's RMSNorms and gated MLPs recompute their cheap outputs in
  backward instead of keeping them (:mod:`.recompute`; bit-identical, about half of a training
  forward's kept activations), unless activation checkpointing recomputes whole layers anyway
  (a GPU's backend decides by the model's size whether the memory is worth the kernels,
  :meth:`Backend.recomputes`);
- peft's LoRA layers with their sum done in place and a merged copy for decoding (:mod:`.lora`);
- the log-probs' LM head in chunks of ``logprob_chunk_size`` tokens, its softmax kept for
  backward when it fits ``keep_softmax_mib`` (:mod:`ngrpo_lightning.training.forward`);
- a group's common prompt run once per log-prob pass (``share_prompts``; a GPU's backend decides
  per pass whether that pays, :meth:`Backend.shares_prompts`);
- plain products, the attention transformers calls ``sdpa``, the KV cache in the model's dtype.

A backend for another device subclasses it and overrides what differs there.
"""

from __future__ import annotations

import torch

from ngrpo_lightning.backends.linear import BackendLinear
from ngrpo_lightning.backends.lora import lean_lora_layers
from ngrpo_lightning.backends.recompute import recomputing_modules
from ngrpo_lightning.registry import Registry

BACKENDS = Registry("backend", key="backend.name")


def lm_head(model: torch.nn.Module) -> torch.nn.Module | None:
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def adapter_matrices(model: torch.nn.Module) -> set[int]:
    """The ids of peft's LoRA ``A`` and ``B`` layers in ``model``."""
    return {
        id(sub)
        for m in model.modules()
        for name in ("lora_A", "lora_B")
        if isinstance(getattr(m, name, None), torch.nn.ModuleDict)
        for sub in getattr(m, name).modules()
    }


class Backend:
    """How models compute on one kind of device (see the module docstring).

    Args:
        dtype: the models' dtype (``model.dtype``).
        attention: the attention implementation models load with (``backend.attention``;
            ``auto``: the backend's own choice, :attr:`default_attention`).
        decode_rows: the usual rows of a decoding step (prompts per step x group size).
        train_rows: the usual tokens of a training forward (a micro-batch's rows x length).
        packing: ``backend.packing``, for backends that choose how products are laid out
            (the CPU's); ``auto`` everywhere else.
    """

    device_type = "cpu"
    default_attention = "sdpa"
    # Tokens whose LM-head logits exist at once (None: all [N, L, V]). 512 x 151,936 float32 logits
    # are 311 MB: the chunked path peaks at about two of these, while on CPU the head's throughput is
    # flat from 256 tokens per chunk up, and a GPU is saturated well before 512 rows of d x V.
    logprob_chunk_size: int | None = 512
    # MiB of LM-head softmax a training forward keeps for its backward instead of recomputing the
    # logits there: 1,280 tokens x 49,152 float32 are 240 MiB; one 8,192-token response at
    # V = 151,936 is 4.6 GiB and recomputes, as it must.
    keep_softmax_mib: float = 512
    share_prompts = True  # a group's prompt runs once per log-prob pass (exact)
    drop_min_frac = 0.0  # finished rows leave the decoding batch at once
    # decoding steps between the host's looks at which rows ended (each look waits for the device:
    # free on a CPU, a stall of the launch queue on a GPU); the rollout is the same whatever it is
    decode_checks_every = 1
    # decode on a static KV cache (full-width mask, batch in buckets: fixed shapes a CUDA graph can
    # replay); the same tokens, log-probs up to float rounding
    static_decoding = False
    decode_graphs: str | None = None  # with static_decoding: "cuda" replays each step from a CUDA graph
    # with decode_graphs="cuda": a graph holds the whole step (the explorer and bookkeeping too) where
    # the explorer declares capturable (rollout/step_graphs.py); False: the model's step alone
    decode_whole_steps = True
    ahead_threads = 1  # intra-op threads of the rollouts-ahead worker
    chooses_packing = False  # whether backend.packing means anything here

    def __init__(
        self,
        dtype: torch.dtype = torch.float32,
        attention: str = "auto",
        decode_rows: int = 32,
        train_rows: int = 2048,
        packing: str = "auto",
    ):
        packing = {True: "on", False: "off"}.get(packing, packing)  # YAML reads a bare on/off as a boolean
        if packing != "auto" and not self.chooses_packing:
            raise ValueError(f"backend.packing={packing!r} is for the CPU backend; {self.device_type} takes auto")
        self.packing = packing
        self.dtype, self.decode_rows, self.train_rows = dtype, max(1, decode_rows), max(1, train_rows)
        self.attention = self.default_attention if attention in (None, "auto") else attention

    @property
    def name(self) -> str:
        return getattr(type(self), "registered_name", type(self).__name__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dtype={self.dtype}, attention={self.attention})"

    # ------------------------------------------------------------ applied once per model
    def prepare(self, model: torch.nn.Module, trains: bool = False, sharded: bool = False) -> torch.nn.Module:
        """Swap ``model``'s modules for the ones this backend computes with, in one pass; returns
        ``model``. ``trains``: it is the policy (recomputation, LoRA's lean layers); ``sharded``:
        FSDP2 will shard it (plain products). Idempotent: swapped modules are left as they are."""
        if trains and not getattr(model, "is_gradient_checkpointing", False) and self.recomputes(model):
            recomputing_modules(model)
        lean_lora_layers(model)
        head, adapters = lm_head(model), adapter_matrices(model)
        layers = []
        for m in model.modules():
            if type(m) is not torch.nn.Linear:  # exactly nn.Linear: subclasses may compute something else
                continue
            if id(m) in adapters:
                m.why = "a LoRA adapter matrix: rank-r products, left plain"
            elif sharded:
                m.why = "sharded by FSDP2: plain products on the gathered weight"
            else:
                layers.append(m)
        choices = self.linear_choices(layers, head)
        for m in layers:
            once, frozen, per_product, why = choices[id(m)]
            if m is head:  # only decoding calls it: the log-prob passes read its weight in chunks
                why = "the LM head (the chunked log-probs read its weight directly); decoding: " + why
                BackendLinear.swap_in(m, once, False, why, decode_only=True)
            else:
                BackendLinear.swap_in(m, once, per_product, why, pack_frozen=frozen)
        return model

    def on_device(self, model: torch.nn.Module) -> torch.nn.Module:
        """What the backend does to the policy (and to the frozen KL reference) once it sits on the
        device it trains or decodes on (Lightning has moved it, its optimizer exists), before its
        first rollout: nothing here. Never under FSDP2, nor for a reference held in a file. Returns
        ``model``."""
        return model

    def linear_choices(self, layers: list[torch.nn.Linear], head=None) -> dict[int, tuple[bool, bool, bool, str]]:
        """``id(layer) -> (pack_once, pack_frozen, pack_per_product, why)`` for the plain linear layers
        of a model: pack for a rollout, for a frozen pass, per product in training (see
        :class:`~.linear.BackendLinear`); ``head``, the LM head among them, is only called by a rollout."""
        return {id(m): (False, False, False, f"plain products on {self.device_type}") for m in layers}

    # ------------------------------------------------------------ what the run asks
    def recomputes(self, model: torch.nn.Module) -> bool:
        """Whether the trained ``model``'s cheap activations are recomputed in backward rather than
        kept (:mod:`.recompute`; the same values either way). Here always: a device where the extra
        kernels cost more than the memory saved decides by the model's size."""
        return True

    def shares_prompts(self, saved_tokens: int, layer_params: int) -> bool:
        """Whether a log-prob pass runs a group's common prompt once, where that leaves
        ``saved_tokens`` prompt tokens out of each of its layers of ``layer_params`` parameters
        (the same values either way). Here: ``share_prompts``, whatever the pass; a device where
        the second decoder pass this takes costs more than the arithmetic it saves decides per pass."""
        return self.share_prompts

    def kv_cache_dtype(self, model: torch.nn.Module) -> torch.dtype | None:
        """The dtype a rollout's KV cache stores (``None``: the model's)."""
        return None

    def kv_read_width(self, model: torch.nn.Module):
        """How many positions of a growing KV cache a decoding step reads, as a function of its
        length (``None``: its length; more needs an attention that masks keys past its mask)."""
        return None

    # A policy FSDP2 shards may decode on a copy of its gathered weights, kept between rollouts: the
    # largest share of the device's memory every process's copy together may take (None: never).
    copy_within_share: float | None = None

    def decodes_sharded_on_copy(self, copy_bytes: int, device: torch.device) -> bool:
        """Whether a policy that FSDP2 shards decodes on a copy of its gathered weights, kept between
        rollouts (``copy_bytes`` of ``device``'s memory), rather than through its own modules
        unsharded for each rollout (:mod:`ngrpo_lightning.rollout.sharded_decoding`; the same
        rollouts either way): where the copies fit ``copy_within_share`` of the device's memory."""
        if self.copy_within_share is None:
            return False
        memory, processes = device_memory(device)
        return copy_bytes * processes <= self.copy_within_share * memory

    def reference_in_file(self, output_dir, sharded: bool) -> bool:
        """Whether the frozen KL reference lives in a file between its passes (same values)."""
        return False

    def recorded_choices(self) -> dict:
        """What this backend measured and chose on this machine, as plain data: checkpoints and
        MLflow keep it, and a resumed run decides the same (:meth:`use_recorded`). Another machine's
        choices can give other float rounding and so other sampled tokens. Empty: nothing measured."""
        return {}

    def use_recorded(self, choices: dict) -> None:
        """Decide as :meth:`recorded_choices` recorded (before any model is prepared)."""

    def startup_notes(self) -> list[str]:
        """Lines for the run's header: what this backend chose, and warnings about the machine."""
        return []

    def summary(self) -> str:
        return f"{self.name} backend, attention {self.attention}"


def device_memory(device: torch.device) -> tuple[int, int]:
    """``(bytes, processes)``: ``device``'s memory, and how many of the run's processes share it (a
    GPU is one process's; the host's RAM, at worst, every process's)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, 1
    import psutil

    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return psutil.virtual_memory().total, torch.distributed.get_world_size() if distributed else 1
