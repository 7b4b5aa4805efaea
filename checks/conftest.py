"""Checks beyond `make test` that need tools CI does not install (`make go-check`); they use
the suite's fixtures."""

from tests.conftest import *  # noqa: F403 - the same fixtures as the suite
