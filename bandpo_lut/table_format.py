"""The `.bplut` table file: a versioned, self-describing container for bound tables.

Layout (all integers little-endian):

    magic        10 bytes  b"\\x89BPLUT\\r\\n\\x1a\\n"  (PNG-style: catches text-mode mangling and foreign files)
    version       4 bytes  uint32 format version (FORMAT_VERSION)
    header_len    4 bytes  uint32 length of the header
    header        header_len bytes of UTF-8 JSON, keys sorted, no timestamps
    padding       zero bytes up to a multiple of 16
    payload       the arrays listed in header["arrays"], each at its offset from the payload start

The header carries the provenance (divergence, f, grids, transforms, scheme, precision, versions, measured
accuracy) and the payload's sha256, so a truncated or corrupted file is refused before use. Writing is
atomic (temporary file + rename) and deterministic: the same inputs give byte-identical files.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass

import numpy as np

MAGIC = b"\x89BPLUT\r\n\x1a\n"
FORMAT_VERSION = 1
_ALIGN = 16
_DTYPES = {"float32": np.dtype("<f4"), "float64": np.dtype("<f8")}
REQUIRED_KEYS = ("divergence", "grid", "arrays", "payload_sha256", "delta_range", "values",
                 "interpolation", "generator")


class TableFormatError(ValueError):
    """A table file that is not a valid bandpo_lut table (foreign, truncated, corrupted or too new)."""


@dataclass(frozen=True)
class TableFile:
    header: dict
    arrays: dict  # name -> numpy array (read-only)


def _canonical_json(header: dict) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("utf-8")


def encode(header: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """Serialise; fills header["arrays"] and header["payload_sha256"] from `arrays` (in given order)."""
    header = dict(header)
    specs, chunks, offset = [], [], 0
    for name, arr in arrays.items():
        dtype_name = next((k for k, v in _DTYPES.items() if v == np.dtype(arr.dtype).newbyteorder("<")), None)
        if dtype_name is None:
            raise TypeError(f"array {name!r}: unsupported dtype {arr.dtype}")
        data = np.ascontiguousarray(arr, dtype=_DTYPES[dtype_name]).tobytes()
        specs.append({"name": name, "dtype": dtype_name, "shape": list(arr.shape), "offset": offset,
                      "nbytes": len(data)})
        chunks.append(data)
        offset += len(data)
    payload = b"".join(chunks)
    header["arrays"] = specs
    header["payload_sha256"] = hashlib.sha256(payload).hexdigest()
    hbytes = _canonical_json(header)
    prefix = MAGIC + struct.pack("<II", FORMAT_VERSION, len(hbytes)) + hbytes
    prefix += b"\0" * (-len(prefix) % _ALIGN)
    return prefix + payload


def decode(blob: bytes, source: str = "<bytes>") -> TableFile:
    """Parse and validate; raises TableFormatError naming `source` and what is wrong."""
    if len(blob) < len(MAGIC) + 8 or blob[: len(MAGIC)] != MAGIC:
        raise TableFormatError(f"{source}: not a bandpo_lut table (bad magic bytes; foreign or truncated file)")
    version, hlen = struct.unpack_from("<II", blob, len(MAGIC))
    if version > FORMAT_VERSION:
        raise TableFormatError(f"{source}: table format version {version} is newer than this bandpo_lut "
                               f"supports ({FORMAT_VERSION}); upgrade bandpo_lut or regenerate the table")
    if version < 1:
        raise TableFormatError(f"{source}: invalid table format version {version}")
    hstart = len(MAGIC) + 8
    if hstart + hlen > len(blob):
        raise TableFormatError(f"{source}: truncated table (header needs {hlen} bytes, file has "
                               f"{len(blob) - hstart})")
    try:
        header = json.loads(blob[hstart: hstart + hlen].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TableFormatError(f"{source}: corrupt table header ({e})") from None
    if not isinstance(header, dict) or any(k not in header for k in REQUIRED_KEYS):
        missing = [k for k in REQUIRED_KEYS if not isinstance(header, dict) or k not in header]
        raise TableFormatError(f"{source}: table header lacks required fields {missing}")
    pstart = hstart + hlen + (-(hstart + hlen) % _ALIGN)
    payload = blob[pstart:]
    total = sum(int(a["nbytes"]) for a in header["arrays"])
    if len(payload) != total:
        kind = "truncated" if len(payload) < total else "corrupt (trailing bytes)"
        raise TableFormatError(f"{source}: {kind} table: payload has {len(payload)} bytes, header declares {total}")
    if hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
        raise TableFormatError(f"{source}: corrupt table: payload sha256 does not match its header")
    arrays = {}
    for spec in header["arrays"]:
        dt = _DTYPES.get(spec["dtype"])
        if dt is None:
            raise TableFormatError(f"{source}: array {spec['name']!r} has unsupported dtype {spec['dtype']!r}")
        shape = tuple(int(x) for x in spec["shape"])
        if int(np.prod(shape)) * dt.itemsize != spec["nbytes"]:
            raise TableFormatError(f"{source}: array {spec['name']!r}: shape and size disagree")
        arr = np.frombuffer(payload, dtype=dt, count=int(np.prod(shape)), offset=spec["offset"]).reshape(shape)
        arrays[spec["name"]] = arr
    return TableFile(header=header, arrays=arrays)


def read(path: str | os.PathLike) -> TableFile:
    with open(path, "rb") as fh:
        return decode(fh.read(), source=str(path))


def write_atomic(path: str | os.PathLike, blob: bytes) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it: readers never see half a file."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".bplut", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(blob)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
