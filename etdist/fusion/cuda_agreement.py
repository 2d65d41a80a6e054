"""Binding a CudaKernel call (its inputs, out= and sizes checked) and agreeing on it with every rank (mesh/calls.py)."""
from __future__ import annotations

import math
from typing import Mapping, Optional

import torch

from ..mesh.calls import Signature
from ..mesh.control import ControlLayout
from .bind import bind_inputs
from .codegen_triton import ERR_WORDS, ArenaLayout
from .errors import GraphError, InputError
from .expr import RANK_NAME, WORLD_NAME, evaluate
from .ir import Role

INT32_MAX = 2**31 - 1


def post_refusal(mesh, kernels=(), reason: str = "its inputs were refused") -> None:
    """This rank refused a call (an op's own argument checks, before choosing a kernel): publish it
    as this rank's call (mesh/calls.py, CallAgreement.refuse), so the peers' launch of that call
    runs nothing and every rank raises, instead of their launch pairing with our next call.
    `kernels` is kept for callers that name the op's kernels; the refusal covers every kernel."""
    calls = getattr(mesh, "calls", None)
    if calls is not None:
        calls.refuse(reason)


def control_block(mesh) -> tuple:
    """The mesh's control block, its peer table and its call-error words, which every launch's call
    agreement uses. A stand-in mesh without them (tests, launch/host_path_cpu.py: one rank, nobody to
    agree with) gets private ones."""
    ctrl = getattr(mesh, "ctrl", None)
    if ctrl is None:
        ctrl = mesh.cache.get("megakernel.ctrl")
        if ctrl is None:
            ctrl = mesh.cache["megakernel.ctrl"] = torch.zeros(ControlLayout(mesh.world_size).size, dtype=torch.int32,
                                                               device=mesh.device)
    call_error = getattr(mesh, "call_error", None)
    if call_error is None:
        call_error = mesh.cache.setdefault("megakernel.call_error", torch.zeros(ERR_WORDS, dtype=torch.int32))
    return ctrl, mesh.peer_ptrs(ctrl), call_error


