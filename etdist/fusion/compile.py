"""compile(graph): the passes, in order: canonicalise -> validate -> schedule -> build.

    kernel = et.compile(graph, schedule="static", target="cpu")
    outs = kernel.run([{"x": x0, "w": w0}, {"x": x1, "w": w1}])   # one dict per rank

ETDIST_DEBUG=1 logs each pass and its counts (logger etdist.fusion.compile, to stderr). compile's
early_push picks the dynamic schedule's early push (ir.early_pushed): 0 off, 1 (the default) the
tasks that wait on pinned work, 2 also the chains behind them.
"""
from __future__ import annotations

import logging
from typing import Mapping, Optional, Sequence, Union

from .. import knobs, log
from .bind import MapTable
from .cpu_runtime import CpuKernel
from .errors import GraphError
from .graph import Graph
from .ir import GraphIR
from .validate import validate

SCHEDULES = ("static", "dynamic")
TARGETS = ("cpu", "cuda")
DEFAULT_CPU_PROGRAMS = 4
_LOG = logging.getLogger(__name__)


EARLY_PUSH_LEVELS = (0, 1, 2)


def compile(graph: Union[Graph, GraphIR], schedule: str = "static", target: str = "cpu",
            programs: Optional[int] = None,
            samples: Optional[Sequence[Mapping[str, int]]] = None, trace: bool = False,
            early_push: Optional[int] = None, check_events: bool = False, local_first: bool = False):
    """Compile a graph into a megakernel for `target`.

    schedule: "static" (tasks pre-assigned to programs by formula; the default for dense work) or
        "dynamic" (an on-device ready queue; for data-dependent graphs such as MoE).
    programs: persistent programs per rank (simulated SMs on the CPU).
    samples: sizes at which to enumerate the graph for validation (defaults: graph.sample(...)
        declarations, else small ragged sizes).
    trace: record every task's start/end (target "cuda": a compile-time switch, read with
        kernel.trace(mesh); target "cpu": the default of kernel.run(..., trace=)).
    early_push: the dynamic schedule's early push, 0, 1 or 2 (ir.early_pushed; default 1).
    check_events: (target "cuda") a debug build whose notifies check their coordinates and whose
        end checks that no counter went past its count, so a map wrong at sizes validation did not
        enumerate raises naming the event and element (the CPU runtime always checks both).
    local_first: (target "cuda") the graph's leading tasks that touch nothing a peer can see
        (codegen_triton.local_prefix) run while the ranks' call agreement is under way, their
        notifies after it: their time overlaps the wait for the peers (the CPU runtime has none).
    """
    if schedule not in SCHEDULES:
        raise GraphError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if target not in TARGETS:
        raise GraphError(f"target must be one of {TARGETS}, got {target!r}")
    if not isinstance(graph, (Graph, GraphIR)):
        raise GraphError(f"compile takes an et.Graph (or its IR), got {type(graph).__name__}")
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
        raise GraphError(f"programs must be a positive int, got {programs!r}")
    if knobs.now("ETDIST_DEBUG", knobs.flag, False):
        log.show_debug(_LOG)
    debug = _LOG.isEnabledFor(logging.DEBUG)
    ir = graph.to_ir() if isinstance(graph, Graph) else graph
    if debug:
        _LOG.debug(f"canonicalise {ir.name}: {len(ir.tasks)} device functions, {len(ir.events)} "
                   f"event tensors, {len(ir.tensors)} tensors, key {ir.key()}")
    table = MapTable.build(ir)
    report = validate(ir, table, schedule, samples)
    if debug:
        _LOG.debug(f"validate {ir.name}: {report.tasks} tasks over {len(report.samples)} samples; "
                   f"runtime-checked events: {list(report.dynamic_events)}")
    if early_push is None:
        early_push = 1
    elif early_push not in EARLY_PUSH_LEVELS or isinstance(early_push, bool):
        raise GraphError(f"early_push must be one of {EARLY_PUSH_LEVELS}, got {early_push!r}")
    if target == "cuda":
        from .cuda_runtime import CudaKernel  # imports triton; CPU-only users never need it
        kernel = CudaKernel(table, schedule, programs, trace=trace, early_push=early_push, check_events=check_events,
                            local_first=local_first)
    else:
        kernel = CpuKernel(table, schedule, programs or DEFAULT_CPU_PROGRAMS, early_push=early_push)
        kernel.trace_default = trace
    if debug:
        _LOG.debug(f"build {ir.name}: {kernel}")
    return kernel
