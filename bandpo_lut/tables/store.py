"""Loading bound tables: the shipped ones (lazily, once per process) or any `.bplut` file.

A `Table` validates its header against the divergence registry and the reader's expectations, and
exposes the grid and coefficient arrays in the forms the readers need (numpy for the generator,
torch tensors cached per device for the kernels and the reference).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import stat
import struct
import threading
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from bandpo_lut.tables import checks, divergences, table_format
from bandpo_lut.tables.table_format import TableFormatError

SHIPPED = ("kl", "tv", "chi2", "hellinger")
SUFFIX = ".bplut"


@contextlib.contextmanager
def ordinary_tensor_scope():
    """Tensors made here for a process-wide cache are ordinary ones, whatever the context of the call that
    fills it: every dispatch mode off (FakeTensorMode, the proxy modes of export/make_fx), inference mode
    off (an inference tensor could never be saved for a later backward), the torch.jit tracer paused (a
    first call under torch.jit.trace must record the same graph as later ones)."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    tracing = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        with _disable_current_modes(), torch.inference_mode(False):
            yield
    finally:
        torch._C._set_tracing_state(tracing)


@dataclass(frozen=True)
class Axis:
    min: float
    max: float
    n: int
    step: float

    @classmethod
    def from_header(cls, header: dict, source: str, name: str) -> "Axis":
        """The grid axis header["grid"][name], checked: n >= 4 nodes, a positive step, min + (n-1)·step = max."""
        def f(key, kind, **kw):
            return table_format.header_field(header, f"grid.{name}.{key}", kind, source, **kw)

        table_format.header_field(header, f"grid.{name}", "object", source)
        ax = cls(float(f("min", "number")), float(f("max", "number")),
                 f("n", "int", check=lambda v: v >= 4, expect="an integer >= 4"),
                 float(f("step", "number", check=lambda v: v > 0, expect="a positive number")))
        if abs(ax.min + (ax.n - 1) * ax.step - ax.max) > 1e-9 * max(1, abs(ax.max)):
            fields = ", ".join(f"'grid.{name}.{k}'" for k in ("min", "max", "n", "step"))
            raise TableFormatError(f"{source}: header fields {fields} disagree: min + (n - 1) * step = "
                                   f"{ax.min + (ax.n - 1) * ax.step!r}, but max = {ax.max!r}")
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
        """Check every header field a reader uses (names, types, and agreement with the divergence registry
        and with each other); raises TableFormatError naming `source` and the field."""
        h = tf.header

        def f(path, kind, **kw):
            return table_format.header_field(h, path, kind, source, **kw)

        name = f("divergence.name", "str")
        if name not in divergences.REGISTRY:
            raise TableFormatError(f"{source}: header field 'divergence.name': table is for unknown divergence "
                                   f"{name!r} (known: {divergences.names()})")
        div = divergences.get(name)
        f("divergence.formula", "str", check=lambda v: v == div.formula,
          expect=f"the registered {name!r} f, {div.formula!r}")
        d_min = f("delta_range.min", "number", check=lambda v: v > 0, expect="a positive number")
        f("delta_range.max", "number", check=lambda v: v > d_min, expect=f"a number above delta_range.min ({d_min!r})")
        f("delta_range.max_inclusive", "bool")
        t = Axis.from_header(h, source, "t")
        s = Axis.from_header(h, source, "s")
        for end in ("min", "max"):
            want = math.log(h["delta_range"][end])
            if abs(getattr(s, end) - want) > 1e-12 * max(1.0, abs(want)):
                raise TableFormatError(f"{source}: header fields 'grid.s.{end}' and 'delta_range.{end}' disagree: "
                                       f"grid.s.{end} = {getattr(s, end)!r}, but log(delta_range.{end}) = {want!r}")
        f("values.upper.kind", "str", check=lambda v: v == "q", expect="'q' (the readers store q_up = p*r_up)")
        f("values.lower.kind", "str", check=lambda v: v == div.lower_value,
          expect=f"{div.lower_value!r}, the lower value of divergence {name!r}")
        f("interpolation.scheme", "str", check=lambda v: v == table_format.INTERPOLATION_SCHEME,
          expect=f"{table_format.INTERPOLATION_SCHEME!r}, the scheme the readers implement")
        for key in ("upper_newton_steps", "lower_newton_steps"):
            f(f"refinement.{key}", "int", check=lambda v: 0 <= v <= 16, expect="an integer in [0, 16]")
        dtype = f("storage_dtype", "str", check=lambda v: v in table_format.DTYPES,
                  expect=f"one of {sorted(table_format.DTYPES)}")
        for key in ("name", "version", "command"):
            f(f"generator.{key}", "str")
        if f("accuracy", "object", optional=True) is not None:
            f("accuracy.tolerance", "number", check=lambda v: v >= 0, expect="a non-negative number",
              optional=True)
        for key in ("upper", "lower"):
            arr = tf.arrays.get(key)
            if arr is None or arr.shape != (t.n + 2, s.n + 2):
                got = "missing" if arr is None else f"of shape {arr.shape}"
                raise TableFormatError(f"{source}: array {key!r} is {got}; the grid needs shape {(t.n + 2, s.n + 2)}")
            if arr.dtype != table_format.DTYPES[dtype]:
                raise TableFormatError(f"{source}: array {key!r} is {arr.dtype.name}, but header field "
                                       f"'storage_dtype' says {dtype}")
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

    def delta_in_range(self, delta):
        """Whether δ is in the table's range (element-wise for a tensor; see `checks.in_delta_range`)."""
        return checks.in_delta_range(delta, self.delta_min, self.delta_max, self.delta_max_inclusive)

    def check_delta(self, delta: float) -> None:
        """Raise a clear error for a number δ outside the table's range."""
        checks.check_delta(delta, self.divergence.name, self.delta_min, self.delta_max, self.delta_max_inclusive,
                           self.source)

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
        with self._lock, ordinary_tensor_scope():
            cached = self._device_cache.get(key)
            if cached is None:
                host = torch.from_numpy(np.stack([self.upper, self.lower]).astype(np.float32))
                cached = host.to(device=device, dtype=dtype).contiguous()
                self._device_cache[key] = cached
        return cached


