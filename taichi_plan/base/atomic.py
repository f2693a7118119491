"""Every output this tool writes goes through here: one rule for what may be replaced, a
writability check before the work, and atomic writes.

The rule (:func:`check_output`, called before any long work):

* the location must be writable: the nearest existing ancestor is a directory in which a
  temp file can be made (missing directories are created when writing, for every command);
* a file output never replaces a directory (nor a device or pipe), a directory output
  never a file;
* an existing output is replaced only with ``force``, and only if it is one this tool
  wrote: a plan file that parses as a plan, a trace directory that holds nothing but a
  trace's own files. Anything else is refused, so a mistyped ``-o traces --force`` cannot
  delete a folder of traces.

Writes build a temp sibling (``.<name>.XXXXXXXX.tmp``, the ``XXXXXXXX`` from
:mod:`tempfile`) and rename it into place, so an interrupted write leaves the old output
(or nothing), never half a file. A directory is swapped in with one atomic exchange where the
OS has one (Linux ``renameat2``); elsewhere the old one is first moved to
``.<name>.XXXXXXXX.old`` and put back if the second rename fails. Each write first removes
stale temp siblings of its own target left by a killed process (those names only), and
puts back a ``.old`` whose target is missing. Every ``OSError`` while writing becomes an
:class:`~taichi_plan.base.errors.OutputError`.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import OutputError, OutputExistsError, TaichiError

TOOL = "taichi-plan"
_RANDOM = r"[a-z0-9_]{8}"  # tempfile's random part: 8 of "a-z0-9_"
MAX_LISTED = 4  # foreign files named in a refusal before "and N more"


def starts_with(*magics: bytes) -> Callable[[Path], bool]:
    """An ``owned`` test for :func:`check_output`: the file begins with one of ``magics``
    (compared case-insensitively, after leading whitespace)."""
    wanted = [m.lower() for m in magics]

    def owned(path: Path) -> bool:
        try:
            with open(path, "rb") as f:
                head = f.read(64).lstrip().lower()
        except OSError:
            return False
        return any(head.startswith(m) for m in wanted)

    return owned


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
is_png = starts_with(PNG_MAGIC)  # a PNG image, which --force may replace with another
is_html = starts_with(b"<!doctype html", b"<html")  # an HTML page, likewise


def _say(cls: type[TaichiError], option: str | None, text: Callable[[str, str], str]) -> TaichiError:
    """An error in two phrasings: ``text(force, other)`` for library callers (``force=True``,
    "another path") and for the command line (``--force``, "another path with -o")."""
    cli_other = f"another path with {option}" if option else "another path"
    return cls(text("force=True", "another path"), cli_message=text("--force", cli_other))


# ---------------------------------------------------------------------------------------------
# Before the work: may this output be written here?
# ---------------------------------------------------------------------------------------------


def check_output(path: str | os.PathLike, force: bool, what: str = "output", *, option: str | None = None,
                 owned: Callable[[Path], bool] | None = None,
                 dir_files: frozenset[str] | None = None) -> Path:
    """Check, before any work, that ``path`` can take this output; return it as a Path.

    ``dir_files``: the output is a directory holding only these names (a trace); an existing
    directory holding anything else is refused even with ``force``. ``owned(path)``: for a
    file output, whether an existing file is one this tool wrote (default: any regular file).
    ``option`` names the flag that chose the path (``-o``, ``--png``) in command-line messages.
    Raises :class:`OutputExistsError` (exists, no ``force``) or :class:`OutputError`.
    """
    p = Path(path)
    _restore_interrupted(p)
    if dir_files is not None:
        _check_existing_dir(p, force, what, option, dir_files)
    else:
        _check_existing_file(p, force, what, option, owned)
    probe_writable(p, what, option)
    return p


def _check_existing_dir(p: Path, force: bool, what: str, option: str | None, dir_files: frozenset[str]) -> None:
    if not (p.exists() or p.is_symlink()):
        return
    if not p.is_dir():
        raise _say(OutputError, option, lambda f, o: (
            f"Cannot write the {what} {str(p)!r}: something that is not a directory already has that "
            f"name, and {f} replaces only a {what} {TOOL} wrote. Choose {o}, or move it away first."))
    foreign = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(p) if e.name not in dir_files)
    if foreign:
        listed = ", ".join(foreign[:MAX_LISTED]) + (f" and {len(foreign) - MAX_LISTED} more"
                                                    if len(foreign) > MAX_LISTED else "")
        ours = ", ".join(sorted(dir_files))
        raise _say(OutputError, option, lambda f, o: (
            f"Refusing to replace {str(p)!r}: it holds {len(foreign)} "
            f"{'entry' if len(foreign) == 1 else 'entries'} {TOOL} did not write ({listed}), and {f} "
            f"replaces only a {what} {TOOL} wrote (nothing but {ours}). Did you mean a path inside it, "
            f"such as {str(p / 'NAME')!r}? Choose {o}; nothing was changed."))
    if not force:
        raise _say(OutputExistsError, option, lambda f, o: (
            f"The {what} {str(p)!r} already exists. Pass {f} to replace it, or choose {o}."))


def _check_existing_file(p: Path, force: bool, what: str, option: str | None,
                         owned: Callable[[Path], bool] | None) -> None:
    if not (p.exists() or p.is_symlink()):
        return
    if p.is_dir():
        raise _say(OutputError, option, lambda f, o: (
            f"Cannot write the {what} {str(p)!r}: it is a directory, and {f} never replaces a "
            f"directory. Give the path of a file (for example one inside it), or choose {o}."))
    if p.exists() and not p.is_file():
        raise _say(OutputError, option, lambda f, o: (
            f"Cannot write the {what} {str(p)!r}: it is not a regular file (a device, pipe or "
            f"socket), and {f} replaces only regular files. Choose {o}."))
    if p.exists() and owned is not None and not owned(p):
        raise _say(OutputError, option, lambda f, o: (
            f"Refusing to replace {str(p)!r}: it is not a {what} {TOOL} wrote, and {f} replaces "
            f"only those. Choose {o}, or move the file away first; nothing was changed."))
    if not force:
        raise _say(OutputExistsError, option, lambda f, o: (
            f"The {what} {str(p)!r} already exists. Pass {f} to replace it, or choose {o}."))


def probe_writable(path: str | os.PathLike, what: str = "output", option: str | None = None) -> None:
    """Make and remove a temp file in the nearest existing ancestor of ``path``'s directory:
    a cheap check, before the work, that the output can be written there."""
    p = Path(path)
    ancestor = p.parent
    while not (ancestor.exists() or ancestor.is_symlink()) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    where = str(ancestor) if str(ancestor) else "."
    if not ancestor.is_dir():
        raise _say(OutputError, option, lambda f, o: (
            f"Cannot write the {what} {str(p)!r}: {where!r} is not a directory, so nothing can be "
            f"created under it. Choose {o}."))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=ancestor)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        reason = e.strerror or str(e)
        raise _say(OutputError, option, lambda f, o: (
            f"Cannot write the {what} {str(p)!r}: the directory {where!r} is not writable "
            f"({reason}). Make it writable, or choose {o}.")) from e


# ---------------------------------------------------------------------------------------------
# Stale temp siblings of a target, left by a killed write
# ---------------------------------------------------------------------------------------------


def _stale_pattern(target: Path) -> re.Pattern:
    name = re.escape(target.name)
    suffix = re.escape(target.suffix)
    return re.compile(rf"\.{name}\.{_RANDOM}\.(?:tmp(?:{suffix})?|old)\Z" if suffix
                      else rf"\.{name}\.{_RANDOM}\.(?:tmp|old)\Z")


def stale_siblings(target: str | os.PathLike) -> list[Path]:
    """This tool's temp siblings of ``target`` (``.<name>.XXXXXXXX.tmp`` or ``.old``), oldest first."""
    t = Path(target)
    parent = t.parent if str(t.parent) else Path(".")
    if not parent.is_dir():
        return []
    pattern = _stale_pattern(t)
    found = []
    for e in os.scandir(parent):
        if pattern.match(e.name):
            try:
                found.append((e.stat(follow_symlinks=False).st_mtime, e.name))
            except FileNotFoundError:
                continue  # removed meanwhile
    return [parent / name for _, name in sorted(found)]


