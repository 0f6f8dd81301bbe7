"""Importing the SkyRL 0.4 integration on a Python that SkyRL 0.4 does not support (it declares >= 3.12): the module's
own ImportError, naming the Python needed and the one found, before SkyRL's import reaches pydantic (whose error,
"Please use typing_extensions.TypedDict", names neither). On Python >= 3.12, and below it where `typing.TypedDict`
is the `typing_extensions` one (as tests/support/skyrl04_checks.py makes it), the integration imports.

Fresh interpreters with ``.skyrl04-site`` on PYTHONPATH, as tests/integrations/test_skyrl04.py runs them (a missing
folder is an error, not a skip; BANDPO_SKIP_INTEGRATIONS=1 skips this module)."""
from __future__ import annotations

import json
import os
import platform
import sys

import pytest

if os.environ.get("BANDPO_SKIP_INTEGRATIONS") == "1":
    pytest.skip("BANDPO_SKIP_INTEGRATIONS=1", allow_module_level=True)

from helpers import apart_env, run_fresh  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.subprocess]

SWAP = "import typing, typing_extensions; typing.TypedDict = typing_extensions.TypedDict\n"
CODE = r"""
import json, sys
try:
    import bandpo_lut.integrations.skyrl as bsky
except ImportError as exc:
    out = {"error": str(exc)}
else:
    out = {"package": bsky.SKYRL_PACKAGE}
out["pydantic_imported"] = "pydantic" in sys.modules
out["skyrl_imported"] = "skyrl.backends" in sys.modules
print(json.dumps(out))
"""


def run(code, tmp_path):
    env = apart_env("BANDPO_SKYRL04_SITE", ".skyrl04-site", "skyrl", first=True)
    return json.loads(run_fresh(["-c", code], cwd=tmp_path, env=env, timeout=300, check=True).stdout.splitlines()[-1])


def test_import_names_the_python_needed_before_pydantic(tmp_path):
    out = run(CODE, tmp_path)
    if sys.version_info >= (3, 12):
        assert out.get("package") == "skyrl", out
        return
    error = out.get("error", "")
    assert "needs Python >= 3.12" in error and f"this is Python {platform.python_version()}" in error, out
    assert not out["pydantic_imported"] and not out["skyrl_imported"], out


def test_typing_extensions_typeddict_lets_the_loss_path_import(tmp_path):
    out = run(SWAP + CODE, tmp_path)
    assert out.get("package") == "skyrl", out
