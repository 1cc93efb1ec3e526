"""Fixtures for the client tests: builtin:tiny's tokenizer (no model build) and its files."""

from __future__ import annotations

from typing import Any

import pytest

from tests.client.client_fakes import tiny_tokenizer_files


@pytest.fixture(scope="session")
def tokenizer_files() -> dict[str, bytes]:
    return tiny_tokenizer_files()


@pytest.fixture(scope="session")
def tokenizer(tokenizer_files: dict[str, bytes]) -> Any:
    from jetctl.models import tokenizer_from_files

    return tokenizer_from_files(tokenizer_files)
