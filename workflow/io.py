"""Shared file primitives: atomic writes and checksums.

Every stage writes its outputs through :func:`atomic_path`, so an interrupted job
never leaves a file that looks complete (DESIGN.md, "Run directory").
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

from workflow.errors import PipelineError

_CHUNK_BYTES = 4 * 1024 * 1024


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it to ``path`` on success.

    The caller writes the complete file to the yielded path. If the block raises
    (including ``OSError`` for a full disk), the temporary file is removed and
    ``path`` is left as it was. Parent directories are created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
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
