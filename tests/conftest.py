"""Shared fixtures."""

from __future__ import annotations

import pytest

from tests.factories import make_group


@pytest.fixture
def group_factory():  # type: ignore[no-untyped-def]
    return make_group
