"""transformers' import made cheaper: its scan of its own model folders, done once and kept.

Every process that imports mlx-lm imports transformers (mlx-lm's tokenizer module does), and
importing transformers builds its lazy import table by reading every file under
`transformers/models/` (2,600 files in 567 folders in 5.25), ~0.55 s of CPU. mlx-lm then
imports `transformers.models`, which builds the same table again through an `lru_cache` of
128 entries that 567 folders overflow, so every lookup misses and the second scan costs as
much as the first. The engine's front and its core each paid both: ~2.2 s of CPU of an
engine start of ~5 s, measured with the warm-up off, where the rest is mostly other
imports.

Here the scanner gets an unbounded cache (the second scan becomes hits), and the table is
kept on disk between processes, under a fingerprint of every file it was read from (path,
size, modification time: a stat walk of ~30 ms), transformers' version and Python's: any
change to the files, an upgrade, another interpreter, and it is read again. Stored with
`marshal` (dicts, sets and strings only: loading it runs nothing). A cache that cannot be
read or written is ignored; the scan is a pure function of the files, so the worst a
stale-looking cache can do is cost the scan.

No setting of transformers changes either; the scanner is looked up by name at each call,
so replacing the module's global is enough. That has to happen after
`transformers/utils/import_utils.py` runs and before `transformers` goes on to scan, hence
the import hook. `install()` runs from engine_service/__init__.py, next to the BLAS preload.
tests/test_upstream_fixes.py fails when transformers no longer needs this: then drop it.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import marshal
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["SCANNER", "KeptScan", "cache_dir", "install"]

_MODULE = "transformers.utils.import_utils"
SCANNER = "create_import_structure_from_path"
_FORMAT = 1


def cache_dir() -> Path | None:
    """Where the kept scan lives: $TANDEM_CACHE_DIR, else the user's cache folder; None when
    there is no home to put it in (never a folder relative to wherever the process runs)."""
    explicit = os.environ.get("TANDEM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # unset, or relative (which XDG says to ignore)
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem" if os.path.isabs(base) else None


def _fingerprint(root: str, version: str) -> str:
    """Every file under `root`: its path, size and modification time, hashed."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{_FORMAT}\0{version}\0{sys.version}\0{root}\n".encode())
    folders = [root]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.is_dir():
                    if entry.name != "__pycache__":
                        folders.append(entry.path)
                else:
                    stat = entry.stat()
                    digest.update(f"{entry.path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


class KeptScan:
    """transformers' folder scanner, remembered in this process and kept on disk for
    `models/` (the folder behind almost all of the cost)."""

    def __init__(self, original: Callable[[Any], Any], models_root: str, version: str) -> None:
        self.original = original
        self.models_root = models_root
        self.version = version
        self.memo: dict[Any, Any] = {}  # keyed like upstream's lru_cache: the argument itself
        self.loaded_from_disk = False  # tried
        self.kept_on_disk = False  # the disk had it, or it has been written there

    def __call__(self, module_path: Any) -> Any:
        try:
            return self.memo[module_path]
        except (KeyError, TypeError):
            pass
        folder = os.fspath(module_path)
        if os.path.isfile(folder):
            folder = os.path.dirname(folder)
        if folder == self.models_root and not self.loaded_from_disk:
            self._load()
            if folder in self.memo:
                self.memo[module_path] = self.memo[folder]
                return self.memo[module_path]
        result = self.original(module_path)  # its recursion comes back through here
        self.memo[module_path] = result
        if folder == self.models_root and not self.kept_on_disk:
            self._save()
        return result

    def _file(self) -> Path:
        folder = cache_dir()
        if folder is None:
            raise OSError("no cache folder")
        name = hashlib.blake2b(self.models_root.encode(), digest_size=8).hexdigest()
        return folder / f"transformers-import-{name}.marshal"

    def _load(self) -> None:
        self.loaded_from_disk = True
        try:
            kept = marshal.loads(self._file().read_bytes())
            if kept["fingerprint"] != _fingerprint(self.models_root, self.version):
                return
            entries = kept["entries"]
            if isinstance(entries, dict) and self.models_root in entries:
                self.memo.update(entries)
                self.kept_on_disk = True
        except (OSError, ValueError, EOFError, TypeError, KeyError):
            return  # absent, unreadable or another format: scan

    def _save(self) -> None:
        entries = {
            os.fspath(path): result
            for path, result in self.memo.items()
            if os.fspath(path).startswith(self.models_root)
        }
        try:
            data = marshal.dumps(
                {"fingerprint": _fingerprint(self.models_root, self.version), "entries": entries}
            )
            target = self._file()
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=target.name)
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                os.replace(temporary, target)  # whole or not at all, for concurrent starts
                self.kept_on_disk = True
            except OSError:
                os.unlink(temporary)
                raise
        except (OSError, ValueError):
            return  # read-only home, full disk: the next start scans again


def kept(module: ModuleType) -> KeptScan | None:
    """Puts a KeptScan in place of `module`'s scanner; None where transformers changed shape."""
    scanner = getattr(module, SCANNER, None)
    if isinstance(scanner, KeptScan):
        return scanner
    original = getattr(scanner, "__wrapped__", None)
    package = sys.modules.get("transformers")
    if original is None or not hasattr(scanner, "cache_info") or package is None:
        return None
    models_root = os.path.join(os.path.dirname(package.__file__ or ""), "models")
    version = str(getattr(package, "__version__", "") or _version())
    replacement = KeptScan(original, models_root, version)
    setattr(module, SCANNER, replacement)
    return replacement


def _version() -> str:
    from importlib.metadata import version

    return version("transformers")


class _KeepingLoader(importlib.abc.Loader):
    """transformers' own loader, with the scanner replaced once the module has run."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        kept(module)

    def __getattr__(self, name: str) -> Any:  # get_source etc., for tracebacks
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)  # once
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _KeepingLoader(spec.loader)
        return spec


def install() -> None:
    """Before transformers is imported: its scanner is replaced as it loads."""
    module = sys.modules.get(_MODULE)
    if module is not None:
        kept(module)  # too late for this process's first scan, in time for the second
    elif not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