def _restore_interrupted(target: Path) -> None:
    """A write killed between moving the old output aside and moving the new one in leaves
    the target missing and ``.<name>.XXXXXXXX.old`` complete: put the newest one back."""
    if target.exists() or target.is_symlink():
        return
    olds = [q for q in stale_siblings(target) if q.name.endswith(".old")]
    if olds:
        try:
            os.replace(olds[-1], target)
        except OSError:
            pass  # the write that follows reports the directory's real problem


def sweep_stale(target: str | os.PathLike) -> list[Path]:
    """Remove stale temp siblings of ``target`` (after putting back an interrupted ``.old``)."""
    t = Path(target)
    _restore_interrupted(t)
    removed = []
    for q in stale_siblings(t):
        if q.is_dir() and not q.is_symlink():
            shutil.rmtree(q, ignore_errors=True)
        else:
            q.unlink(missing_ok=True)
        removed.append(q)
    return removed


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _write_error(p: Path, what: str, e: OSError) -> OutputError:
    reason = e.strerror or str(e)
    at = f" at {e.filename!r}" if e.filename and str(e.filename) != str(p) else ""
    return OutputError(
        f"Could not write the {what} {str(p)!r}: {reason}{at}. The previous {what}, if any, was "
        "left as it was. Check the free space and permissions there, or choose another path.")


