"""The lock that gives a run directory to one process at a time: run.lock, an flock holding its pid and host."""

import fcntl
import os
import socket
from pathlib import Path

from lib import rundir
from lib.config import UserError

# The directories this process holds, resolved, with their lock file's descriptor.
held: dict[Path, int] = {}


def hold(directory: Path) -> bool:
    """Gives `directory` (made if new) to this process until it ends or calls release, or ends in one sentence
    naming the process that holds it; returns False where this process held it already."""
    if directory.resolve() in held:
        return False
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / rundir.LOCK
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(descriptor, 200).decode(errors="replace").split()
            os.close(descriptor)
            who = f"pid {holder[0]} on {holder[1]}" if len(holder) == 2 else "a process"
            raise UserError(
                f"{directory} is in use by another run ({who}, {path}): two runs in one directory overwrite "
                "each other's outputs; wait for it to end, or give another directory."
            ) from None
        # The lock is on the file this path names now, not on one that release removed meanwhile.
        if os.path.exists(path) and os.path.samestat(os.fstat(descriptor), os.stat(path)):
            break
        os.close(descriptor)
    os.ftruncate(descriptor, 0)
    os.write(descriptor, f"{os.getpid()} {socket.gethostname()}\n".encode())
    held[directory.resolve()] = descriptor
    return True


def release(directory: Path, remove: bool = False) -> None:
    """Gives back a directory hold took; `remove` deletes the lock's file first (a refused run leaves nothing)."""
    descriptor = held.pop(directory.resolve())
    if remove:
        (directory / rundir.LOCK).unlink()
    os.close(descriptor)
