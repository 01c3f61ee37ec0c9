"""The backend contract: one object decides how a run's models compute on its device.

A backend is chosen once per run (:func:`~ngrpo_lightning.backends.select_backend`, from ``trainer.accelerator``, the
model's dtype and the machine) and applied once to each model (:meth:`Backend.prepare`), swapping explicitly the
modules that compute differently (:mod:`.swap`). Every choice gives the same values, bit for bit or to float rounding,
so none is a config key: the user picks a device and a dtype, the backend picks how, measuring where the answer
depends on the machine (:mod:`.cpu`). ``describe(model)`` says, per linear layer, what was chosen and why. What every
device gets from this base class (a backend for another device subclasses it and overrides what differs):

- a trained model's RMSNorms and gated MLPs recompute cheap outputs in backward (:mod:`.recompute`; bit-identical),
  unless activation checkpointing recomputes whole layers anyway (:meth:`Backend.recomputes`);
- peft's LoRA layers with their sum done in place and a merged copy for decoding (:mod:`.lora`);
- the log-probs' LM head in chunks of ``logprob_chunk_size`` tokens, its softmax kept for backward when it fits
  ``keep_softmax_mib`` (:mod:`ngrpo_lightning.training.forward`);
- a group's common prompt run once per log-prob pass (``share_prompts``, :meth:`Backend.shares_prompts`);
- plain products, the attention transformers calls ``sdpa``, the KV cache in the model's dtype.
"""

from __future__ import annotations

import torch

