"""Result records (docs/design.md): one JSON object per line of bench/results/<workload>.jsonl.

Appending only: a re-run adds lines, and the newest record of a cell (workload, model, M, world,
schedule) is the one that counts. `make_record` stamps a measurement with the environment and time:

    rec = make_record(workload="gemm_rs", model="qwen3_8b", M=16, world=2, schedule="static",
                      ours_us=31.0, baselines={"graph": 40.6, "eager": 47.2, "mm": 18.5},
                      floor_us=12.2, rel_err=3e-3)
    append("bench/results/gemm_rs.jsonl", rec)
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import pathlib
import subprocess
from dataclasses import dataclass, field
from typing import Iterable, Optional

from ... import knobs

REPO = pathlib.Path(__file__).resolve().parents[2]
# Paths whose changes do not make a measured tree "dirty": the records themselves, report output.
_NOT_CODE = ("bench/results", "bench/plots", "docs/benchmarks.md")


@dataclass
class Record:
    workload: str                 # gemm_rs, ag_gemm, mlp, moe, reduce_scatter, all_gather, ...
    model: str
    M: int                        # tokens
    world: int
    schedule: str                 # static, dynamic
    ours_us: float
    baselines: dict[str, float]   # graph, eager, symm_mem, mm, ... in us
    floor_us: Optional[float]
    rel_err: Optional[float]
    device: str
    torch: str
    triton: str
    commit: str
    date: str                     # ISO 8601, UTC
    notes: Optional[str] = field(default=None)
    extra: Optional[dict] = field(default=None)   # workload-specific figures (e.g. bus bandwidth)

    @property
    def cell(self) -> tuple:
        return (self.workload, self.model, self.M, self.world, self.schedule)

    def to_json(self) -> str:
        obj = dataclasses.asdict(self)
        for optional in ("notes", "extra"):
            if obj[optional] is None:
                del obj[optional]
        return json.dumps(obj, sort_keys=False)


_OPTIONAL = {"notes", "extra"}
_REQUIRED = [f.name for f in dataclasses.fields(Record) if f.name not in _OPTIONAL]
_KNOWN = set(_REQUIRED) | _OPTIONAL


def _from_obj(obj: dict, where: str) -> Record:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in _REQUIRED if k not in obj]
    unknown = sorted(set(obj) - _KNOWN)
    if missing or unknown:
        raise ValueError(f"{where}: record does not follow docs/design.md's record schema "
                         f"(missing {missing}, unknown {unknown})")
    return Record(**obj)


def append(path, record: Record) -> None:
    """Append one record as one line of the jsonl file at `path` (created with its folder)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(record.to_json() + "\n")


def load(path) -> list[Record]:
    """All records of one jsonl file, in file order; blank lines are skipped."""
    path = pathlib.Path(path)
    out = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        out.append(_from_obj(obj, where))
    return out


def _when(record: Record) -> _dt.datetime:
    when = _dt.datetime.fromisoformat(record.date)
    return when if when.tzinfo else when.replace(tzinfo=_dt.timezone.utc)


def newest_per_cell(records: Iterable[Record]) -> list[Record]:
    """The newest record of each cell, by date, ties going to the later one in input order.
    Returned in the order the cells first appear."""
    newest: dict[tuple, tuple] = {}
    for order, rec in enumerate(records):
        key = (_when(rec), order)
        if rec.cell not in newest or key >= newest[rec.cell][0]:
            newest[rec.cell] = (key, rec)
    return [rec for _, rec in newest.values()]


def _git(*args: str) -> Optional[str]:
    try:
        res = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def git_commit() -> str:
    """`git rev-parse --short HEAD`, "+dirty" appended when code differs from it (tracked changes
    or untracked files, except the records and report outputs); "uncommitted" without a commit."""
    if knobs.text("ETDIST_COMMIT"):  # a copy of the tree without .git (e.g. a GPU machine)
        return knobs.text("ETDIST_COMMIT")
    head = _git("rev-parse", "--short", "HEAD")
    if not head:
        return "uncommitted"
    excludes = [f":(exclude){p}" for p in _NOT_CODE]
    status = _git("status", "--porcelain", "--", ".", *excludes)
    return head + "+dirty" if status else head


def env_info() -> dict[str, str]:
    """device, torch, triton and commit fields of a Record, for this process."""
    import torch
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        import platform
        device = f"cpu ({platform.machine()})"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {"device": device, "torch": torch.__version__, "triton": triton_version,
            "commit": git_commit()}


def now() -> str:
    """The current UTC time, ISO 8601 with seconds: the `date` of a new record."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def make_record(*, workload: str, model: str, M: int, world: int, schedule: str, ours_us: float,
                baselines: dict[str, float], floor_us: Optional[float], rel_err: Optional[float],
                notes: Optional[str] = None, env: Optional[dict[str, str]] = None,
                date: Optional[str] = None, extra: Optional[dict] = None) -> Record:
    """A Record stamped with `env` (default: env_info(); pass one computed once per run to save the
    git calls) and `date` (default: now)."""
    env = env_info() if env is None else env
    return Record(workload=workload, model=model, M=int(M), world=int(world), schedule=schedule,
                  ours_us=float(ours_us), baselines={k: float(v) for k, v in baselines.items()},
                  floor_us=None if floor_us is None else float(floor_us),
                  rel_err=None if rel_err is None else float(rel_err),
                  device=env["device"], torch=env["torch"], triton=env["triton"],
                  commit=env["commit"], date=now() if date is None else date, notes=notes, extra=extra)
