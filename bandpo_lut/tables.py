"""Loading bound tables: the shipped ones (lazily, once per process) or any `.bplut` file.

A `Table` validates its header against the divergence registry and the reader's expectations, and
exposes the grid and coefficient arrays in the forms the readers need (numpy for the generator,
torch tensors cached per device for the kernels and the reference).
"""
from __future__ import annotations

import functools
import math
import os
import threading
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from . import divergences, table_format
from .table_format import TableFormatError

SHIPPED = ("kl", "tv", "chi2", "hellinger")
SUFFIX = ".bplut"


@dataclass(frozen=True)
class Axis:
    min: float
    max: float
    n: int
    step: float

    @classmethod
    def from_header(cls, h: dict, source: str, name: str) -> "Axis":
        try:
            ax = cls(float(h["min"]), float(h["max"]), int(h["n"]), float(h["step"]))
        except (KeyError, TypeError, ValueError):
            raise TableFormatError(f"{source}: grid axis {name!r} is malformed") from None
        if ax.n < 4 or not ax.step > 0 or abs(ax.min + (ax.n - 1) * ax.step - ax.max) > 1e-9 * max(1, abs(ax.max)):
            raise TableFormatError(f"{source}: grid axis {name!r} is inconsistent (min, max, n, step)")
        return ax


@dataclass(eq=False)
class Table:
    """One divergence's bound table, read from a `.bplut` file."""

    source: str
    header: dict
    upper: np.ndarray      # (n_t + 2, n_s + 2) B-spline coefficients of q_up
    lower: np.ndarray      # (n_t + 2, n_s + 2) B-spline coefficients of the lower value (κ or q_lo)
    t: Axis                # t = logit(p)
    s: Axis                # s = log(δ)
    divergence: divergences.Divergence
    _device_cache: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_file(cls, tf: table_format.TableFile, source: str) -> "Table":
        h = tf.header
        name = h["divergence"].get("name") if isinstance(h["divergence"], dict) else None
        if name not in divergences.REGISTRY:
            raise TableFormatError(f"{source}: table is for unknown divergence {name!r}")
        div = divergences.get(name)
        if h["divergence"].get("formula") != div.formula:
            raise TableFormatError(f"{source}: table's f ({h['divergence'].get('formula')!r}) differs from the "
                                   f"registered {name!r} ({div.formula!r})")
        t = Axis.from_header(h["grid"].get("t", {}), source, "t")
        s = Axis.from_header(h["grid"].get("s", {}), source, "s")
        for key in ("upper", "lower"):
            arr = tf.arrays.get(key)
            if arr is None or arr.shape != (t.n + 2, s.n + 2):
                raise TableFormatError(f"{source}: array {key!r} missing or not of shape {(t.n + 2, s.n + 2)}")
        if h["values"].get("lower", {}).get("kind") != div.lower_value:
            raise TableFormatError(f"{source}: lower-bound value kind does not match divergence {name!r}")
        return cls(source, h, tf.arrays["upper"], tf.arrays["lower"], t, s, div)

    # --- δ range ------------------------------------------------------------------------------------
    @property
    def delta_min(self) -> float:
        return float(self.header["delta_range"]["min"])

    @property
    def delta_max(self) -> float:
        return float(self.header["delta_range"]["max"])

    @property
    def delta_max_inclusive(self) -> bool:
        return bool(self.header["delta_range"].get("max_inclusive", True))

    def delta_in_range(self, delta: float) -> bool:
        hi_ok = delta <= self.delta_max if self.delta_max_inclusive else delta < self.delta_max
        return self.delta_min <= delta and hi_ok

    def check_delta(self, delta: float) -> None:
        """Raise a clear error for a Python-number δ outside the table's range."""
        if not (isinstance(delta, (int, float)) and math.isfinite(delta) and self.delta_in_range(float(delta))):
            close = "]" if self.delta_max_inclusive else ")"
            raise ValueError(f"delta: {delta!r} is outside the {self.divergence.name!r} table's range "
                             f"[{self.delta_min:g}, {self.delta_max:g}{close} ({self.source})")

    @property
    def polish_steps(self) -> tuple[int, int]:
        r = self.header.get("refinement", {})
        return int(r.get("upper_newton_steps", 0)), int(r.get("lower_newton_steps", 0))

    # --- tensors ------------------------------------------------------------------------------------
    def coefficients(self, device, dtype=None):
        """(2, n_t+2, n_s+2) tensor [upper, lower] on `device`, created once per (device, dtype)."""
        import torch

        dtype = dtype or torch.float32
        key = (str(torch.device(device)), dtype)
        with self._lock:
            cached = self._device_cache.get(key)
            if cached is None:
                host = torch.from_numpy(np.stack([self.upper, self.lower]).astype(np.float32))
                cached = host.to(device=device, dtype=dtype).contiguous()
                self._device_cache[key] = cached
        return cached


def load(path: str | os.PathLike) -> Table:
    """Read and validate a table file (refusing foreign, corrupt, truncated or too-new files)."""
    return Table.from_file(table_format.read(path), str(path))


def shipped_dir() -> Path:
    """Where the installed tables live (inside the package), else the repository's `tables/`."""
    inside = resources.files("bandpo_lut") / "tables"
    if inside.is_dir() and any(Path(str(inside)).glob("*" + SUFFIX)):
        return Path(str(inside))
    return Path(__file__).resolve().parent.parent / "tables"


def shipped_path(divergence: str) -> Path:
    return shipped_dir() / f"{divergence}{SUFFIX}"


_shipped_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _load_shipped(divergence: str) -> Table:
    path = shipped_path(divergence)
    if not path.exists():
        raise FileNotFoundError(f"divergence: no table shipped for {divergence!r} (looked for {path}); "
                                f"generate one with `bandpo-lut generate --divergence {divergence}` and pass "
                                f"it as table=bandpo_lut.tables.load(PATH)")
    return load(path)


def get(divergence: str) -> Table:
    """The shipped table for `divergence`, loaded on first use and cached for the process."""
    divergences.get(divergence)  # clear error for an unknown name
    with _shipped_lock:
        return _load_shipped(divergence)


def provenance() -> dict:
    """Each shipped table's path, sha256, generator, measured accuracy and δ range (or its load error)."""
    out = {}
    for name in SHIPPED:
        try:
            h = get(name).header
            out[name] = {"path": str(shipped_path(name)), "sha256": h["payload_sha256"], "generator": h["generator"],
                         "accuracy": h.get("accuracy"), "delta_range": h["delta_range"]}
        except (OSError, ValueError) as e:
            out[name] = {"error": str(e)}
    return out
