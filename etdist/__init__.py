"""etdist: Event Tensor megakernels for tensor-parallel layers.

    import etdist as et
    g = et.Graph("name"); ...; kernel = et.compile(g, schedule="static", target="cpu")
"""
from .fusion import (CounterError, DeadlockError, DoubleNotifyError, EtdistError, EventTensor, Expr,
                     Graph, GraphError, InputError, RuntimeFault, cdiv, compile, eq, every, grouped, logical_and,
                     logical_or, maximum, minimum, row_chunks, ungrouped, where)
from .fusion.tiles import block, shift
from .knobs import KnobError
from .mesh import Mesh, MeshError, PeerTimeoutError, ShapeMismatchError, current_mesh, init_mesh
from . import collectives, nn, ops
from .collectives import all_gather, all_reduce, all_to_all, reduce_scatter

__version__ = "0.1.0"
