"""Ranks, symmetric memory and cross-rank errors: the layer every GPU kernel and collective stands on."""
from .control import ControlLayout, ErrorKind, ErrorRecord, Event
from .errors import MeshError, PeerTimeoutError, ShapeMismatchError
from .launch import Launch, Launcher, detect_launch
from .mesh import Mesh, current_mesh, init_mesh, timing_refused

__all__ = ["init_mesh", "current_mesh", "Mesh", "Launch", "Launcher", "detect_launch", "MeshError",
           "PeerTimeoutError", "ShapeMismatchError", "timing_refused", "ControlLayout", "ErrorKind", "ErrorRecord",
           "Event"]
