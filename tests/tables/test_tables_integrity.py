"""Table files cannot be used for what they are not: every header field a reader uses is covered by the
file's checksum (an edited header is refused, naming the file and the problem), a header that is
malformed or inconsistent yet correctly checksummed is refused naming the file and the field, old-format
files are refused with the command to regenerate them, and a table loaded for a divergence must be that
divergence's table (another one copied over its file is refused). Also the format's basics: provenance in the
header, corrupt/truncated/foreign/newer files, atomic writes, unknown names."""
from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import shutil
import struct

import numpy as np
import pytest
import torch

from bandpo_lut.reference.bounds import bounds as ref_bounds
from bandpo_lut.tables import store as tables
from bandpo_lut.tables import table_format

_MAGIC_LEN = 10
_PREFIX = _MAGIC_LEN + 8
_DELETE = object()      # as a value for `_set`: remove the field


def _split(blob: bytes):
    """(version, header dict, payload bytes) of a .bplut file, read without the package's reader."""
    version, hlen = struct.unpack_from("<II", blob, _MAGIC_LEN)
    header = json.loads(blob[_PREFIX: _PREFIX + hlen])
    pstart = _PREFIX + hlen + (-(_PREFIX + hlen) % 16)
    return version, header, blob[pstart:]


def _join(version: int, header: dict, payload: bytes, *, canonical: bool = True) -> bytes:
    """A file with this header and payload, checksum fields left exactly as they are in `header`."""
    hbytes = (json.dumps(header, sort_keys=True, separators=(",", ":")) if canonical
              else json.dumps(header, indent=1)).encode()
    prefix = table_format.MAGIC + struct.pack("<II", version, len(hbytes)) + hbytes
    prefix += b"\0" * (-len(prefix) % 16)
    return prefix + payload


def _set(header: dict, path: str, value) -> dict:
    """A deep copy of `header` with the field at dotted `path` set to `value` (or removed if value is _DELETE)."""
    h = copy.deepcopy(header)
    node = h
    parts = path.split(".")
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    last = parts[-1]
    if value is _DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return h


def _refused(path, blob, *must_contain):
    path.write_bytes(blob)
    with pytest.raises(table_format.TableFormatError) as e:
        tables.load(path)
    msg = str(e.value)
    assert str(path) in msg, msg
    for text in must_contain:
        assert text in msg, (text, msg)
    return msg


# --- 1. a header edited after writing (the checksum is not recomputed) ------------------------------------
# Each edit is one a reader would act on: a wrong δ range (out-of-range δ accepted, wrong bounds), a
# shifted or rescaled grid, another divergence or value kind, other refinement steps, other array specs...
# Where an edit alone would be internally inconsistent, the companion fields are edited with it, so that
# only the checksum can catch it (the code on main, whose checksum covered the payload only, used these).
HEADER_EDITS = {
    "delta_range.min": [("delta_range.min", 0.01)],
    "delta_range.max": [("delta_range.max", 5.0)],
    "delta_range.max_inclusive": [("delta_range.max_inclusive", False)],
    "grid.t.min+max (shifted)": [("grid.t.min", -9.0), ("grid.t.max", 11.0)],
    "grid.t.step+max (rescaled)": [("grid.t.step", 0.5), ("grid.t.max", 30.0)],
    "grid.t.n": [("grid.t.n", 41)],
    "grid.s.min": [("grid.s.min", -3.5)],
    "grid.s.max": [("grid.s.max", -0.5)],
    "grid.s.n": [("grid.s.n", 7)],
    "grid.s.step": [("grid.s.step", 0.5)],
    "values.upper.kind": [("values.upper.kind", "r")],
    "values.lower.kind": [("values.lower.kind", "q")],
    "divergence.name": [("divergence.name", "reverse_kl")],
    "divergence.formula": [("divergence.formula", "f(u) = u*log(u) - u + 1")],
    "refinement.upper_newton_steps": [("refinement.upper_newton_steps", 3)],
    "refinement.lower_newton_steps": [("refinement.lower_newton_steps", 3)],
    "interpolation.scheme": [("interpolation.scheme", "bilinear")],
    "storage_dtype": [("storage_dtype", "float64")],
    "format.version": [("format.version", 1)],
    "arrays.0.name (upper/lower swapped)": [("arrays.0.name", "lower"), ("arrays.1.name", "upper")],
    "arrays.0.shape": [("arrays.0.shape", [8, 83])],
    "arrays.0.dtype": [("arrays.0.dtype", "float64"), ("arrays.0.shape", [83, 4])],
    "accuracy.tolerance": [("accuracy.tolerance", 1.0)],
    "generator.command": [("generator.command", "bandpo-lut generate --divergence kl")],
    "payload_sha256 (with a payload edit)": [("payload_sha256", None)],
}


