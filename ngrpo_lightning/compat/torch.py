"""PyTorch internals the package reads, tested on torch 2.13.

- a module's own dictionaries of parameters, buffers, children and hooks, read by walks at every pass or decoding
  step (``Module.__getattr__`` and the public generators cost several Python calls each);
- a tensor's version counter and the tensor a view was made from (no public API tells either);
- ``torch._dynamo.mark_static_address``, ``torch._foreach_mul_``, FSDP2's lazy initialisation, the
  activation-checkpointing wrapper, the dispatch mode base class, the aten operators that make the host wait, and
  oneDNN's packed linear operators. Each function is one attribute read inside ``try``, free unless it fails.
"""

from __future__ import annotations

import torch

from ngrpo_lightning.compat import Library

TESTED = {"torch": ">=2.13,<2.14"}
TORCH = Library("torch", TESTED)
TORCH.warn_if_untested()

try:
    from torch.utils._python_dispatch import TorchDispatchMode  # the base of dispatch modes (no public path)
except ImportError as err:
    raise TORCH.error("torch.utils._python_dispatch.TorchDispatchMode") from err

__all__ = [
    "BOOLEAN_INDEXING",
    "CHECKPOINT_WRAPPED",
    "HOST_READS",
    "TESTED",
    "TO_COPY",
    "TorchDispatchMode",
    "apply_activation_checkpointing",
    "base_of",
    "child_modules",
    "foreach_mul_",
    "has_forward_hooks",
    "lazy_init_fsdp",
    "linear_pointwise",
    "mark_static_address",
    "own_buffers",
    "own_parameters",
    "reorder_linear_weight",
    "tensor_version",
]


# ------------------------------------------------------------------ modules
def has_forward_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has forward or forward pre-hooks of its own (global ones not counted)."""
    return bool(TORCH.attribute(module, "_forward_hooks") or TORCH.attribute(module, "_forward_pre_hooks"))


def child_modules(module: torch.nn.Module) -> dict:
    """``module``'s children by name (``None`` for an unset one), its own dictionary, to be read only."""
    return TORCH.attribute(module, "_modules")


def own_parameters(module: torch.nn.Module) -> dict:
    """``module``'s own parameters by name (``None`` for an unset one), to be read only (``register_parameter``)."""
    return TORCH.attribute(module, "_parameters")


def own_buffers(module: torch.nn.Module) -> dict:
    """``module``'s own buffers by name (``None`` for an unset one), to be read only."""
    return TORCH.attribute(module, "_buffers")


# ------------------------------------------------------------------ tensors
def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter: how many in-place writes its storage has had (shared by its views)."""
    try:
        return t._version
    except AttributeError as err:
        raise TORCH.error("Tensor._version") from err


def base_of(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of, or ``None`` when ``t`` is no view."""
    try:
        return t._base
    except AttributeError as err:
        raise TORCH.error("Tensor._base") from err


def mark_static_address(t: torch.Tensor) -> None:
    """Tell ``torch.compile`` that ``t`` keeps its address between calls (a compiled step reads it in place)."""
    try:
        mark = torch._dynamo.mark_static_address
    except AttributeError as err:
        raise TORCH.error("torch._dynamo.mark_static_address") from err
    mark(t)


def foreach_mul_(tensors: list[torch.Tensor], scale: float) -> None:
    """Multiply each of ``tensors`` in place by the Python number ``scale``, one kernel per device and dtype group."""
    try:
        mul = torch._foreach_mul_
    except AttributeError as err:
        raise TORCH.error("torch._foreach_mul_") from err
    mul(tensors, scale)


# ------------------------------------------------------------------ distributed
def lazy_init_fsdp(root: torch.nn.Module) -> None:
    """Initialise FSDP2's state of ``root`` now, making it the root (else the first forward, maybe another's)."""
    try:
        state = root._get_fsdp_state()
        init = state._lazy_init
    except AttributeError as err:
        raise TORCH.error("FSDPModule._get_fsdp_state()._lazy_init") from err
    init()


# where activation checkpointing's wrapper holds the module it wraps (torch's ``_CHECKPOINT_WRAPPED_MODULE``)
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"


def apply_activation_checkpointing(model: torch.nn.Module, check_fn) -> None:
    """Wrap the modules of ``model`` that ``check_fn`` accepts in PyTorch's activation checkpointing wrapper."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing as apply
    except ImportError as err:
        raise TORCH.error("torch.distributed.algorithms._checkpoint.checkpoint_wrapper") from err
    apply(model, check_fn=check_fn)


# ------------------------------------------------------------------ operators
def _aten(name: str):
    try:
        return getattr(torch.ops.aten, name)
    except AttributeError as err:
        raise TORCH.error(f"torch.ops.aten.{name}") from err


# Host reads and data-shaped outputs; boolean indexing (a nonzero inside); a copy (waits from an accelerator to CPU)
HOST_READS = frozenset(
    _aten(name)
    for name in (
        "_local_scalar_dense",  # .item(), bool(t), int(t), float(t)
        "nonzero",
        "masked_select",
        "unique_consecutive",
        "_unique2",
        "unique_dim",
        "repeat_interleave",  # with a tensor of repeats
        "equal",
        "is_nonzero",
    )
)
BOOLEAN_INDEXING = frozenset(_aten(name) for name in ("index", "index_put", "index_put_", "_index_put_impl_"))
TO_COPY = _aten("_to_copy")


def reorder_linear_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` [N, K] in oneDNN's blocked layout for products of about ``rows`` rows."""
    try:
        op = torch.ops.mkldnn._reorder_linear_weight
    except AttributeError as err:
        raise TORCH.error("torch.ops.mkldnn._reorder_linear_weight") from err
    return op(weight, rows)


def linear_pointwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` on oneDNN: ``weight`` [N, K] packed by :func:`reorder_linear_weight`, or plain, read as
    it lies where it is dense (contiguous, or the transpose of a contiguous tensor); ``x`` is made contiguous."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
    except AttributeError as err:
        raise TORCH.error("torch.ops.mkldnn._linear_pointwise") from err
    if not weight.is_mkldnn and not (weight.is_contiguous() or weight.t().is_contiguous()):
        weight = weight.contiguous()  # oneDNN takes any other strides, but by a path hundreds of times slower
    return op(x, weight, bias, "none", [], "")