from ngrpo_lightning.backends import speedups
from ngrpo_lightning.backends.freed_memory import release_freed_memory
from ngrpo_lightning.backends.lora import lean_lora_layers
from ngrpo_lightning.backends.packing import BackendLinear, Choice
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
        attention: the attention models load with (``backend.attention``; ``auto``: :attr:`default_attention`).
        decode_rows: the usual rows of a decoding step (prompts per step x group size).
        train_rows: the usual tokens of a training forward (a micro-batch's rows x length).
        packing: ``backend.packing``, for backends that choose how products are laid out (the CPU's); else ``auto``.
    """

    device_type = "cpu"
    default_attention = "sdpa"
    # LM-head tokens at once (None: all [N, L, V]): peak ~2 chunks, no faster beyond this (docs/measurements.md)
    logprob_chunk_size: int | None = 512
    # MiB of LM-head softmax a training forward keeps for backward instead of recomputing the logits there
    keep_softmax_mib: float = 512
    drop_min_frac = 0.0  # finished rows leave the decoding batch at once
    decode_checks_every = 1  # decoding steps between the host's looks at which rows ended; the same rollout
    # decode on a static KV cache (fixed shapes a CUDA graph can replay); the same tokens, log-probs to rounding
    static_decoding = False
    decode_graphs: str | None = None  # with static_decoding: "cuda" replays each step from a CUDA graph
    decode_whole_steps = True  # with decode_graphs: the whole step graphed where the explorer allows; False: model's
    ahead_threads = 1  # intra-op threads of the rollouts-ahead worker
    chooses_packing = False  # whether backend.packing means anything here
    # the speed-ups this backend applies (:mod:`.speedups`), on or off by the records and backend.disable / enable
    speedups: tuple[str, ...] = ("recompute_activations", "lean_lora", "chunked_logprobs", "shared_prompts")
    attention_speedup = ""  # the speed-up that default_attention is (none: transformers' sdpa is the default)

    def __init__(
        self,
        dtype: torch.dtype = torch.float32,
        attention: str = "auto",
        decode_rows: int = 32,
        train_rows: int = 2048,
        packing: str = "auto",
        disable=(),
        enable=(),
    ):
        packing = {True: "on", False: "off"}.get(packing, packing)  # YAML reads a bare on/off as a boolean
        if packing != "auto" and not self.chooses_packing:
            raise ValueError(f"backend.packing={packing!r} is for the CPU backend; {self.device_type} takes auto")
        self.disabled = speedups.check_names(disable, "backend.disable", self.device_type, self.speedups)
        self.enabled = speedups.check_names(enable, "backend.enable", self.device_type, self.speedups)
        self.active = speedups.active(self.speedups, self.device_type, self.disabled, self.enabled)
        self.packing = packing
        self.dtype, self.decode_rows, self.train_rows = dtype, max(1, decode_rows), max(1, train_rows)
        self.share_prompts = self.uses("shared_prompts")
        if not self.uses("chunked_logprobs"):
            self.logprob_chunk_size, self.keep_softmax_mib = None, 0
        if attention in (None, "auto"):
            attention = self.default_attention if self.uses(self.attention_speedup) else "sdpa"
        self.attention = attention

    def uses(self, name: str) -> bool:
        """Whether the speed-up registered as ``name`` is on in this backend (:mod:`.speedups`)."""
        return name in self.active

    def speedup_reasons(self) -> list[tuple[str, bool, str]]:
        """``(name, on, why)`` for each speed-up this backend applies on its device."""
        return speedups.reasons(self.speedups, self.active, self.device_type, self.disabled, self.enabled)

    @property
    def name(self) -> str:
        return getattr(type(self), "registered_name", type(self).__name__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dtype={self.dtype}, attention={self.attention})"

    # ------------------------------------------------------------ applied once per model
    def prepare(self, model: torch.nn.Module, trains: bool = False, sharded: bool = False) -> torch.nn.Module:
        """Swap ``model``'s modules for the ones this backend computes with; returns ``model``. Idempotent.
        ``trains``: it is the policy (recomputation, lean LoRA); ``sharded``: FSDP2 will shard it (plain products)."""
        if trains and not getattr(model, "is_gradient_checkpointing", False) and self.recomputes(model):
            recomputing_modules(model)
        if self.uses("lean_lora"):
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
            c = choices[id(m)]
            if m is head:  # only decoding calls it: the log-prob passes read its weight in chunks
                why = "the LM head (the chunked log-probs read its weight directly): " + c.why
                BackendLinear.swap_in(m, c.once, False, why, decode_only=True, pack_logits=c.logits)
            else:
                BackendLinear.swap_in(m, c.once, c.per_product, c.why, pack_frozen=c.frozen)
        return model

    def on_device(self, model: torch.nn.Module, reference: bool = False) -> torch.nn.Module:
        """Hook for the policy (or the frozen KL ``reference``) once on its device with its optimizer, before its
        first rollout: nothing here. Never under FSDP2, nor for a reference held in a file. Returns ``model``."""
        return model

    def linear_choices(self, layers: list[torch.nn.Linear], head=None) -> dict[int, Choice]:
        """``id(layer) -> Choice`` (what it packs, and why) for a model's plain linear layers
        (:class:`~.packing.BackendLinear`); ``head``, the LM head among them, is called by a rollout and, its weight
        read directly, by the chunked log-probs."""
        return {id(m): Choice(False, False, False, f"plain products on {self.device_type}") for m in layers}

    # ------------------------------------------------------------ what the run asks
    def recomputes(self, model: torch.nn.Module) -> bool:
        """Whether the trained ``model``'s cheap activations are recomputed in backward rather than kept
        (:mod:`.recompute`; the same values). Here wherever the speed-up is on; a GPU decides by the model's size."""
        return self.uses("recompute_activations")

    def shares_prompts(self, saved_tokens: int, layer_params: int) -> bool:
        """Whether a log-prob pass runs a group's common prompt once, leaving ``saved_tokens`` prompt tokens out of
        each layer of ``layer_params`` parameters (same values). Here ``share_prompts``; a GPU decides per pass."""
        return self.share_prompts

    def kv_cache_dtype(self, model: torch.nn.Module) -> torch.dtype | None:
        """The dtype a rollout's KV cache stores (``None``: the model's)."""
        return None

    def kv_read_width(self, model: torch.nn.Module):
        """How many positions of a growing KV cache a decoding step reads, as a function of its length (``None``:
        its length; more needs an attention that masks keys past its mask)."""
        return None

    copy_within_share: float | None = None  # share of memory all decoding copies may take (None: never)

    def decodes_sharded_on_copy(self, copy_bytes: int, device: torch.device) -> bool:
        """Whether a sharded policy decodes on a kept copy of its gathered weights (``copy_bytes`` of ``device``'s
        memory; same rollouts, :mod:`ngrpo_lightning.rollout.sharded_decoding`): within ``copy_within_share``."""
        if self.copy_within_share is None:
            return False
        memory, processes = device_memory(device)
        return copy_bytes * processes <= self.copy_within_share * memory

    def reference_in_file(self, output_dir, sharded: bool) -> bool:
        """Whether the frozen KL reference lives in a file between its passes (same values)."""
        return False

    def release_memory(self) -> None:
        """Before a step's update, and between a training forward's decoder and its LM head: freed C-library pages
        back to the system, where ``release_freed_memory`` is on (:mod:`.freed_memory`)."""
        if self.uses("release_freed_memory"):
            release_freed_memory()

    def recorded_choices(self) -> dict:
        """What this backend measured and chose on this machine, as plain data (empty: nothing measured); kept by
        checkpoints and MLflow so a resumed run decides the same (:meth:`use_recorded`) and samples the same tokens."""
        return {}

    def use_recorded(self, choices: dict) -> None:
        """Decide as :meth:`recorded_choices` recorded (before any model is prepared)."""

    def startup_notes(self) -> list[str]:
        """Lines for the run's header: what this backend chose, and warnings about the machine."""
        rows = self.speedup_reasons()
        on = [name for name, used, _ in rows if used]
        off = [name for name, used, _ in rows if not used]
        return [f"speed-ups on: {', '.join(on) or 'none'}; off: {', '.join(off) or 'none'}"]

    def summary(self) -> str:
        return f"{self.name} backend, attention {self.attention}"


def device_memory(device: torch.device) -> tuple[int, int]:
    """``(bytes, processes)``: ``device``'s memory, and how many of the run's processes share it (a GPU is one
    process's; the host's RAM, at worst, every process's)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, 1
    import psutil

    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return psutil.virtual_memory().total, torch.distributed.get_world_size() if distributed else 1