@pytest.mark.parametrize("case", sorted(HEADER_EDITS))
def test_every_edited_header_field_is_refused(case, small_blob, tmp_path):
    version, header, payload = _split(small_blob)
    for path, value in HEADER_EDITS[case]:
        header = _set(header, path, value)
    if case.startswith("payload_sha256"):
        # A forger who edits the payload and puts its new sha256 in the header (which is all the old
        # format checked) is still refused: the whole-file checksum covers both.
        payload = bytearray(payload)
        payload[40] ^= 0x01
        payload = bytes(payload)
        header["payload_sha256"] = hashlib.sha256(payload).hexdigest()
    _refused(tmp_path / "kl.bplut", _join(version, header, payload), "edited", "file_sha256")


def test_reformatted_header_is_refused(small_blob, tmp_path):
    """The same header content, pretty-printed: the bytes are not what the writer produced."""
    version, header, payload = _split(small_blob)
    _refused(tmp_path / "kl.bplut", _join(version, header, payload, canonical=False), "edited")


def test_nonzero_padding_is_refused(small_blob, tmp_path):
    version, header, payload = _split(small_blob)
    blob = bytearray(_join(version, header, payload))
    pad_at = len(blob) - len(payload) - 1
    if blob[pad_at] != 0:
        pytest.skip("this header leaves no padding")
    blob[pad_at] = 0x20
    _refused(tmp_path / "kl.bplut", bytes(blob), "padding")


def test_tampered_delta_range_is_not_used(small_blob, tmp_path):
    """The issue's reproduction: a widened δ range in the header must not make an out-of-range δ usable."""
    version, header, payload = _split(small_blob)
    path = tmp_path / "kl.bplut"
    path.write_bytes(_join(version, _set(header, "delta_range.max", 5.0), payload))
    with pytest.raises(table_format.TableFormatError, match="edited"):
        ref_bounds(torch.tensor([0.5]), 2.0, "kl", table=tables.load(path))


def test_old_format_version_is_refused_with_the_regenerate_command(small_blob, tmp_path):
    version, header, payload = _split(small_blob)
    old = table_format.MAGIC + struct.pack("<I", 1) + _join(version, header, payload)[_MAGIC_LEN + 4:]
    msg = _refused(tmp_path / "old.bplut", old, "version 1", "regenerate",
                   "--divergence kl --t-max 10 --t-density 4", f"--out {tmp_path / 'old.bplut'}")
    assert f"version {table_format.FORMAT_VERSION}" in msg


def test_format_version_is_bumped_and_shipped_tables_are_current():
    assert table_format.FORMAT_VERSION >= 2
    for name in tables.SHIPPED:
        blob = tables.shipped_path(name).read_bytes()
        assert struct.unpack_from("<I", blob, _MAGIC_LEN)[0] == table_format.FORMAT_VERSION, name
        h = tables.load(tables.shipped_path(name), name).header
        assert h["format"]["version"] == table_format.FORMAT_VERSION
        assert len(h["file_sha256"]) == 64 and h["file_sha256"] != h["payload_sha256"]


