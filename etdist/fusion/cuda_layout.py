"""A CudaKernel launch's argument list, laid out once per shape, and the repeat (hot) launch laid out from it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class _Shape:
    """What the runtime prepared for one set of sizes."""

    sizes: dict
    event_shapes: dict
    outputs: dict                      # output name -> (shape on this rank, dtype)
    fixed: dict                        # kernel arguments that stay the same from call to call
    # The argument list, laid out once (the host path of a decode-sized call is tens of us):
    template: list = field(default_factory=list)   # the fixed arguments in place, None elsewhere
    per_call: tuple = ()                           # (position, name) of inputs and outputs
    addresses: Optional[list] = None               # template with tensors as their addresses, or
                                                   # None if a fixed tensor is not 16-byte aligned

    def lay_out(self, params: list) -> None:
        self.template = [self.fixed.get(p) for p in params]
        self.per_call = tuple((i, p) for i, p in enumerate(params) if p not in self.fixed)
        flat = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in self.template]
        aligned = all(f % 16 == 0 for a, f in zip(self.template, flat) if isinstance(a, torch.Tensor))
        self.addresses = flat if aligned else None

    def args(self, values: dict) -> list:
        """The kernel's arguments: the fixed ones and this call's `values`."""
        args = self.template.copy()
        for i, name in self.per_call:
            args[i] = values[name]
        return args

    def direct_args(self, values: dict) -> Optional[list]:
        """`addresses` with this call's values filled in, for a direct launch; None where a pointer
        is not 16-byte aligned (the compiled binary assumes it)."""
        if self.addresses is None:
            return None
        flat = self.addresses.copy()
        for i, name in self.per_call:
            a = values[name]
            if isinstance(a, torch.Tensor):
                a = a.data_ptr()
                if a % 16:
                    return None
            flat[i] = a
        return flat


@dataclass
class _HotLaunch:
    """The launch a decode step repeats eagerly, laid out once per state: the inputs' names, shapes
    and dtypes and the sizes it was made for, the outputs, and Triton's C launcher with its whole
    argument list (only the inputs' and outputs' addresses change from call to call). Its calls skip
    the general path's checks of a new shape and Triton's Python dispatch (CudaKernel._launch_hot)."""

    launch: object        # the C launcher (Triton's CudaLauncher.launch)
    args: list            # its arguments: grid, stream, function, scratch, metadata, hooks, kernel args
    inputs: tuple         # ((name, shape, dtype, position in args), ...) in call order
    outputs: tuple        # ((name, shape, dtype, position in args, an input of its dtype or None), ...)
    sizes: Optional[dict]
    stream: int


class LayoutMixin:
    """CudaKernel's layout of its repeat launch (a mixin: CudaKernel._launch_hot runs it)."""

    def _hot_launch(self, st, inputs: dict, sizes, stream: int) -> Optional[_HotLaunch]:
        """The state's repeat launch (st: a cuda_state._MeshState), laid out after a call of the general
        path (None where the binary is not known yet, a pointer was not 16-byte aligned, an input is no
        tensor, or Triton asks for profiler scratch: those calls stay on the general path)."""
        k, shape = st.compiled, st.shape
        run = getattr(k, "run", None)
        if (k is None or shape.addresses is None or getattr(run, "profile_scratch_size", 1)
                or not all(isinstance(t, torch.Tensor) for t in inputs.values())):
            return None
        scratch = None
        if run.global_scratch_size:   # Triton's per-program scratch: st.scratch, sized at the first launch
            scratch = st.allocate_scratch(run.global_scratch_size * st.programs * getattr(run, "num_ctas", 1),
                                          run.global_scratch_align, stream).data_ptr()
        head = [st.programs, 1, 1, stream, k.function, run.launch_cooperative_grid, run.launch_pdl, scratch, None,
                k.packed_metadata, None, None, None]
        args = head + shape.addresses + [st.programs, True]   # NUM_PROGRAMS, USE_ASM
        at = {name: len(head) + i for i, name in shape.per_call}
        args[at["call_sig"]] = st.word
        # an output is made like an input of its dtype: Tensor.new_empty is cheaper than torch.empty's
        # keyword parsing (experiments/host_profile.py)
        like = {t.dtype: n for n, t in reversed(inputs.items())}
        return _HotLaunch(run.launch, args, tuple((n, t.shape, t.dtype, at[n]) for n, t in inputs.items()),
                          tuple((n, sh, dt, at[n], like.get(dt)) for n, (sh, dt) in shape.outputs.items()),
                          None if sizes is None else dict(sizes), stream)
