"""HostSyncs: which operations of some torch code make the host wait for the device.

An operation whose result the host reads (``.item()``, ``bool(t)``, ``int(t)``, ``nonzero``, boolean indexing,
``unique``, a copy to the CPU) stops a GPU's queue; once per decoding token it idles the device and forbids a CUDA
graph. The operations are seen in torch's dispatcher, so the check runs on a CPU too.

    with HostSyncs(ignore=[model]) as syncs:  # the model's own forward left out
        engine.generate(prompts, explorer, n=4)
    print(syncs.ops)  # e.g. ['aten.nonzero', 'aten._local_scalar_dense']

``tolist()`` and ``numpy()`` read memory without the dispatcher: seen on a GPU tensor (a copy), not on a CPU one.
"""

from __future__ import annotations

import torch

from ngrpo_lightning.compat.torch import BOOLEAN_INDEXING, HOST_READS, TO_COPY, TorchDispatchMode

_aten = torch.ops.aten


class HostSyncs(TorchDispatchMode):
    """Record the operations that would make the host wait for the device (see the module docstring).

    Args:
        ignore: modules whose forward is left out (e.g. the model, when the code around it is checked).

    Attributes:
        ops: the names of the operations seen, in order, one entry per call.
        ignored_ops: the same, of the operations inside the ``ignore`` modules' forwards.
    """

    def __init__(self, ignore=()):
        super().__init__()
        self.ops: list[str] = []
        self.ignored_ops: list[str] = []
        self._inside = 0
        self._hooks = []
        for module in ignore:
            self._hooks.append(module.register_forward_pre_hook(self._enter))
            self._hooks.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, *_):
        self._inside += 1

    def _leave(self, *_):
        self._inside -= 1

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._waits(func, args, kwargs):
            (self.ignored_ops if self._inside else self.ops).append(str(func.overloadpacket))
        return func(*args, **kwargs)

    @staticmethod
    def _waits(func, args, kwargs) -> bool:
        packet = func.overloadpacket
        if packet in HOST_READS:  # read by the host, or a result shaped by the data
            return packet is not _aten.repeat_interleave or isinstance(args[0], torch.Tensor) and args[0].dim() > 0
        if packet in BOOLEAN_INDEXING:  # a boolean index is a nonzero
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            return any(i is not None and i.dtype == torch.bool for i in indices)
        if packet is TO_COPY or packet is _aten.copy_:  # a copy from an accelerator to the CPU
            source = args[1] if packet is _aten.copy_ else args[0]
            target = args[0].device if packet is _aten.copy_ else kwargs.get("device")
            to_cpu = target is not None and torch.device(target).type == "cpu"
            return to_cpu and source.device.type not in ("cpu", "meta")
        return False