# --- 2. a malformed or inconsistent header with a correct checksum (a buggy or hostile writer) -----------
# `table_format.encode` recomputes every checksum, so only the field checks can refuse these; each error
# must name the file and the field, never be a bare KeyError/TypeError/AttributeError.
RESIGNED_CASES = [(p, _DELETE) for p in (
    "delta_range", "delta_range.min", "delta_range.max_inclusive", "grid.t", "grid.t.n", "grid.s.step",
    "divergence.name", "divergence.formula", "values.lower.kind", "values.upper", "refinement.upper_newton_steps",
    "refinement", "interpolation.scheme", "storage_dtype", "generator.command", "format.version")] + [
    ("grid", [1, 2]), ("grid.t.n", "81"), ("grid.t.n", 2), ("grid.t.min", "-10"), ("grid.s.max", None),
    ("delta_range.min", "0.05"), ("delta_range.min", -1.0), ("delta_range.max_inclusive", "yes"),
    ("divergence", "kl"), ("values", []), ("values.lower", "kappa"), ("refinement.lower_newton_steps", 1.5),
    ("accuracy.tolerance", "1e-6"), ("accuracy", 3), ("generator", "bandpo-lut"), ("format.version", "2"),
    ("format.version", 1), ("delta_range.max", 0.04), ("delta_range.max", 0.6),
    ("divergence.formula", "f(u) = |u - 1| / 2"), ("values.upper.kind", "r"), ("values.lower.kind", "q"),
    ("interpolation.scheme", "bilinear"), ("refinement.upper_newton_steps", -1), ("storage_dtype", "float64"),
    ("divergence.name", "nope"), ("grid.t.step", 0.5), ("grid.s.min", -3.0)]


@pytest.mark.parametrize("field, value", RESIGNED_CASES,
                         ids=[f"{p}={'<missing>' if v is _DELETE else repr(v)}" for p, v in RESIGNED_CASES])
def test_malformed_header_names_the_file_and_the_field(field, value, small_blob, tmp_path):
    tf = table_format.decode(small_blob)
    header = _set(tf.header, field, value)
    blob = table_format.encode(header, dict(tf.arrays))
    path = tmp_path / "kl.bplut"
    path.write_bytes(blob)
    with pytest.raises(table_format.TableFormatError) as e:      # never a bare KeyError/TypeError
        tables.load(path)
    msg = str(e.value)
    assert str(path) in msg, msg
    # The message quotes the field, or its parent or child (a missing object is reported by the first
    # field looked up inside it, a non-object parent by its own name).
    quoted = re.findall(r"'([a-z_]+(?:\.[a-z0-9_]+)*)'", msg)
    assert any(q == field or q.startswith(field + ".") or field.startswith(q + ".") for q in quoted), \
        (field, value, msg)


# --- 3. one divergence's table in another's file ---------------------------------------------------------

@pytest.fixture
def shipped_in(tmp_path, monkeypatch):
    """(folder, real folder): tables.get reads its shipped tables from `folder` during the test."""
    real = tables.shipped_dir()
    monkeypatch.setattr(tables, "shipped_dir", lambda: tmp_path)
    tables._load_shipped.cache_clear()
    yield tmp_path, real
    tables._load_shipped.cache_clear()


@pytest.mark.parametrize("expected", tables.SHIPPED)
def test_another_divergences_table_is_refused(expected, shipped_in):
    folder, real = shipped_in
    target = folder / f"{expected}.bplut"
    for found in tables.SHIPPED:
        if found == expected:
            continue
        shutil.copyfile(real / f"{found}.bplut", target)
        tables._load_shipped.cache_clear()
        with pytest.raises(table_format.TableFormatError) as e:
            tables.get(expected)
        msg = str(e.value)
        assert str(target) in msg and f"expected the {expected!r} table" in msg and \
            f"found the {found!r} table" in msg, msg
        with pytest.raises(table_format.TableFormatError, match="expected the"):
            tables.load(target, expected)
    # the right file in the same place loads
    shutil.copyfile(real / f"{expected}.bplut", target)
    tables._load_shipped.cache_clear()
    assert tables.get(expected).divergence.name == expected


