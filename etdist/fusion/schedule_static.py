"""Static schedule: a formula from global task id to (program, position); no per-shape table.

Tasks are numbered in the static order (bind.py): device functions in declaration order, grid
order within each. Program p runs ids p, p + P, p + 2P, ... in increasing order. If every task
waits only on tasks with smaller ids (validate.py checks this) and all programs are co-resident,
this cannot deadlock: the unfinished task with the smallest (id, rank) has all its producers
done, and everything its program runs before it has a smaller id, so it can always run.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StaticSchedule:
    programs: int

    def __post_init__(self):
        if self.programs < 1:
            raise ValueError(f"a static schedule needs at least one program, got {self.programs}")

    def program_of(self, task: int) -> int:
        return task % self.programs

    def position_of(self, task: int) -> int:
        return task // self.programs

    def task_at(self, program: int, position: int) -> int:
        return position * self.programs + program

    def tasks_of(self, program: int, total: int, start: int = 0) -> range:
        """The ids program `program` runs, in order, of the tasks [start, total): the k-th of them on
        program k % programs."""
        return range(start + program, total, self.programs)
