"""The `.bplut` table file: a versioned, self-describing container for bound tables.

Layout (all integers little-endian):

    magic        10 bytes  b"\\x89BPLUT\\r\\n\\x1a\\n"  (PNG-style: catches text-mode mangling and foreign files)
    version       4 bytes  uint32 format version (FORMAT_VERSION)
    header_len    4 bytes  uint32 length of the header
    header        header_len bytes of UTF-8 JSON in canonical form (keys sorted, no spaces, ASCII), no timestamps
    padding       zero bytes up to a multiple of 16
    payload       the arrays listed in header["arrays"], each at its offset from the payload start

Integrity (format version 2). The header's `file_sha256` is the sha256 of

    magic + version + canonical JSON of the header without `file_sha256` + payload

and the reader also demands that the stored header bytes are exactly the canonical JSON of the header it
parsed and that the padding is zero. So every byte of the file is covered: editing the δ range, a grid
axis, the divergence or any other header field is refused, as is a damaged payload. (Version 1 hashed
the payload only, so an edited header went unnoticed; version 1 files are refused with a message to
regenerate them.) `payload_sha256` identifies the arrays alone, across format versions.

The header carries the provenance (divergence, f, grids, transforms, scheme, precision, versions, measured
accuracy). Writing is atomic (temporary file + rename) and deterministic: the same inputs give
byte-identical files.

`header_field` reads one header field with a type check and a `TableFormatError` that names the file and
the field; `bandpo_lut.tables.store` uses it for the fields that describe the table's contents.
"""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import struct
import tempfile
from dataclasses import dataclass

import numpy as np

MAGIC = b"\x89BPLUT\r\n\x1a\n"
FORMAT_VERSION = 2
_PREFIX = len(MAGIC) + 8
_ALIGN = 16
DTYPES = {"float32": np.dtype("<f4"), "float64": np.dtype("<f8")}
CHECKSUM_KEY = "file_sha256"
_HEX64 = re.compile(r"[0-9a-f]{64}")
# The one interpolation scheme the readers (reference and compiled) implement.
INTERPOLATION_SCHEME = "tensor-product uniform cubic B-spline in (t, s)"


class TableFormatError(ValueError):
    """A table file that is not a valid bandpo_lut table (foreign, truncated, corrupted, edited, malformed,
    of an old format or too new)."""


@dataclass(frozen=True)
class TableFile:
    header: dict
    arrays: dict  # name -> numpy array (read-only)


def _canonical_json(header: dict) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("utf-8")


def _file_sha256(version: int, header: dict, payload: bytes) -> str:
    """The whole-file checksum: magic, version, the header without its checksum field, and the payload."""
    body = {k: v for k, v in header.items() if k != CHECKSUM_KEY}
    h = hashlib.sha256(MAGIC)
    h.update(struct.pack("<I", version))
    h.update(_canonical_json(body))
    h.update(payload)
    return h.hexdigest()


# --- header fields ---------------------------------------------------------------------------------------

_KINDS = {
    "object": (lambda v: isinstance(v, dict), "an object"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
               "a finite number"),
}


def header_field(header, path: str, kind: str, source: str, *, check=None, expect: str | None = None,
                 optional: bool = False):
    """The header value at dotted `path` (e.g. "grid.t.n"), of JSON kind `kind` ("object", "list", "str",
    "bool", "int", "number"), and satisfying `check` (described by `expect`) if given. Raises
    TableFormatError naming `source` and the field when it is missing, of the wrong kind, or fails `check`;
    with `optional`, a missing field gives None."""
    node = header
    parts = path.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, list) and part.isdigit():      # "arrays.0.dtype": an element of a list
            present = int(part) < len(node)
            key = int(part)
        elif isinstance(node, dict):
            present, key = part in node, part
        else:
            where = ".".join(parts[:i]) or "header"
            raise TableFormatError(f"{source}: header field {where!r}: expected an object, "
                                   f"got {_show(node)}")
        if not present:
            if optional:
                return None
            raise TableFormatError(f"{source}: header field {path!r} is missing")
        node = node[key]
    ok, what = _KINDS[kind]
    if not ok(node):
        raise TableFormatError(f"{source}: header field {path!r}: expected {what}, got {_show(node)}")
    if check is not None and not check(node):
        raise TableFormatError(f"{source}: header field {path!r}: expected {expect or 'a valid value'}, "
                               f"got {_show(node)}")
    return node


