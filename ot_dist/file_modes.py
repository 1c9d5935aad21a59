"""Files the project writes get the mode the umask allows, like any file `open()` creates. safetensors'
`save_file` (0.8) creates its files 0600, so without this another user, or a serving container running as
another uid, could not read an export or a checkpoint."""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # not thread-safe, hence /proc first
    os.umask(mask)
    return mask


def share_with_umask(path: str | Path) -> None:
    """Give a file (or every file under a folder) mode 0666 & ~umask."""
    path = Path(path)
    mode = 0o666 & ~current_umask()
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
    for file in files:
        if file.stat().st_mode & 0o777 != mode:
            os.chmod(file, mode)