def test_kl_swapped_for_tv_is_refused_by_the_reference_reader(shipped_in):
    """The issue's reproduction: tv's table copied over kl.bplut was used for kl (lower bounds above 1)."""
    folder, real = shipped_in
    shutil.copyfile(real / "tv.bplut", folder / "kl.bplut")
    with pytest.raises(table_format.TableFormatError, match="found the 'tv' table"):
        ref_bounds(torch.tensor([0.3]), 0.05, "kl")


def test_missing_table_says_how_to_make_it(shipped_in):
    """No `table=` argument of the compiled API is suggested (it has none): the message says where to
    generate the file, or how to give a generated table to the reference reader."""
    folder, _ = shipped_in
    with pytest.raises(FileNotFoundError) as e:
        tables.get("kl")
    msg = str(e.value)
    assert f"bandpo-lut generate --divergence kl --out {folder / 'kl.bplut'}" in msg, msg
    assert "bandpo_lut.reference.bounds(..., table=bandpo_lut.tables.store.load(PATH))" in msg, msg
    assert "pass it as table=" not in msg


# --- 4. format basics: provenance, corrupt/truncated/foreign/newer files, atomic writes, unknown names ---------

def test_header_records_provenance(small_blob):
    h = table_format.decode(small_blob).header
    for key in ("divergence", "grid", "values", "interpolation", "storage_dtype", "working_precision",
                "generator", "accuracy", "payload_sha256", "file_sha256", "banner", "delta_range", "refinement",
                "format"):
        assert key in h
    assert h["working_precision"]["dps"] == 30 and h["working_precision"]["library"] == "mpmath"
    assert h["divergence"]["formula"] == "f(u) = -log(u) + u - 1"
    assert "do not edit" in h["banner"]
    assert h["format"]["version"] == table_format.FORMAT_VERSION


def test_corrupt_truncated_foreign_and_newer_files_are_refused(small_blob, tmp_path):
    def refused(blob, match):
        path = tmp_path / "t.bplut"
        path.write_bytes(blob)
        with pytest.raises(table_format.TableFormatError, match=match):
            tables.load(path)

    refused(small_blob[:-10], "truncated")
    refused(small_blob + b"\0", "trailing")
    flipped = bytearray(small_blob)
    flipped[-100] ^= 0xFF
    refused(bytes(flipped), "sha256")
    refused(b"PK\x03\x04" + small_blob[4:], "not a bandpo_lut table")
    refused(b"", "not a bandpo_lut table")
    newer = small_blob[:10] + struct.pack("<I", table_format.FORMAT_VERSION + 1) + small_blob[14:]
    refused(newer, "newer")
    hlen = struct.unpack_from("<I", small_blob, 14)[0]
    bad_header = small_blob[:18] + b"{" * hlen + small_blob[18 + hlen:]
    refused(bad_header, "corrupt table header")


def test_what_the_first_bytes_and_the_size_tell_is_refused_before_the_file_is_read(small_blob, tmp_path, monkeypatch):
    """A table's first 18 bytes, then a sparse tail to 100 GiB; a header longer than the file; a FIFO (whose open
    would wait for a writer): each refused without reading the rest (`read` is watched)."""
    import builtins
    import os

    sizes = []

    class Watched:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def fileno(self):
            return self.fh.fileno()

        def read(self, n=-1):
            sizes.append(n)
            return self.fh.read(n)

    monkeypatch.setattr(tables, "open", lambda *a, **k: Watched(builtins.open(*a, **k)), raising=False)
    huge = tmp_path / "huge.bplut"
    with open(huge, "wb") as fh:
        fh.write(small_blob[:_PREFIX])
        fh.truncate(100 * 2 ** 30)
    with pytest.raises(table_format.TableFormatError, match=f"{100 * 2 ** 30} bytes, past the"):
        tables.load(huge)
    assert sizes == [_PREFIX], sizes                      # the prefix only
    short = tmp_path / "short.bplut"
    short.write_bytes(small_blob[:_PREFIX + 5])
    with pytest.raises(table_format.TableFormatError, match="truncated table"):
        tables.load(short)
    fifo = tmp_path / "fifo.bplut"
    os.mkfifo(fifo)
    with pytest.raises(table_format.TableFormatError, match="not a regular file"):
        tables.load(fifo)
    monkeypatch.undo()
    whole = tmp_path / "kl.bplut"
    whole.write_bytes(small_blob)
    assert tables.load(whole).divergence.name == "kl"                          # a table still loads