def _show(value) -> str:
    text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _array_specs(header: dict, source: str) -> list[dict]:
    """header["arrays"], checked: unique names, known dtypes, shapes matching sizes, packed in order."""
    specs = header_field(header, "arrays", "list", source, check=bool, expect="a non-empty list")
    names, offset = set(), 0
    for k in range(len(specs)):
        base = f"arrays.{k}"
        header_field(header, base, "object", source)
        name = header_field(header, base + ".name", "str", source, check=lambda v: v not in names,
                            expect="a name no other array has")
        dtype = header_field(header, base + ".dtype", "str", source, check=lambda v: v in DTYPES,
                             expect=f"one of {sorted(DTYPES)}")
        shape = header_field(header, base + ".shape", "list", source,
                             check=lambda v: all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                 for x in v),
                             expect="a list of non-negative integers")
        header_field(header, base + ".offset", "int", source, check=lambda v: v == offset,
                     expect=f"{offset} (arrays are packed in order)")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize   # Python ints: a crafted shape cannot wrap to 0
        header_field(header, base + ".nbytes", "int", source, check=lambda v: v == nbytes,
                     expect=f"{nbytes} (its shape times its dtype's size)")
        names.add(name)
        offset += nbytes
    return specs


# --- encode / decode -------------------------------------------------------------------------------------

