"""Writing outputs safely: to a temporary file in the same folder, then an atomic rename, so a
failure or Ctrl-C never leaves a half-written result and never clobbers the previous one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` to `path` atomically (same-directory temp file + os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the user's usual mode
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str | Path, document: object) -> None:
    """Deterministic JSON (sorted keys, fixed indentation) written atomically."""
    write_atomic(path, json.dumps(document, indent=2, sort_keys=True) + "\n")
