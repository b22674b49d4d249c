"""The rules data/incoming is held to before anything reads, versions or pushes it (torch-free: the retrain
flow checks them on a device worker before `dvc add`)."""
from __future__ import annotations

import os
from pathlib import Path

from edgeflux.errors import UserError

READD = "then version it again: `dvc add data/incoming/<class id>`"


class IncomingDataError(ValueError, UserError):
    """The incoming samples do not follow their layout (the message names the file or folder and the fix)."""


def refuse_links(root: str | Path) -> None:
    """IncomingDataError naming the first symbolic link under ``root``. Incoming data is regular files inside
    it only: `dvc add` would copy a linked file's content (any file of the host) into the cache and the shared
    remote, and a linked folder is read by the stages but not versioned, so a retrain could not be reproduced."""
    root = Path(root)
    if not root.is_dir():
        return
    for folder, dirs, files in os.walk(root):   # followlinks=False: a linked folder is listed, not entered
        for name in sorted(dirs + files):
            path = Path(folder) / name
            if path.is_symlink():
                raise IncomingDataError(f"{path} is a symbolic link (to {os.readlink(path)}): incoming data is "
                                        f"regular files inside {root} only; copy the files in instead, {READD}")
