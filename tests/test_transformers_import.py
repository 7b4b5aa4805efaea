"""engine_service/transformers_import.py: transformers' scan of its model folders, kept.

The kept table is the one transformers builds itself (compared in fresh interpreters), a
changed file or a damaged cache means a new scan, and a cache that cannot be written costs
nothing but the scan. The last test fails when transformers stops scanning twice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from engine_service.transformers_import import KeptScan, cache_dir
from tests.servers import ROOT

# The lazy tables of `transformers` and `transformers.models`, hashed, in a fresh interpreter.
TABLES = """
import hashlib, sys
if sys.argv[1] == "kept":
    import engine_service
import transformers, transformers.models as models
from transformers.utils import import_utils
def table(module):
    return (sorted(module._class_to_module.items()), sorted(module._modules))
scanner = import_utils.create_import_structure_from_path
print(hashlib.sha256(repr((table(transformers), table(models))).encode()).hexdigest(),
      type(scanner).__name__, getattr(scanner, "kept_on_disk", None))
"""


def _tables(mode: str, cache: Path) -> list[str]:
    ran = subprocess.run(
        [sys.executable, "-c", TABLES, mode],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "TANDEM_CACHE_DIR": str(cache)},
    )
    return ran.stdout.split()


def test_the_kept_table_is_the_one_transformers_builds(tmp_path: Path) -> None:
    plain = _tables("plain", tmp_path)
    first = _tables("kept", tmp_path)  # scans, and writes the cache
    assert list(tmp_path.glob("transformers-import-*.marshal"))
    second = _tables("kept", tmp_path)  # reads it
    assert plain[1] == "_lru_cache_wrapper" and first[1] == second[1] == "KeptScan"
    assert plain[0] == first[0] == second[0]
    assert first[2] == second[2] == "True"


class Folders:
    """A folder tree and a scanner shaped like transformers' (it recurses by its global
    name: here, through the KeptScan), counting the folders it reads."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for name in ("a", "b", "b/c"):
            (root / name).mkdir(parents=True)
            (root / name / f"{Path(name).name}.py").write_text("__all__ = []\n")
        (root / "__init__.py").write_text("")
        self.read: list[str] = []

    def scanner(self) -> KeptScan:
        kept: KeptScan

        def scan(path: Any) -> dict[str, Any]:
            folder = os.fspath(path)
            if os.path.isfile(folder):
                folder = os.path.dirname(folder)
            self.read.append(folder)
            table: dict[str, Any] = {}
            for entry in sorted(os.scandir(folder), key=lambda e: e.name):
                if entry.is_dir():
                    table[entry.name] = kept(entry.path)
                else:
                    table[entry.name] = frozenset({entry.name})
            return table

        kept = KeptScan(scan, str(self.root), "1.0")
        return kept


def test_a_second_process_reads_no_folder_and_a_changed_file_means_a_new_scan(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    tree = Folders(tmp_path / "models")
    first = tree.scanner()(tree.root)
    assert len(tree.read) == 4 and first["b"]["c"] == {"c.py": frozenset({"c.py"})}
    tree.read.clear()
    again = tree.scanner()  # a new process: its memory is empty, the disk is not
    assert again(tree.root) == first
    assert again(str(tree.root / "__init__.py")) == first  # transformers' second call
    assert tree.read == [str(tree.root)]  # the top folder's own files only: all else kept

    (tree.root / "b" / "c" / "c.py").write_text("__all__ = ['C']\n")
    os.utime(tree.root / "b" / "c" / "c.py", ns=(1, 1))
    tree.read.clear()
    assert tree.scanner()(tree.root) == first
    assert len(tree.read) == 4  # the fingerprint changed: everything read again


def test_a_damaged_or_unwritable_cache_costs_only_the_scan(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    tree = Folders(tmp_path / "models")
    want = tree.scanner()(tree.root)
    folder = cache_dir()
    assert folder is not None
    (kept_file,) = folder.glob("*.marshal")
    kept_file.write_bytes(kept_file.read_bytes()[:100])  # cut short
    tree.read.clear()
    assert tree.scanner()(tree.root) == want and len(tree.read) == 4

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(blocked / "cache"))  # cannot be a folder
    tree.read.clear()
    scanner = tree.scanner()
    assert scanner(tree.root) == want and len(tree.read) == 4
    assert not scanner.kept_on_disk

    monkeypatch.delenv("TANDEM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # ignored, as XDG says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "tandem"
    monkeypatch.setenv("HOME", "relative-home")  # no home: never a folder under the cwd
    assert cache_dir() is None
    tree.read.clear()
    scanner = tree.scanner()
    assert scanner(tree.root) == want and len(tree.read) == 4 and not scanner.kept_on_disk


def test_transformers_still_scans_its_model_folders_twice() -> None:
    """When this fails, transformers' own cache holds all its folders: the second scan is
    free without us, and only the kept table is left to weigh against its code."""
    probe = (
        "import os, transformers;"
        "from transformers.utils import import_utils as u;"
        "root = os.path.join(os.path.dirname(transformers.__file__), 'models');"
        "folders = sum(1 for _ in os.walk(root));"
        "print(u.create_import_structure_from_path.cache_info().maxsize, folders)"
    )
    ran = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    maxsize, folders = ran.stdout.split()
    assert maxsize != "None" and int(maxsize) < int(folders)