def _prepare(p: Path) -> None:
    """Create missing parent directories and sweep this target's stale temp siblings."""
    p.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(p)


def write_text_atomic(path: str | os.PathLike, text: str, what: str = "output") -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"), what)


def write_json_atomic(path: str | os.PathLike, obj, what: str = "output") -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=False) + "\n", what)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _umask_mode() -> int:
    """0o666 minus the process umask: what a plain open() would create (mkstemp makes 0600)."""
    return 0o666 & ~_umask()


def write_bytes_atomic(path: str | os.PathLike, data: bytes, what: str = "output") -> Path:
    p = Path(path)
    tmp = None
    try:
        _prepare(p)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, p)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _write_error(p, what, e) from e
        raise
    return p


def write_with_atomic(path: str | os.PathLike, writer: Callable[[str], None], what: str = "output") -> Path:
    """Call ``writer(tmp_path)`` (e.g. matplotlib's savefig; the temp name ends in the
    target's suffix), then rename onto ``path``."""
    p = Path(path)
    tmp = None
    try:
        _prepare(p)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp" + p.suffix, dir=p.parent)
        os.close(fd)
        writer(tmp)
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, p)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _write_error(p, what, e) from e
        raise
    return p


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).
    False where the OS or file system has no such call; raises OSError on a real failure."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_in(tmp: Path, t: Path) -> None:
    """Put the finished ``tmp`` at ``t``; the old ``t`` stays in place until then."""
    if not (t.exists() or t.is_symlink()):
        os.replace(tmp, t)
        return
    if _exchange(tmp, t):  # tmp now holds the old output
        if tmp.is_symlink():
            tmp.unlink()
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{t.name}.", suffix=".old", dir=t.parent))
    os.rmdir(old)
    os.replace(t, old)
    try:
        os.replace(tmp, t)
    except BaseException:
        os.replace(old, t)
        raise
    shutil.rmtree(old, ignore_errors=True)


def replace_dir_atomic(build: Callable[[Path], None], target: str | os.PathLike, what: str = "output") -> Path:
    """Build a directory in a temp sibling with ``build(tmp_dir)``, then swap it into place."""
    t = Path(target)
    tmp = None
    try:
        _prepare(t)
        tmp = Path(tempfile.mkdtemp(prefix=f".{t.name}.", suffix=".tmp", dir=t.parent))
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700
        build(tmp)
        _swap_in(tmp, t)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise _write_error(t, what, e) from e
        raise
    return t