def encode(header: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """Serialise; fills header["arrays"], header["payload_sha256"] and header["file_sha256"] from `arrays`
    (in the given order) and the rest of the header."""
    header = {k: v for k, v in header.items() if k != CHECKSUM_KEY}
    specs, chunks, offset = [], [], 0
    for name, arr in arrays.items():
        dtype_name = next((k for k, v in DTYPES.items() if v == np.dtype(arr.dtype).newbyteorder("<")), None)
        if dtype_name is None:
            raise TypeError(f"array {name!r}: unsupported dtype {arr.dtype}")
        _check_finite(name, np.asarray(arr), "the table being written")
        data = np.ascontiguousarray(arr, dtype=DTYPES[dtype_name]).tobytes()
        specs.append({"name": name, "dtype": dtype_name, "shape": list(arr.shape), "offset": offset,
                      "nbytes": len(data)})
        chunks.append(data)
        offset += len(data)
    payload = b"".join(chunks)
    header["arrays"] = specs
    header["payload_sha256"] = hashlib.sha256(payload).hexdigest()
    header[CHECKSUM_KEY] = _file_sha256(FORMAT_VERSION, header, payload)
    hbytes = _canonical_json(header)
    prefix = MAGIC + struct.pack("<II", FORMAT_VERSION, len(hbytes)) + hbytes
    prefix += b"\0" * (-len(prefix) % _ALIGN)
    return prefix + payload


def _old_version_error(version: int, blob: bytes, hlen: int, source: str) -> TableFormatError:
    """Version 1 files: say to regenerate, with the command their header records when it can be read."""
    command = None
    try:
        old = json.loads(blob[_PREFIX: _PREFIX + hlen].decode("utf-8"))
        command = old["generator"]["command"]
        name = old["divergence"]["name"]
        if not (isinstance(command, str) and isinstance(name, str)):
            command = None
    except Exception:  # an unreadable old header only loses the suggested command
        command = None
    how = (f"`{command} --out {source}`" if command else "`bandpo-lut generate --divergence NAME --out FILE`")
    return TableFormatError(
        f"{source}: table format version {version} is no longer read (its checksum covered the payload but "
        f"not the header, so an edited header went unnoticed); this bandpo_lut reads version "
        f"{FORMAT_VERSION}: regenerate the table with {how}")


def decode(blob: bytes, source: str = "<bytes>") -> TableFile:
    """Parse and validate; raises TableFormatError naming `source` and what is wrong."""
    if len(blob) < _PREFIX or blob[: len(MAGIC)] != MAGIC:
        raise TableFormatError(f"{source}: not a bandpo_lut table (bad magic bytes; foreign or truncated file)")
    version, hlen = struct.unpack_from("<II", blob, len(MAGIC))
    if version > FORMAT_VERSION:
        raise TableFormatError(f"{source}: table format version {version} is newer than this bandpo_lut "
                               f"supports ({FORMAT_VERSION}); upgrade bandpo_lut or regenerate the table")
    if version < 1:
        raise TableFormatError(f"{source}: invalid table format version {version}")
    if version < FORMAT_VERSION:
        raise _old_version_error(version, blob, hlen, source)
    if _PREFIX + hlen > len(blob):
        raise TableFormatError(f"{source}: truncated table (header needs {hlen} bytes, file has "
                               f"{len(blob) - _PREFIX})")
    hbytes = blob[_PREFIX: _PREFIX + hlen]
    try:
        header = json.loads(hbytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TableFormatError(f"{source}: corrupt table header ({e})") from None
    if not isinstance(header, dict):
        raise TableFormatError(f"{source}: corrupt table header (a JSON {type(header).__name__}, not an object)")
    stored = header_field(header, CHECKSUM_KEY, "str", source, check=_HEX64.fullmatch,
                          expect="64 lowercase hexadecimal digits")
    pstart = _PREFIX + hlen + (-(_PREFIX + hlen) % _ALIGN)
    payload = blob[pstart:]
    try:
        canonical = _canonical_json(header) == hbytes
    except ValueError:  # NaN or infinity in the header: never written by `encode`
        canonical = False
    if not canonical:
        raise TableFormatError(f"{source}: the table header was edited: it is not the byte-exact form the "
                               "writer produces (file_sha256 covers the header); restore or regenerate the table")
    if any(blob[_PREFIX + hlen: pstart]):
        raise TableFormatError(f"{source}: corrupt table: non-zero padding between header and payload")
    if _file_sha256(version, header, payload) != stored:
        raise TableFormatError(f"{source}: {_why_checksum_fails(header, payload, source)}; restore the file "
                               "or regenerate the table")
    for key in ("format", "divergence", "grid", "delta_range", "values", "interpolation", "refinement",
                "generator"):
        header_field(header, key, "object", source)
    header_field(header, "format.version", "int", source, check=lambda v: v == version,
                 expect=f"{version}, the file's format version")
    header_field(header, "payload_sha256", "str", source, check=lambda v: v == hashlib.sha256(payload).hexdigest(),
                 expect="the payload's sha256")
    specs = _array_specs(header, source)
    total = sum(s["nbytes"] for s in specs)
    if len(payload) != total:
        raise TableFormatError(f"{source}: payload has {len(payload)} bytes, header declares {total}")
    arrays = {}
    for spec in specs:
        dt = DTYPES[spec["dtype"]]
        shape = tuple(spec["shape"])
        count = math.prod(shape)
        arrays[spec["name"]] = np.frombuffer(payload, dtype=dt, count=count, offset=spec["offset"]).reshape(shape)
        _check_finite(spec["name"], arrays[spec["name"]], source)
    return TableFile(header=header, arrays=arrays)


def _check_finite(name: str, arr: np.ndarray, source: str) -> None:
    """A table's coefficients are numbers: a NaN or an infinity among them gives NaN bounds wherever a read touches
    it, which no checksum or monotonicity test sees (NaN compares false). Refused when a table is written and read."""
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        bad = np.argwhere(~np.isfinite(arr))
        raise TableFormatError(f"{source}: array {name!r} holds {len(bad)} non-finite values (the first at index "
                               f"{tuple(int(i) for i in bad[0])}: {arr[tuple(bad[0])]}); a table's coefficients must "
                               "be finite numbers")


def _why_checksum_fails(header: dict, payload: bytes, source: str) -> str:
    """The most specific reason for a file_sha256 mismatch: truncation, a damaged payload or an edited header."""
    try:
        total = sum(int(s["nbytes"]) for s in header["arrays"])
    except Exception:  # a header too broken to declare sizes: the checksum message below still holds
        total = None
    if total is not None and len(payload) != total:
        kind = "truncated" if len(payload) < total else "corrupt (trailing bytes)"
        return f"{kind} table: payload has {len(payload)} bytes, header declares {total} (file_sha256 mismatch)"
    if header.get("payload_sha256") != hashlib.sha256(payload).hexdigest():
        return "corrupt table: the payload's sha256 does not match its header (damaged on disk or in transfer)"
    return ("the table was edited after it was written: file_sha256, which covers the whole header and the "
            "payload, does not match (the payload matches payload_sha256, so the header was changed)")


def read(path: str | os.PathLike) -> TableFile:
    with open(path, "rb") as fh:
        return decode(fh.read(), source=str(path))


def check_writable(path: str | os.PathLike) -> None:
    """Raise OSError now if `write_atomic(path, ...)` could not write there (a directory in the way, a
    missing or read-only folder), by creating and removing a temporary file beside `path`. Missing parent
    folders are created, as `write_atomic` would."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "it is a folder", path)
    if path.endswith(os.sep) or (os.altsep and path.endswith(os.altsep)):
        raise IsADirectoryError(errno.EISDIR, "it names a folder (it ends in a separator), not a file", path)
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(errno.ENOTDIR, f"{directory} is not a folder", path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".bplut", dir=directory)
    os.close(fd)
    os.unlink(tmp)


def write_beside(path: str | os.PathLike, blob: bytes, mode: int) -> str:
    """Write `blob` to a new temporary file in `path`'s folder (made if missing), fsynced, with permission bits
    `mode`, and return its name: the first half of a write that never shows a reader half a file (the second:
    a rename or a link onto `path`). Nothing is left behind when it fails."""
    directory = os.path.dirname(os.path.abspath(os.fspath(path)))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".bplut", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(blob)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def write_atomic(path: str | os.PathLike, blob: bytes, mode: int = 0o644) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it: readers never see half a file.
    The file gets permission bits `mode` (a replaced file's own, to keep them)."""
    tmp = write_beside(path, blob, mode)
    try:
        os.replace(tmp, os.fspath(path))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
