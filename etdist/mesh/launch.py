"""Which launcher started this process, read from the environment into a frozen record.

torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; Open MPI sets OMPI_COMM_WORLD_*; MPICH (and Intel MPI,
through Hydra) sets PMI_RANK/PMI_SIZE/MPI_LOCALRANKID; Slurm's srun sets SLURM_PROCID/SLURM_NTASKS/
SLURM_LOCALID. Nothing here touches torch, MPI or a GPU.
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass, replace
from typing import Mapping, Optional

from .errors import MeshError


class Launcher(str, enum.Enum):
    SINGLE = "single"
    TORCHRUN = "torchrun"
    OPENMPI = "openmpi"
    MPICH = "mpich"
    SLURM = "slurm"

    @property
    def is_mpi(self) -> bool:
        return self in (Launcher.OPENMPI, Launcher.MPICH)


@dataclass(frozen=True)
class Launch:
    launcher: Launcher
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    run_id: Optional[str] = None  # a string every rank shares, where the launcher gives one


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise MeshError(f"environment variable {key}={env[key]!r} is not an integer") from None


def _from(env, launcher, rank, size, local, local_size, run_id=None) -> Launch:
    r, w = _int(env, rank), _int(env, size)
    lr = _int(env, local) if local in env else r
    lw = _int(env, local_size) if local_size in env else w
    return Launch(launcher, r, w, lr, lw, env.get(run_id) if run_id else None)


def detect_launch(env: Optional[Mapping[str, str]] = None) -> Launch:
    """Read the launcher from `env` (default os.environ). torchrun wins over MPI wins over Slurm:
    torchrun inside an srun allocation still sets SLURM_*; mpirun inside Slurm sets both too."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        run_id = "TORCHELASTIC_RUN_ID" if "TORCHELASTIC_RUN_ID" in env else None
        return _from(env, Launcher.TORCHRUN, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", run_id)
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        return _from(env, Launcher.OPENMPI, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        return _from(env, Launcher.MPICH, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _from(env, Launcher.SLURM, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                     "SLURM_NTASKS_PER_NODE", "SLURM_JOB_ID")
    return Launch(Launcher.SINGLE, 0, 1, 0, 1)


def resolve_launch(launch: Launch, world_size: Optional[int] = None, rank: Optional[int] = None,
                   local_rank: Optional[int] = None) -> Launch:
    """Apply explicit arguments over what the environment said, and check the result."""
    for name, v in (("world_size", world_size), ("rank", rank), ("local_rank", local_rank)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise MeshError(f"init_mesh({name}={v!r}): {name} must be an int")
    if world_size is not None and world_size != launch.world_size:
        if launch.launcher is Launcher.SINGLE and world_size > 1 and rank is None:
            raise MeshError(
                f"init_mesh(world_size={world_size}) but no launcher started this process (no RANK/"
                f"WORLD_SIZE from torchrun, OMPI_COMM_WORLD_* or PMI_* from mpirun, SLURM_* from srun): "
                f"run `torchrun --nproc_per_node={world_size} your_script.py` or "
                f"`mpirun -n {world_size} python your_script.py`")
        if launch.launcher is not Launcher.SINGLE:
            raise MeshError(
                f"init_mesh(world_size={world_size}) but {launch.launcher.value} started "
                f"{launch.world_size} processes: drop the argument or launch {world_size} processes")
    w = launch.world_size if world_size is None else world_size
    r = launch.rank if rank is None else rank
    lr = launch.local_rank if local_rank is None else local_rank
    lw = w if launch.launcher is Launcher.SINGLE else launch.local_world_size
    if w < 1:
        raise MeshError(f"world size must be >= 1, got {w}")
    if not 0 <= r < w:
        raise MeshError(f"rank {r} is outside the world of {w} ranks")
    if not 0 <= lr < max(lw, 1):
        raise MeshError(f"local rank {lr} is outside the {lw} ranks on this node")
    return replace(launch, rank=r, world_size=w, local_rank=lr, local_world_size=lw)
