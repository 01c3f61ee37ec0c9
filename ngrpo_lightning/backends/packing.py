"""The speed-up ``packed_products``, whole: products on oneDNN where this machine runs them faster.

On some CPUs and shapes oneDNN multiplies faster than ``torch.matmul`` (MKL, which on the AMD EPYC measured ran its AVX2
kernels), and faster still by a weight reordered once into its blocked layout; the same values to float rounding.
Whether it pays depends on the CPU and the shape, so the CPU backend times every distinct linear shape both ways
when a run is built (:func:`choose`), at three kinds of product, and keeps the answers per machine (:mod:`.probe`).
The linear layer the backend swaps in, :class:`BackendLinear`, then multiplies:

- **packed once for a pass**: inside :func:`~.passes.packed_for_pass` (a rollout, the frozen reference's pass), where
  weights do not change and nothing needs a backward, by one packed copy made when the pass starts and dropped when it
  ends (a file-backed reference frees each plain weight once packed); LoRA layers by their merged copy
  (:mod:`.lora`), packed when the base layer would be.
- **oneDNN per product**: in the policy's log-prob passes and update, each product, forward and backward, on
  oneDNN with its operands as they lie (:class:`PackedLinearFunction`): no reorder or transposed copy of its own.
- otherwise plain ``F.linear``.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch

from ngrpo_lightning.backends.probe import faster
from ngrpo_lightning.compat.torch import has_forward_hooks, linear_pointwise, reorder_linear_weight

log = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
MARGIN = 0.97  # packed is taken where it takes at most this share of the plain product's time
# A training product's relative speed settles by about a thousand rows: larger passes are timed at this many
TRAIN_ROWS_TIMED = 1024


@functools.cache
def packing_available(dtype: torch.dtype) -> bool:
    """Whether this build packs ``dtype`` weights and multiplies by a transposed view, each product agreeing with
    ``F.linear``."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, x = torch.randn(24, 16).to(dtype), torch.randn(3, 16).to(dtype)
        ways = (packed_linear(x, pack(weight, 3)), linear_pointwise(x, weight.t().contiguous().t(), None))
        return all(torch.allclose(y.float(), (x @ weight.t()).float(), rtol=1e-2, atol=1e-2) for y in ways)
    except (RuntimeError, AttributeError) as err:  # no such op in this build, or not for this dtype
        log.debug("no packed linear weights for %s: %s", dtype, err)
        return False


def pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` [N, K] in oneDNN's blocked layout, for products of about ``rows`` rows."""
    return reorder_linear_weight(weight, max(1, rows))


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` on a weight :func:`pack` made."""
    return linear_pointwise(x, packed, bias)


class PackedLinearFunction(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` with every product, forward and backward, on oneDNN: the weight and the
    backward's transposed operands handed over as they lie (strided views), oneDNN packing blocks as it multiplies.
    An explicit reorder and a transposed copy per product cost more than they save at a training pass's rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        ctx.has_bias = bias is not None
        y = linear_pointwise(x, weight.detach(), None if bias is None else bias.detach())
        return y.detach()  # not a view of oneDNN's flat output: LoRA's layer adds to it in place

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = linear_pointwise(grad, weight.detach().t(), None)  # grad @ W
        if ctx.needs_input_grad[1]:
            grad_w = linear_pointwise(grad2.t(), x.reshape(-1, x.shape[-1]).t(), None)  # grad^T @ x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad2.sum(0)
        return grad_x, grad_w, grad_b


class BackendLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose products the backend chose when it swapped the layer in. ``pack_once``: in a rollout
    (:func:`~.passes.packed_for_pass` decoding) multiply by one packed copy of the weight; ``pack_frozen``: the same in
    a frozen pass (the reference's log-probs); ``pack_per_product``: elsewhere, every product on oneDNN, forward and
    backward (:class:`PackedLinearFunction`). Otherwise ``F.linear``. ``why`` says why, in words."""

    prefix = "Backend"
    pack_once: bool = False
    pack_frozen: bool = False
    pack_per_product: bool = False
    # the LM head: packed for rollouts only (log-prob passes read its weight directly; a file never releases it)
    decode_only: bool = False
    # the LM head: the chunked log-probs run its products, forward and backward, on oneDNN (training.forward)
    pack_logits: bool = False
    why: str = ""
    _pass_weight: torch.Tensor | None = None  # the packed copy, inside a pass
    _in_pass: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._pass_weight is not None:
            return packed_linear(x, self._pass_weight, None if self.bias is None else self.bias.detach())
        if self.pack_per_product and not self._in_pass:
            return PackedLinearFunction.apply(x, self.weight, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def end_pass(self) -> None:
        self._pass_weight, self._in_pass = None, False

    @classmethod
    def swap_in(
        cls,
        layer: torch.nn.Linear,
        pack_once: bool,
        pack_per_product: bool,
        why: str,
        decode_only: bool = False,
        pack_frozen: bool | None = None,
        pack_logits: bool = False,
    ) -> BackendLinear:
        """Make the plain linear ``layer`` a :class:`BackendLinear` (``pack_frozen`` defaults to ``pack_once``)."""
        layer.__class__ = cls
        layer.pack_once, layer.pack_per_product, layer.why = pack_once, pack_per_product, why
        layer.pack_frozen = (pack_once if pack_frozen is None else pack_frozen) and not decode_only
        layer.decode_only, layer.pack_logits = decode_only, pack_logits and decode_only
        return layer


def plain_linear(layer: torch.nn.Module, every_pass: bool = False) -> bool:
    """Whether ``layer``'s forward is ``F.linear(x, layer.weight, layer.bias)`` and nothing else: an ``nn.Linear``
    without hooks, or a :class:`BackendLinear` multiplying by its weight as stored in the pass under way or, with
    ``every_pass``, in every pass (not packed for a rollout either)."""
    if not isinstance(layer, torch.nn.Linear) or has_forward_hooks(layer):
        return False
    forward = type(layer).forward
    if forward is BackendLinear.forward:
        packs_now = layer._pass_weight is not None or (layer.pack_per_product and not layer._in_pass)
        return not (packs_now or (every_pass and (layer.pack_once or layer.pack_per_product)))
    return forward is torch.nn.Linear.forward


# ---------------------------------------------------------------- which products pack, measured per machine and shape
def rows_bucket(rows: int) -> int:
    """Rows rounded up to a power of two: one measurement serves nearby batch sizes."""
    return 1 << max(0, int(rows) - 1).bit_length()


def operands(out_features: int, in_features: int, dtype: torch.dtype, rows: int, grad: bool = False) -> tuple:
    """A seeded weight [out, in] and input [rows, in] of ``dtype`` (and with ``grad`` an output gradient) to time."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(out_features, in_features), (rows, in_features)] + [(rows, out_features)] * grad
    return tuple(torch.randn(shape, generator=gen).to(dtype) for shape in shapes)


def measure_decode(out_features: int, in_features: int, dtype: torch.dtype, rows: int) -> dict:
    """A decoding step's product of ``rows`` rows (no autograd): plain against one packed copy. A frozen pass's
    product is the same at its own rows."""
    weight, x = operands(out_features, in_features, dtype, rows)
    packed = pack(weight, rows)
    with torch.inference_mode():
        t = faster(lambda: torch.nn.functional.linear(x, weight), lambda: packed_linear(x, packed))
    return {"plain_s": t["a_s"], "packed_s": t["b_s"]}


def measure_train(out_features: int, in_features: int, dtype: torch.dtype, rows: int) -> dict:
    """A training forward and backward of ``rows`` rows: plain against oneDNN per product."""
    weight, x, grad = operands(out_features, in_features, dtype, rows, grad=True)
    weight.requires_grad_(), x.requires_grad_()

    def run(product):
        def step():
            y = product(x, weight, None)
            torch.autograd.grad(y, (x, weight), grad)

        return step

    t = faster(run(torch.nn.functional.linear), run(PackedLinearFunction.apply), rounds=2, budget_s=0.04)
    return {"plain_s": t["a_s"], "packed_s": t["b_s"]}


class Choice(NamedTuple):
    """What a layer packs: decoding (``once``), a frozen pass, training per product, and for the LM head its
    log-prob products (``logits``); ``why`` says so in words."""

    once: bool
    frozen: bool
    per_product: bool
    why: str
    logits: bool = False


WEIGHT_GRAD_SLICE = 4096  # rows of the head's weight gradient at a time: never a second [V, d] buffer


def add_head_weight_grad(total: torch.Tensor | None, dz: torch.Tensor, h: torch.Tensor, acc: torch.dtype):
    """``total + dz^T @ h`` ([V, d] in ``acc``; ``None``: this chunk's alone) on oneDNN, a slice of V at a time: the
    LM head's weight gradient as the chunked log-probs sum it (``training.forward``)."""
    first = total is None
    if first:
        total = torch.empty(dz.shape[1], h.shape[1], dtype=acc, device=dz.device)
    for start in range(0, dz.shape[1], WEIGHT_GRAD_SLICE):
        rows = slice(start, start + WEIGHT_GRAD_SLICE)
        part = linear_pointwise(dz[:, rows].t(), h.t(), None)
        total[rows].copy_(part) if first else total[rows].add_(part)
    return total


def measure_logits(out_features: int, in_features: int, dtype: torch.dtype, rows: int) -> dict:
    """The LM head's products for a chunk of ``rows`` tokens, the logits and both gradients: plain against oneDNN."""
    weight, x, dz = operands(out_features, in_features, dtype, rows, grad=True)

    def plain():
        return torch.nn.functional.linear(x, weight), dz @ weight, dz.t() @ x

    def onednn():  # as the run computes them, the head's weight read as it lies
        add_head_weight_grad(None, dz, x, dtype)
        return linear_pointwise(x, weight, None), linear_pointwise(dz, weight.t(), None)

    with torch.inference_mode():
        t = faster(plain, onednn)
    return {"plain_s": t["a_s"], "packed_s": t["b_s"]}


def choose(
    answers, n: int, k: int, dtype: torch.dtype, decode_rows: int, train_rows: int, head_rows: int | None = None
) -> Choice:
    """What an ``[n, k]`` weight of ``dtype`` packs, each kind of product packed where it takes at most
    :data:`MARGIN` of the plain time: decoding ``decode_rows`` rows, a frozen pass and a training forward and
    backward of ``train_rows`` (rows bucketed to powers of two). ``answers.get(key, measure)`` reads a kept answer
    or measures it (:class:`~.probe.Measurements`). ``head_rows``: the weight is the LM head, which a rollout calls
    and the chunked log-probs multiply ``head_rows`` tokens at a time (``0``: not chunked)."""
    name = str(dtype).removeprefix("torch.")

    def say(what: str, rows: int, r: dict) -> tuple[bool, str]:
        packed = r["packed_s"] <= MARGIN * r["plain_s"]
        return packed, f"{what} {rows} rows {'packed' if packed else 'plain'} ({r['packed_s'] / r['plain_s']:.2f}x)"

    decode_rows, train_rows = rows_bucket(decode_rows), min(rows_bucket(train_rows), TRAIN_ROWS_TIMED)
    measured = f"{n}x{k} {name}, measured on this CPU (packed time / plain time): "
    d = answers.get(f"decode:{name}:{n}x{k}:{decode_rows}", lambda: measure_decode(n, k, dtype, decode_rows))
    once, said = say("decoding", decode_rows, d)
    if head_rows is not None:
        if not head_rows:
            return Choice(once, False, False, measured + said)
        rows = rows_bucket(head_rows)
        key = f"logits-and-grads:{name}:{n}x{k}:{rows}"  # apart from answers that timed the logits alone
        r = answers.get(key, lambda: measure_logits(n, k, dtype, rows))
        logits, said_logits = say("log-prob chunks", rows, r)
        return Choice(once, False, False, measured + said + ", " + said_logits, logits)
    f = answers.get(f"frozen:{name}:{n}x{k}:{train_rows}", lambda: measure_decode(n, k, dtype, train_rows))
    # keyed apart from answers kept when each training product packed its operands first (slower: not comparable)
    t = answers.get(f"train-onednn:{name}:{n}x{k}:{train_rows}", lambda: measure_train(n, k, dtype, train_rows))
    (frozen, said_f), (per_product, said_t) = (
        say("frozen pass", train_rows, f),
        say("training per product", train_rows, t),
    )
    return Choice(once, frozen, per_product, measured + ", ".join((said, said_f, said_t)))