# The largest file `load` reads. The costliest table `generate` makes without --allow-expensive holds about 4e6
# coefficients per array, 64 MB in float64: a file 16 times that is not a table, and is refused unread.
MAX_FILE_BYTES = 2 ** 30


def read_checked(path: str | os.PathLike) -> table_format.TableFile:
    """`table_format.read`, with what can be told from the first bytes and the file's size checked before the
    rest is read: a foreign file (its magic bytes), a header longer than the file, a file past MAX_FILE_BYTES,
    something that is not a regular file (a FIFO would block the read)."""
    source = str(path)
    if not stat.S_ISREG(os.stat(path).st_mode):     # before opening: opening a FIFO waits for a writer
        raise TableFormatError(f"{source}: not a regular file, so not a bandpo_lut table")
    with open(path, "rb") as fh:
        info = os.fstat(fh.fileno())
        prefix = fh.read(len(table_format.MAGIC) + 8)
        if len(prefix) < len(table_format.MAGIC) + 8 or not prefix.startswith(table_format.MAGIC):
            table_format.decode(prefix, source)         # raises its bad-magic error
        if info.st_size > MAX_FILE_BYTES:
            raise TableFormatError(f"{source}: {info.st_size} bytes, past the {MAX_FILE_BYTES} bytes a "
                                   "bandpo_lut table can have (the header is right, the file is not a table: "
                                   "damaged, or data appended to it); not read")
        version, header_len = struct.unpack_from("<II", prefix, len(table_format.MAGIC))
        if version == table_format.FORMAT_VERSION and len(prefix) + header_len > info.st_size:
            raise TableFormatError(f"{source}: truncated table (header needs {header_len} bytes, file has "
                                   f"{info.st_size - len(prefix)})")
        return table_format.decode(prefix + fh.read(), source)


def load(path: str | os.PathLike, divergence: str | None = None) -> Table:
    """Read and validate a table file (refusing foreign, corrupt, truncated, edited, old-format, too-new or
    oversized files; the size before the file is read). With `divergence`, the file must hold that divergence's
    table."""
    table = Table.from_file(read_checked(path), str(path))
    if divergence is not None and table.divergence.name != divergence:
        raise TableFormatError(f"{path}: expected the {divergence!r} table, found the {table.divergence.name!r} "
                               f"table (header field 'divergence.name'; another divergence's file copied over "
                               f"this one?); restore it or regenerate it with `bandpo-lut generate --divergence "
                               f"{divergence} --out {path}`")
    return table


def shipped_dir() -> Path:
    """Where the installed tables live (`bandpo_lut/tables/data/`, where setup.py ships the repository's
    `tables/*.bplut`), else the repository's `tables/` (an editable install or a checkout)."""
    inside = resources.files(__package__) / "data"
    if inside.is_dir() and any(Path(str(inside)).glob("*" + SUFFIX)):
        return Path(str(inside))
    return Path(__file__).resolve().parents[2] / "tables"


def shipped_path(divergence: str) -> Path:
    return shipped_dir() / f"{divergence}{SUFFIX}"


_shipped_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _load_shipped(divergence: str) -> Table:
    path = shipped_path(divergence)
    if not path.exists():
        raise FileNotFoundError(
            f"divergence: no table for {divergence!r} (looked for {path}). Generate it with `bandpo-lut generate "
            f"--divergence {divergence} --out {path}` (the package's table folder, read by bandpo_lut.tables.store.get "
            f"and the compiled ops), or generate it anywhere and read it with the reference reader: "
            f"bandpo_lut.reference.bounds(..., table=bandpo_lut.tables.store.load(PATH))")
    return load(path, divergence)


def get(divergence: str) -> Table:
    """The shipped table for `divergence`, loaded on first use and cached for the process; the file must hold
    that divergence's table."""
    divergences.get(divergence)  # clear error for an unknown name
    with _shipped_lock:
        return _load_shipped(divergence)


def provenance() -> dict:
    """Each shipped table's path, whole-file sha256 (`sha256`, the header's file_sha256: it covers the header
    and the payload), payload sha256, generator, measured accuracy and δ range (or its load error)."""
    out = {}
    for name in SHIPPED:
        try:
            h = get(name).header
            out[name] = {"path": str(shipped_path(name)), "sha256": h[table_format.CHECKSUM_KEY],
                         "payload_sha256": h["payload_sha256"], "format_version": h["format"]["version"],
                         "generator": h["generator"], "accuracy": h.get("accuracy"), "delta_range": h["delta_range"]}
        except (OSError, ValueError) as e:
            out[name] = {"error": str(e)}
    return out