class AgreementMixin:
    """CudaKernel's checks of a call and its agreement with the peers (a mixin: uses self.ir, self.schedule,
    self.early, self.trace_on, self.plan_key and self._lazy_check)."""

    def _signature(self, inputs, bound: dict, given=()) -> Signature:
        """What every rank's call at this shape must share (mesh/calls.py): inputs' dtypes, the outputs
        given, the sizes, and the plan (the graph's content, schedule, trace, early push). Not the
        inputs' shapes: a rank's may depend on its rank (its rows of a ragged M), and binding checked
        them against the sizes."""
        args = tuple((n, str(inputs[n].dtype).removeprefix("torch.")) for n in sorted(inputs))
        plan = (("schedule", self.schedule), ("early_push", tuple(sorted(self.early))), ("trace", self.trace_on),
                ("source", self.plan_key))   # the generated kernel's own hash: any other difference
        return Signature(self.ir.name, args + (("out", tuple(sorted(given))),
                                               ("sizes", tuple(sorted(bound.items()))), ("plan", plan)))

    def _check_offsets(self, bound: dict, world: int) -> None:
        """Every tensor and the event arena at these sizes within 32-bit element offsets (what the tile
        bodies and the arena's indices compute in), checked before anything is allocated."""
        at = {k: v for k, v in bound.items() if k != WORLD_NAME}
        for s in self.ir.tensors:
            for r in range(world if any(RANK_NAME in d.symbols() for d in s.shape) else 1):
                n = math.prod(evaluate(d, {**bound, RANK_NAME: r}) for d in s.shape)
                if n > INT32_MAX:
                    raise InputError(f"graph {self.ir.name!r}: tensor {s.name!r} would hold {n:,} elements at sizes "
                                     f"{at}: the GPU kernels address a tensor with 32-bit element offsets (at most "
                                     f"2**31 - 1 = {INT32_MAX:,}); split the call (fewer rows per call)")
        events = sum(math.prod(evaluate(d, bound) for d in e.shape) for e in self.ir.events)
        if events + ArenaLayout(world).events > INT32_MAX:
            raise InputError(f"graph {self.ir.name!r}: {events:,} event counters at sizes {at} pass 32-bit offsets; "
                             "split the call (fewer rows per call)")

    def _word(self, st, out: Optional[Mapping]) -> int:
        """The state's signature word (st: a cuda_state._MeshState) for a call that gives the outputs
        `out` names."""
        given = frozenset(n for n, t in (out or {}).items() if t is not None)
        word = st.words.get(given)
        if word is None:
            sig = st.signature
            word = st.words[given] = (Signature(sig.op, sig.args[:-3] + (("out", tuple(sorted(given))),)
                                                + sig.args[-2:]).word if sig is not None else 2)
        return word

    def _agree_call(self, mesh, inputs, sizes, out) -> Optional[Signature]:
        """A new shape: this rank's inputs checked, then the call agreed with every rank on the host
        (mesh/calls.py) before anything else is swapped; a rank that refuses publishes the refusal, so
        no rank waits in an exchange its peers never join (a stand-in mesh without call agreement
        skips it). Returns this call's signature."""
        try:
            bound = self._bind(mesh, inputs, sizes)
            self._check_out(mesh, out, self._output_shapes(bound, mesh.rank))
            self._check_offsets(bound, mesh.world_size)
            self._lazy_check(bound)
        except (InputError, GraphError) as e:
            post_refusal(mesh, [self], f"{type(e).__name__}: {e}")
            raise
        sig = self._signature(inputs, bound)
        calls = getattr(mesh, "calls", None)
        if calls is not None:
            given = tuple(sorted(n for n, t in (out or {}).items() if t is not None))
            calls.agree(Signature(sig.op, sig.args[:-3] + (("out", given),) + sig.args[-2:]))
        return sig

    def _bind(self, mesh, inputs, sizes) -> dict:
        world = mesh.world_size
        for name, t in inputs.items():
            if isinstance(t, torch.Tensor):
                if t.device != mesh.device:
                    raise InputError(f"graph {self.ir.name!r} input {name!r} is on {t.device}, the mesh on {mesh.device}")
                if not t.is_contiguous():
                    raise InputError(f"graph {self.ir.name!r} input {name!r} is not contiguous: pass .contiguous()")
        return bind_inputs(self.ir, {mesh.rank: inputs}, sizes, world=world, device_type=None)

    def _output_shapes(self, bound: dict, rank: int) -> dict:
        """name -> (shape, dtype) of this rank's outputs at the bound sizes."""
        env = {**bound, RANK_NAME: rank}
        return {s.name: (tuple(evaluate(d, env) for d in s.shape), s.dtype) for s in self.ir.tensors
                if s.role is Role.OUTPUT}

    def _check_out(self, mesh, out, outputs: Mapping[str, tuple]) -> None:
        for name, (shape, dtype) in outputs.items():
            given = (out or {}).get(name)
            if given is not None and (not isinstance(given, torch.Tensor) or tuple(given.shape) != shape or
                                      given.dtype != dtype or not given.is_contiguous() or
                                      given.device != mesh.device):
                got = (f"{list(given.shape)} {given.dtype} on {given.device}"
                       f"{'' if given.is_contiguous() else ', not contiguous'}"
                       if isinstance(given, torch.Tensor) else type(given).__name__)
                raise InputError(f"out[{name!r}]: need a contiguous {dtype} tensor "
                                 f"of shape {list(shape)} on {mesh.device}, got {got}")

    def _agree(self, mesh, inputs, sizes, out=None, captured=()) -> tuple[dict, set]:
        """Bind this rank's inputs (and check its `out` tensors) and swap the outcome with every rank
        before anything launches: a rank whose inputs are refused makes every rank raise (rather than
        leaving peers waiting, or pairing their launch with its next call). Also swaps the serials
        of the states this rank captured in CUDA graphs: returns (sizes, every rank's serials)."""
        try:
            bound, mine = self._bind(mesh, inputs, sizes), None
            self._check_out(mesh, out, self._output_shapes(bound, mesh.rank))
        except InputError as e:
            bound, mine = None, str(e)
        everyone = mesh.comm.allgather(mine if mine is not None else
                                       {"sizes": sorted(bound.items()), "captured": list(captured)})
        if mine is not None:
            raise InputError(mine)
        refused = [(r, e) for r, e in enumerate(everyone) if isinstance(e, str)]
        if refused:
            raise InputError(f"graph {self.ir.name!r}: rank {refused[0][0]} refused its inputs: {refused[0][1]}")
        if any(e["sizes"] != everyone[0]["sizes"] for e in everyone):
            listing = "; ".join(f"rank {r}: {dict(e['sizes'])}" for r, e in enumerate(everyone))
            raise InputError(f"graph {self.ir.name!r}: ranks disagree on sizes ({listing})")
        return bound, {serial for e in everyone for serial in e["captured"]}
