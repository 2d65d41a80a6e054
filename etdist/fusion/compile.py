"""compile(graph): the passes, in order: canonicalise -> validate -> schedule -> build.

    kernel = et.compile(graph, schedule="static", target="cpu")
    outs = kernel.run([{"x": x0, "w": w0}, {"x": x1, "w": w1}])   # one dict per rank

ETDIST_DEBUG=1 prints each pass and its counts. ETDIST_EARLY_PUSH=0 turns the dynamic schedule's
early push off (ir.early_pushed; for A/B runs).
"""
from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence, Union

from .. import knobs
from .bind import MapTable
from .cpu_runtime import CpuKernel
from .errors import GraphError
from .graph import Graph
from .ir import GraphIR
from .validate import validate

SCHEDULES = ("static", "dynamic")
TARGETS = ("cpu", "cuda")
DEFAULT_CPU_PROGRAMS = 4


def early_push() -> bool:
    """ETDIST_EARLY_PUSH, read when a kernel compiles (default on; ir.early_pushed)."""
    return knobs.now("ETDIST_EARLY_PUSH", knobs.flag, True)


def compile(graph: Union[Graph, GraphIR], schedule: str = "static", target: str = "cpu",
            programs: Optional[int] = None,
            samples: Optional[Sequence[Mapping[str, int]]] = None, trace: bool = False):
    """Compile a graph into a megakernel for `target`.

    schedule: "static" (tasks pre-assigned to programs by formula; the default for dense work) or
        "dynamic" (an on-device ready queue; for data-dependent graphs such as MoE).
    programs: persistent programs per rank (simulated SMs on the CPU).
    samples: sizes at which to enumerate the graph for validation (defaults: graph.sample(...)
        declarations, else small ragged sizes).
    trace: record every task's start/end (target "cuda": a compile-time switch, read with
        kernel.trace(mesh); target "cpu": the default of kernel.run(..., trace=)).
    """
    if schedule not in SCHEDULES:
        raise GraphError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if target not in TARGETS:
        raise GraphError(f"target must be one of {TARGETS}, got {target!r}")
    if not isinstance(graph, (Graph, GraphIR)):
        raise GraphError(f"compile takes an et.Graph (or its IR), got {type(graph).__name__}")
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
        raise GraphError(f"programs must be a positive int, got {programs!r}")
    debug = os.environ.get("ETDIST_DEBUG", "0") not in ("", "0")
    ir = graph.to_ir() if isinstance(graph, Graph) else graph
    if debug:
        print(f"[etdist] canonicalise {ir.name}: {len(ir.tasks)} device functions, {len(ir.events)} "
              f"event tensors, {len(ir.tensors)} tensors, key {ir.key()}")
    table = MapTable.build(ir)
    report = validate(ir, table, schedule, samples)
    if debug:
        print(f"[etdist] validate {ir.name}: {report.tasks} tasks over {len(report.samples)} samples; "
              f"runtime-checked events: {list(report.dynamic_events)}")
    early = early_push()
    if target == "cuda":
        from .cuda_runtime import CudaKernel  # imports triton; CPU-only users never need it
        kernel = CudaKernel(table, schedule, programs, trace=trace, early_push=early)
    else:
        kernel = CpuKernel(table, schedule, programs or DEFAULT_CPU_PROGRAMS, early_push=early)
        kernel.trace_default = trace
    if debug:
        print(f"[etdist] build {ir.name}: {kernel}")
    return kernel
