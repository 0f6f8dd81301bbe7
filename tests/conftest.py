"""The test harness, in one place.

* `device`: a test that takes a `device` argument runs once per device: "cpu", and "cuda" (marked `cuda`,
  skipped without a GPU). `pytest -m cuda` on a GPU machine runs only the CUDA half (tools/gpu_check.py does).
* `fresh`: `fresh(argv, ...)` runs `python ARGV...` in a new interpreter from the test's tmp_path (how a user
  meets the package: a first call under compile/export, the CLI). It is `helpers.run_fresh` with the cwd filled
  in; module-level helpers import `run_fresh` / `fresh_env` from `helpers` directly. It is the only subprocess
  runner for Python in the tests.
* `small_blob`: a small generated kl table's bytes (seconds of mpmath, once per session).
* Markers (declared in pyproject.toml): `slow`, `subprocess`, `integration`, `cuda`. `pytest -m "not slow"` is the
  quick loop after an edit (docs/development.md).
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

# The shared test modules (helpers, sample inputs, plug-in check scripts) live in tests/support/;
# every test imports them by their plain names.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

import pytest  # noqa: E402
from helpers import ALL_DEVICES, run_fresh, small_kl_blob  # noqa: E402


@pytest.fixture(params=ALL_DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def fresh(tmp_path):
    """run_fresh with cwd=tmp_path: a neutral folder, so the child imports the installed package, not a checkout."""
    return functools.partial(run_fresh, cwd=tmp_path)


@pytest.fixture(scope="session")
def small_blob() -> bytes:
    """A small but valid generated kl table (helpers.SMALL_KL), made once per session."""
    return small_kl_blob()
