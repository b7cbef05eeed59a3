"""What one simulation's job does, as a batch stage's job returns it (core: imports nothing of the
project). The batch runner (workflow.batch) decides from it whether the work is needed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Task:
    """One simulation's work: ``write(provenance)`` writes ``output`` atomically, storing the
    ``provenance`` string as its HDF5 attribute of that name."""

    output: Path
    write: Callable[[str], object]
    inputs: tuple[Path, ...] = ()
    """Files the output is made from: a newer one redoes it; a missing one is regenerated."""
