"""Errors raised by graph building, validation and the runtimes. Messages name the culprit."""


class EtdistError(Exception):
    """Base of every etdist error."""


class GraphError(EtdistError, ValueError):
    """A graph that cannot be compiled: bad declarations, maps out of bounds, unbalanced events, cycles."""


class InputError(EtdistError, ValueError):
    """A call whose tensors do not fit the graph (shape, dtype, device, rank count)."""


class RuntimeFault(EtdistError, RuntimeError):
    """Something went wrong while a compiled graph ran; no output is returned."""


class DeadlockError(RuntimeFault):
    """No program can move: the message lists the stuck tasks, what they wait on and the counters."""


class DoubleNotifyError(RuntimeFault):
    """An event element received more notifies than it waits for."""


class CounterError(RuntimeFault):
    """A launch ended with event counters that are not where the graph says they should be."""
