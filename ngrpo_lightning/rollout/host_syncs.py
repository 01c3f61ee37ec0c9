"""HostSyncs: which operations of some torch code make the host wait for the device.

On a GPU the host queues kernels ahead of the device. An operation whose result the host has to
read stops that queue until the device catches up: ``.item()``, ``bool(t)`` and ``int(t)``,
``nonzero``, indexing by a boolean mask, ``unique``, a copy to the CPU. Once per decoding token,
such a wait costs a few kernel launches' worth of idle device, and it forbids recording the loop
as a CUDA graph. The operations are seen in torch's dispatcher, so the check runs on the CPU too:
a test on a machine without a GPU can show that a decoding loop (or a user-written explorer)
would not wait on one.

    with HostSyncs(ignore=[model]) as syncs:  # the model's own forward left out
        engine.generate(prompts, explorer, n=4)
    print(syncs.ops)  # e.g. ['aten.nonzero', 'aten._local_scalar_dense']

``tensor.tolist()`` and ``numpy()`` read memory without the dispatcher: on a GPU tensor they go
through a copy to the CPU, which is seen; on a CPU tensor they are not.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# results the host reads, or whose shape depends on the data (the host needs it to allocate)
READS = {
    _aten._local_scalar_dense,  # .item(), bool(t), int(t), float(t)
    _aten.nonzero,
    _aten.masked_select,
    _aten.unique_consecutive,
    _aten._unique2,
    _aten.unique_dim,
    _aten.repeat_interleave,  # with a tensor of repeats
    _aten.equal,
    _aten.is_nonzero,
}
INDEXING = {_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_}  # a boolean index is a nonzero


class HostSyncs(TorchDispatchMode):
    """Record the operations that would make the host wait for the device (see the module docstring).

    Args:
        ignore: modules whose forward is left out (e.g. the model, when the code around it is
            what is checked).

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
        if packet in READS:
            return packet is not _aten.repeat_interleave or isinstance(args[0], torch.Tensor) and args[0].dim() > 0
        if packet in INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            return any(i is not None and i.dtype == torch.bool for i in indices)
        if packet is _aten._to_copy or packet is _aten.copy_:  # a copy from an accelerator to the CPU
            source = args[1] if packet is _aten.copy_ else args[0]
            target = args[0].device if packet is _aten.copy_ else kwargs.get("device")
            to_cpu = target is not None and torch.device(target).type == "cpu"
            return to_cpu and source.device.type not in ("cpu", "meta")
        return False
