"""Builds of compiled ops that were cut off. torch builds an extension just in time (DeepSpeed's CPU Adam, its
shared-memory collectives on a CPU machine, ...) in a folder of its own and marks the build in progress with
an empty file, `lock`, which the building process holds open and removes when it is done. A build killed
outright (`kill -9`, the out-of-memory killer, a machine or a session stopped) leaves the file behind, and
every later load of that op, built or not, waits for it to go away, for ever and without a word.

`python -m toolkit.launch.op_builds` says so in one line (exit 2) where such a file is found, as `make
install-ds-ops`, a DeepSpeed launch's checks and `ftkit doctor` do."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from toolkit.errors import USER_ERROR_EXIT_CODE, UserError

LEFT_AFTER_S = 600
"""A lock older than this that no process here holds open is left over: a build takes minutes (about 2 for
DeepSpeed's CPU Adam on two cores). The age also spares a build running on another machine that shares this
home folder, which no /proc here shows."""


def extensions_root() -> Path:
    """Where torch builds extensions: TORCH_EXTENSIONS_DIR, else its per-user cache folder (torch's own
    answer, which has the folder for this Python and build inside)."""
    explicit = os.environ.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return Path(explicit)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def held_open() -> set[str]:
    """The files the processes this user can see hold open (their /proc/<pid>/fd links)."""
    held = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            held.update(os.readlink(fd_dir / fd) for fd in os.listdir(fd_dir))
        except OSError:  # another user's process, or one that ended meanwhile
            continue
    return held


def left_locks(root: Path | None = None) -> list[Path]:
    """Build locks under `root` (an op's folder, or a py<ver>_<build> folder's op folders) that are older
    than LEFT_AFTER_S and that no process here holds open."""
    root = root if root is not None else extensions_root()
    now = time.time()
    old = []
    for lock in sorted([*root.glob("*/lock"), *root.glob("*/*/lock")]):
        try:
            if now - lock.stat().st_mtime > LEFT_AFTER_S:
                old.append(lock)
        except OSError:  # removed by the build that held it
            continue
    if not old:
        return []
    held = held_open()
    return [lock for lock in old if str(lock.resolve()) not in held]


def describe(lock: Path) -> str:
    minutes = (time.time() - lock.stat().st_mtime) / 60
    return (
        f"{lock}: a build of the compiled op {lock.parent.name!r} was cut off {minutes:.0f} min ago and left "
        "its lock (no process on this machine holds it), so every run that loads the op waits on it for "
        "ever: remove the file"
    )


def refuse_left_locks(root: Path | None = None) -> None:
    """Raise UserError naming the first left-over build lock, if any."""
    locks = left_locks(root)
    if locks:
        raise UserError(describe(locks[0]))


def main() -> int:
    try:
        refuse_left_locks()
    except UserError as exc:
        print(exc, file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