def test_write_is_atomic_and_leaves_no_temporaries(small_blob, tmp_path):
    out = tmp_path / "sub" / "kl.bplut"
    table_format.write_atomic(out, small_blob)
    table_format.write_atomic(out, small_blob)
    assert out.read_bytes() == small_blob
    assert [p.name for p in out.parent.iterdir()] == ["kl.bplut"]


def test_unknown_divergence_and_missing_table():
    with pytest.raises(ValueError, match="unknown divergence 'nope'"):
        ref_bounds(torch.tensor([0.5]), 0.05, "nope")
    with pytest.raises(FileNotFoundError, match="no table for 'reverse_kl'"):
        ref_bounds(torch.tensor([0.5]), 0.05, "reverse_kl")


def test_a_shape_whose_size_overflows_int64_is_refused(small_blob, tmp_path):
    """A shape of 2^32 x 2^32 floats is 2^66 bytes: computed in int64 it wraps to 0 and would pass as nbytes 0.
    Correct checksums (a hostile writer): refused as a TableFormatError naming the file and the field."""
    version, header, _ = _split(small_blob)
    header["arrays"] = [{"name": "upper", "dtype": "float32", "shape": [2 ** 32, 2 ** 32], "offset": 0,
                         "nbytes": 0}]
    header["payload_sha256"] = hashlib.sha256(b"").hexdigest()
    header["file_sha256"] = table_format._file_sha256(version, header, b"")
    path = tmp_path / "kl.bplut"
    path.write_bytes(_join(version, header, b""))
    with pytest.raises(table_format.TableFormatError, match=r"arrays\.0\.nbytes") as e:
        tables.load(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_coefficients_are_refused_when_written_and_read(value, small_blob, tmp_path, monkeypatch):
    """A NaN coefficient gives NaN bounds wherever a read touches it, which no checksum sees and no monotonicity
    test either (NaN compares false): the writer refuses it, and a file holding one (from another writer) does
    not load, naming the file, the array and the index."""
    tf = table_format.decode(small_blob)
    arrays = {k: np.array(v) for k, v in tf.arrays.items()}
    arrays["upper"][3, 4] = value
    with pytest.raises(table_format.TableFormatError, match=r"array 'upper' holds 1 non-finite"):
        table_format.encode(dict(tf.header), arrays)
    monkeypatch.setattr(table_format, "_check_finite", lambda *a: None)     # another writer
    blob = table_format.encode(dict(tf.header), arrays)
    monkeypatch.undo()
    path = tmp_path / "kl.bplut"
    path.write_bytes(blob)
    with pytest.raises(table_format.TableFormatError, match=r"index \(3, 4\)") as e:
        tables.load(path)
    assert str(path) in str(e.value)


def test_verify_counts_a_nan_bound_as_a_monotonicity_violation(tmp_path, monkeypatch):
    """Behind the load-time refusal, verify's monotonicity grid also fails a table that reads NaN somewhere (a NaN
    compares false both ways, so a plain `>` test counted none): the shipped tv table (0 violations, as
    test_tables holds) with one t-node of its upper coefficients NaN."""
    from bandpo_lut.tables.verify import monotonicity_violations

    tf = table_format.read(tables.shipped_path("tv"))
    arrays = {k: np.array(v) for k, v in tf.arrays.items()}
    arrays["upper"][arrays["upper"].shape[0] // 2, :] = math.nan
    monkeypatch.setattr(table_format, "_check_finite", lambda *a: None)     # another writer, another reader
    path = tmp_path / "tv.bplut"
    path.write_bytes(table_format.encode(dict(tf.header), arrays))
    assert sum(monotonicity_violations(tables.load(path), 4000, 200)) > 0
