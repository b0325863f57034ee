"""The test helpers beside `tests/conftest.py` are importable by their bare names too (pytest puts `tests/` on
`sys.path` for that conftest), so none may share a name with an installed package's top-level module: a helper
named `kernels.py` hid HF's `kernels` package from `transformers` (which imports it when installed) and broke the
collection of every test that imports `peft` on a fresh machine."""

from __future__ import annotations

import importlib.metadata
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_no_helper_module_shadows_an_installed_package() -> None:
    installed = set(importlib.metadata.packages_distributions())
    helpers = {path.stem for path in TESTS.glob("*.py")} - {"conftest"}
    assert "kernel_checks" in helpers  # the glob sees the helpers
    assert sorted(helpers & installed) == []
