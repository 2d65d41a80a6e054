"""Graph IR, validation, static/dynamic scheduling and the backends that run a graph."""
from .compile import compile
from .cpu_runtime import CpuKernel
from .errors import (CounterError, DeadlockError, DoubleNotifyError, EtdistError, GraphError,
                     InputError, RuntimeFault)
from .expr import (Expr, cdiv, eq, every, grouped, ungrouped, logical_and, logical_or, maximum, minimum, row_chunks,
                   where)
from .graph import EventTensor, Graph
from .tile_context import TileContext
from .tiles import block, shift
from . import trace
