"""The model zoo's second half (tests/test_model_zoo.py says why it is split)."""

from __future__ import annotations

import pytest

from tests.model_zoo import ZOO
from tests.test_model_zoo import HALF, check_against_the_matrix, zoo_store  # noqa: F401

OTHER_HALF = sorted(set(ZOO) - set(HALF))


@pytest.mark.parametrize("arch", OTHER_HALF)
def test_architecture_serves_as_the_matrix_says(
    arch: str,
    tmp_path_factory: pytest.TempPathFactory,
    zoo_store: str,  # noqa: F811
) -> None:
    check_against_the_matrix(arch, tmp_path_factory.getbasetemp() / "zoo-models", zoo_store)
