"""Writing files so that a failure never leaves half of one: ``atomic_write`` (guard plans, reports,
results, videos go through it) and ``atomic_folder`` (a model folder written as a whole)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _mode_for(path: Path) -> int:
    """The existing file's mode, or what ``open(path, "w")`` would create (0666 less the umask)."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` (same folder, same suffix, so that writers that go by the
    suffix, as imageio does, pick the format) for a writer that takes a file name; flushed to disk
    and renamed over ``path`` when the block ends normally, removed when it raises, so that ``path``
    is either the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    os.chmod(tmp, _mode_for(path))   # mkstemp makes 0600: give the file the mode a plain open() would
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` so that the file is either the old one or the whole new one (a
    temporary file in the same folder, flushed to disk, then renamed over ``path``)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary folder beside ``path`` to fill; when the block ends normally it takes the place of
    ``path`` (an existing folder there is replaced whole), when it raises it is removed, so that
    ``path`` is either the old folder or the whole new one (a model folder and its training record)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)   # mkdtemp makes 0700: give the folder the mode a plain mkdir would
    try:
        yield tmp
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
            os.replace(path, old / path.name)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
