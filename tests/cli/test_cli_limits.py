"""The CLI's sharp edges: `generate` never replaces a file without --force (and keeps its
mode and symbolic link when forced), refuses an empty --out, refuses a table whose cost is past its limit
unless forced, and exits 1 when the error it measures exceeds the tolerance it stamps; `bench` and `verify`
refuse sizes the machine cannot hold or finish, with one error line (exit 2) before allocating anything."""
from __future__ import annotations

import os
import stat

import pytest

from bandpo_lut.cli import main
from bandpo_lut.cli.bench import command as bench
from bandpo_lut.tables import generate, table_format, verify
from bandpo_lut.tables import store as tables

# A generate run of a second or two (no accuracy stamp).
QUICK = ["--t-density", "1", "--s-nodes", "4", "--ghost", "0", "--dps", "30", "--accuracy-points", "0",
         "--workers", "1", "--quiet"]


def _must_not_start(*args, **kwargs):
    pytest.fail("the run started (allocating or computing) instead of refusing its sizes")


def usage_error(argv, capsys, *needles):
    """`bandpo-lut ARGV` ends with exit 2 and one error line containing every needle (no traceback)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"bandpo-lut {argv[0]}: error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def test_generate_refuses_to_replace_a_file_without_force(tmp_path, capsys):
    out = tmp_path / "kl.bplut"
    out.write_bytes(b"precious")
    out.chmod(0o600)
    usage_error(["generate", "-d", "kl", "--out", str(out)] + QUICK, capsys, "--out", "exists", "--force")
    assert out.read_bytes() == b"precious"
    assert main(["generate", "-d", "kl", "--out", str(out), "--force"] + QUICK) == 0
    table_format.decode(out.read_bytes())                      # a table now
    assert stat.S_IMODE(out.stat().st_mode) == 0o600          # the file's own mode kept


def test_generate_force_writes_through_a_symbolic_link(tmp_path, capsys):
    target, link = tmp_path / "real.bplut", tmp_path / "link.bplut"
    target.write_bytes(b"old")
    link.symlink_to(target)
    usage_error(["generate", "-d", "kl", "--out", str(link)] + QUICK, capsys, "--out", "exists")
    assert main(["generate", "-d", "kl", "--out", str(link), "--force"] + QUICK) == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    table_format.decode(target.read_bytes())


def test_generate_refuses_an_empty_out(tmp_path, capsys, monkeypatch):
    """An unset shell variable (--out "$OUT") must not write tables/DIVERGENCE.bplut in the current folder."""
    monkeypatch.chdir(tmp_path)
    usage_error(["generate", "-d", "kl", "--out", ""] + QUICK, capsys, "--out", "empty path")
    assert not (tmp_path / "tables").exists()


def test_generate_default_out_is_not_replaced_either(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = tmp_path / "tables" / "kl.bplut"
    shipped.parent.mkdir()
    shipped.write_bytes(tables.shipped_path("kl").read_bytes())
    usage_error(["generate", "-d", "kl"] + QUICK, capsys, "--out", "tables/kl.bplut exists", "--force")
    assert shipped.read_bytes() == tables.shipped_path("kl").read_bytes()


@pytest.mark.parametrize("size", [["--t-density", "100000000"], ["--dps", "100000000"], ["--s-nodes", "10000000"],
                                  ["--ghost", "100000000"], ["--accuracy-points", "1000000000"]])
def test_generate_refuses_a_table_past_its_cost_limit(size, tmp_path, capsys, monkeypatch):
    """Refused at once (not after hours), naming the sizes, the estimate and --force."""
    monkeypatch.setattr(generate, "generate", _must_not_start)
    out = tmp_path / "kl.bplut"
    args = ["generate", "-d", "kl", "--out", str(out)] + QUICK
    args[args.index(size[0]) + 1] = size[1]
    usage_error(args, capsys, size[0], "CPU-hours", "--allow-expensive")
    assert not out.exists()


def test_generate_fails_when_the_measured_error_exceeds_the_stamped_tolerance(tmp_path, capsys):
    """A coarse grid measures ~1e-2 against the 1e-6 it stamps: exit 1 and say so; --allow-inaccurate exits 0."""
    out = tmp_path / "coarse.bplut"
    args = ["generate", "-d", "kl", "--out", str(out), "--t-max", "10", "--t-density", "4", "--delta-min", "0.05",
            "--delta-max", "0.5", "--s-nodes", "6", "--ghost", "6", "--dps", "30", "--accuracy-points", "10",
            "--workers", "1", "--quiet"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "exceeds the tolerance 1e-06" in err and "--allow-inaccurate" in err, err
    acc = table_format.decode(out.read_bytes()).header["accuracy"]
    assert max(acc["upper_max_rel_error"], acc["lower_max_error"]) > acc["tolerance"]   # the stamp is honest
    assert main(args + ["--force", "--allow-inaccurate"]) == 0


@pytest.mark.parametrize("argv, needles", [
    (["bench", "--n", "1000000000000"], ["--n", "GiB", "available"]),
    (["bench", "--batch", "1000000", "--tokens", "1000000"], ["--tokens", "GiB"]),
    (["bench", "--repeats", "1000000000000"], ["--repeats", "<= "]),
    (["bench", "--accuracy-points", "1000000000000"], ["--accuracy-points", "<= "]),
    (["bench", "--threads", "1000000000000"], ["--threads", "<= "]),
    (["verify", "--points", "1000000000000", "x.bplut"], ["--points", "<= "]),
    (["verify", "--dense-p", "100000000", "--dense-delta", "100000000", "x.bplut"], ["--dense-p", "GiB"]),
])
def test_bench_and_verify_refuse_sizes_past_the_machine(argv, needles, capsys, monkeypatch):
    monkeypatch.setattr(bench, "_lm_like_probs", _must_not_start)    # bench's first allocation
    monkeypatch.setattr(verify, "verify_file", _must_not_start)
    usage_error(argv, capsys, *needles)
