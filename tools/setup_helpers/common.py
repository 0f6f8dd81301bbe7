"""What every setup helper shares: the error type that refuses a build, env flags, a command runner."""
from __future__ import annotations

import re
import subprocess


class BuildConfigError(Exception):
    """The build cannot go ahead as configured; the message says why and what to do."""


def env_flag(env: dict, name: str) -> bool:
    """True when env[name] is set to 1/true/yes/on (case-insensitive)."""
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def major_of(version: str | None) -> int | None:
    """Leading integer of a version string ("13.0" -> 13, "2.14.1+cu130" -> 2), None if absent."""
    match = re.match(r"\s*(\d+)", version or "")
    return int(match.group(1)) if match else None


def run(cmd: list[str]) -> str:
    """stdout of cmd; raises OSError / CalledProcessError (the helpers take it as an argument so tests can fake it)."""
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
