"""The packages whose names load on first use (``kvstore.tiers``, ``kvstore.workers``) export what they list."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("package", ["kvstore.tiers", "kvstore.workers"])
def test_every_listed_name_loads_from_its_module_and_nothing_else_does(package: str) -> None:
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(module._EXPORTS)
    for name, source in module._EXPORTS.items():
        assert getattr(module, name) is getattr(importlib.import_module(source), name)
    with pytest.raises(AttributeError, match="no attribute 'Missing'"):
        module.Missing  # noqa: B018
