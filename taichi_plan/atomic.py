"""Atomic writes: a temp file (or directory) beside the target, then ``os.replace``.

An interrupted write leaves the old output (or nothing), never half a file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import OutputExistsError, UsageError


def check_output(path: str | os.PathLike, force: bool, what: str = "output") -> Path:
    """Refuse an existing ``path`` without ``force`` and a parent directory that is missing."""
    p = Path(path)
    if p.exists() and not force:
        raise OutputExistsError(
            f"The {what} {str(p)!r} already exists. Pass --force to overwrite it, or choose "
            "another path with -o."
        )
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.exists():
        raise UsageError(
            f"Cannot write {str(p)!r}: its directory {str(parent)!r} does not exist. Create it "
            "first or choose another path."
        )
    return p


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _umask_mode() -> int:
    """0o666 minus the process umask: what a plain open() would create (mkstemp makes 0600)."""
    return 0o666 & ~_umask()


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p


def write_with_atomic(path: str | os.PathLike, writer: Callable[[str], None]) -> Path:
    """Call ``writer(tmp_path)`` (e.g. matplotlib's savefig), then rename onto ``path``."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=p.suffix, dir=p.parent or ".")
    os.close(fd)
    try:
        writer(tmp)
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p


def replace_dir_atomic(build: Callable[[Path], None], target: str | os.PathLike) -> Path:
    """Build a directory in a temp sibling with ``build(tmp_dir)``, then swap it into place."""
    t = Path(target)
    t.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{t.name}.", suffix=".tmp", dir=t.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700
        build(tmp)
        if t.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{t.name}.", suffix=".old", dir=t.parent))
            os.rmdir(old)
            os.replace(t, old)
            os.replace(tmp, t)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, t)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return t
