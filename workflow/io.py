"""Shared file primitives: atomic writes and checksums.

Every stage writes its outputs through :func:`atomic_path`, so an interrupted job
never leaves a file that looks complete (docs/provenance.md, "Atomic writes").
"""

from __future__ import annotations

import contextlib
import csv
import glob
import hashlib
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Iterator

from workflow.errors import PipelineError

_CHUNK_BYTES = 4 * 1024 * 1024


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it to ``path`` on success.

    The caller writes the complete file to the yielded path. If the block raises
    (including ``OSError`` for a full disk), the temporary file is removed and
    ``path`` is left as it was. Parent directories are created. The temporary name,
    ``.<name>.<host>-<pid>.<random><suffix>``, names its writer: one left by a writer that
    was killed (SIGKILL) is removed by the next write of ``path`` on the same host.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path, suffix)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, suffix=suffix,
                                    prefix=f".{path.name}.{socket.gethostname()}-{os.getpid()}.")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_current_umask())
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_stale_temporaries(path: Path, suffix: str = ".tmp") -> None:
    """Remove the temporary files of ``path`` whose writer, a process of this host, is gone."""
    named = re.compile(rf"\.{re.escape(path.name)}\.(.+)-(\d+)\.\w+{re.escape(suffix)}")
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*{suffix}"):
        writer = named.fullmatch(tmp.name)
        if writer and writer[1] == socket.gethostname() and not _alive(int(writer[2])):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 digest of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_csv(path: str | os.PathLike, missing: str) -> tuple[list[str], list[dict]]:
    """(column names, rows as dicts) of a CSV file; PipelineError ``missing`` (a sentence
    naming the file) if it does not exist."""
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            rows = list(reader)
            return list(reader.fieldnames or []), rows
    except FileNotFoundError:
        raise PipelineError(missing) from None
