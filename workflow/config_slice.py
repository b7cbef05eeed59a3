"""The keys of the configuration that one stage declares (workflow/stages.py), as a read-only
view that records what its job reads (core: imports nothing of the project)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping


def select_keys(config: Mapping, keys: tuple[str, ...]) -> dict:
    """``{section: {key: value}}`` holding exactly the dotted ``keys`` of ``config`` (copies)."""
    out: dict = {}
    for key in keys:
        *parents, leaf = key.split(".")
        source, target = config, out
        for part in parents:
            source = source[part]
            target = target.setdefault(part, {})
        target[leaf] = copy.deepcopy(source[leaf])
    return out


class ConfigSlice(Mapping):
    """A read-only view of the keys one stage declared; it records what the job reads.

    ``config["simulation"]["n_steps"]`` works as on the full configuration; a key outside the
    slice raises KeyError naming the stage and the key (declare it in workflow/stages.py).
    """

    def __init__(self, stage: str, data: Mapping, prefix: str = "", reads: set | None = None):
        self._stage, self._data, self._prefix = stage, data, prefix
        self.reads = set() if reads is None else reads
        """Dotted keys read so far (leaves; a whole section read as a mapping counts as all of it)."""

    def __getitem__(self, key: str):
        path = f"{self._prefix}{key}"
        if key not in self._data:
            raise KeyError(f"stage '{self._stage}' reads config key '{path}', which it does not "
                           f"declare in workflow/stages.py")
        value = self._data[key]
        if isinstance(value, Mapping):
            return ConfigSlice(self._stage, value, f"{path}.", self.reads)
        self.reads.add(path)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def plain(self) -> dict:
        """A plain dict of the whole slice (read in full: every key counts as read)."""
        return {key: value.plain() if isinstance(value, ConfigSlice) else value
                for key, value in self.items()}

    def as_declared(self) -> Mapping:
        """The declared keys and values, without recording any read (for provenance records)."""
        return self._data
