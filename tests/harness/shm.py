"""Reshard's shared-memory segments in /dev/shm, as tests count them on a machine that may run other tests at once
(pytest-xdist workers, another checkout's suite): a test owns only the segments its own processes made."""
from __future__ import annotations

import os

SHM = "/dev/shm"


def segments() -> set[str]:
    """The names of reshard's segments now in /dev/shm (every process's)."""
    return {n for n in os.listdir(SHM) if n.startswith("reshard-")} if os.path.isdir(SHM) else set()


def creator_gone(name: str) -> bool:
    """Whether the process that made segment `name` has exited (its pid is in the name: executors.shared.Segment);
    False for a name that carries no pid."""
    try:
        os.kill(int(name.split("-")[1]), 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except (ValueError, IndexError, OSError):
        return False
    return False


def left_behind(before: set[str]) -> list[str]:
    """Segments made since `before` by this process or by one that has exited: once a test's own workers have all
    exited, the segments they or this process still hold are leaks; a live creator other than this process is
    another test's (its segments are its own)."""
    mine = f"reshard-{os.getpid()}-"
    return sorted(n for n in segments() - before if n.startswith(mine) or creator_gone(n))


__all__ = ["creator_gone", "left_behind", "segments"]
