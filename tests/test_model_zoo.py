"""Every architecture of the model zoo through the engine's core, against mlx-lm and the
committed support matrix (docs/models.md). The zoo is split in two files so that the test
command's two workers share it; tests/test_model_zoo_more.py holds the second half."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.model_zoo import ZOO
from tests.servers import serve_store
from tests.zoo_checks import ZooRow, check_architecture, committed_rows

DOC = Path(__file__).resolve().parent.parent / "docs" / "models.md"
HALF = sorted(ZOO)[: len(ZOO) // 2]


@pytest.fixture(scope="module")
def zoo_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real store, in this process, for the zoo's checkpoints and prefixes."""
    with serve_store(tmp_path_factory.mktemp("zoo") / "store") as served:
        yield served.address


def check_against_the_matrix(arch: str, root: Path, store: str) -> None:
    row = check_architecture(arch, root / "models", root / "data", store)
    committed = committed_rows(DOC)
    assert arch in committed, f"{arch} is not in docs/models.md: run scripts/model_matrix.py"
    for column, got, want in zip(ZooRow.columns(), row.cells(), committed[arch], strict=True):
        assert got == want, (
            f"{arch} {column}: measured {got!r}, docs/models.md says {want!r} "
            "(run scripts/model_matrix.py if the change is intended)"
        )


@pytest.mark.parametrize("arch", HALF)
def test_architecture_serves_as_the_matrix_says(
    arch: str, tmp_path_factory: pytest.TempPathFactory, zoo_store: str
) -> None:
    check_against_the_matrix(arch, tmp_path_factory.getbasetemp() / "zoo-models", zoo_store)
