"""The CLI's sharp edges: `generate` never replaces a file without --force (and keeps its
mode and symbolic link when forced), refuses an empty --out, refuses a table whose cost is past its limit
unless forced, and exits 1 when the error it measures exceeds the tolerance it stamps; `bench` and `verify`
refuse sizes the machine cannot hold or finish, with one error line (exit 2) before allocating anything."""
from __future__ import annotations

import os
import stat
import subprocess

import pytest

from bandpo_lut.cli import main
from bandpo_lut.cli import verify as verify_command
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
    err = capsys.readouterr().err                  # the run succeeds: a warning, not an error
    assert "bandpo-lut generate: warning: the measured error" in err and "error:" not in err, err


@pytest.mark.parametrize("argv, needles", [
    (["bench", "--n", "1000000000000"], ["--n", "GiB", "available"]),
    (["bench", "--batch", "1000000", "--tokens", "1000000"], ["--tokens", "GiB"]),
    (["bench", "--repeats", "1000000000000"], ["--repeats", "<= "]),
    (["bench", "--accuracy-points", "1000000000000"], ["--accuracy-points", "<= "]),
    (["bench", "--threads", "1000000000000"], ["--threads", "<= "]),
    (["bench", "--fused-linear", "--fl-repeats", "1000000000"], ["--fl-repeats", "<= "]),
    (["verify", "--points", "1000000000000", "x.bplut"], ["--points", "<= "]),
    (["verify", "--dense-p", "100000000", "--dense-delta", "100000000", "x.bplut"], ["--dense-p", "GiB"]),
])
def test_bench_and_verify_refuse_sizes_past_the_machine(argv, needles, capsys, monkeypatch):
    monkeypatch.setattr(bench, "_lm_like_probs", _must_not_start)    # bench's first allocation
    monkeypatch.setattr(verify, "verify_file", _must_not_start)
    monkeypatch.setattr(verify_command, "verify_file", _must_not_start)   # imported before: no patched copy kept
    usage_error(argv, capsys, *needles)


def test_generate_workers_are_bounded(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("bandpo_lut.cli.generate.generate", _must_not_start)
    usage_error(["generate", "-d", "kl", "--out", str(tmp_path / "kl.bplut"), *QUICK, "--workers", "100000"],
                capsys, "--workers", "<= ")


def test_generate_starts_no_more_workers_than_rows(monkeypatch):
    """24 workers asked for a table of 4 rows of log(delta): 4 processes start, not 24 (the table is the same)."""
    started = []
    pool = generate._pool_ignoring_sigint

    def counting_pool(ctx, workers):
        started.append(workers)
        return pool(ctx, workers)

    monkeypatch.setattr(generate, "_pool_ignoring_sigint", counting_pool)
    args = dict(t_max=14.0, t_density=1, delta_min=1e-3, delta_max=1.0, s_nodes=4, ghost=0, dps=30,
                dtype="float32", accuracy_points=0, progress=False)
    blob = generate.generate("kl", workers=24, **args)
    assert started == [4]
    assert blob == generate.generate("kl", workers=1, **args)


@pytest.mark.parametrize("where", ["read_only_folder", "proc"])
def test_bench_json_that_cannot_be_written_is_refused_before_any_row(where, tmp_path, capsys, monkeypatch):
    if where == "read_only_folder":
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder; the /proc case covers a folder that refuses")
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o500)
        path = folder / "bench.json"
    else:
        if not os.path.isdir("/proc/self"):
            pytest.skip("needs Linux /proc, which refuses new files even to root")
        path = "/proc/bandpo-bench.json"
    monkeypatch.setattr(bench, "_lm_like_probs", _must_not_start)    # bench's first allocation
    usage_error(["bench", "--n", "64", "--json", str(path)], capsys, "--json", f"cannot write {path}")
    assert not os.path.exists(path)


def test_bench_fused_linear_skips_a_row_that_cannot_fit_without_running_it(capsys, monkeypatch):
    """A 400 GB head: the estimate refuses each row before its child process starts, saying what it needs."""
    monkeypatch.setattr(subprocess, "run", _must_not_start)
    argv = ["bench", "--fused-linear", "--fl-tokens", "8", "--fl-hidden", "1024", "--fl-vocab", "100000000",
            "--fl-repeats", "1"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    skipped = [line for line in err.splitlines() if "skipped: the unfused path needs about" in line]
    assert len(skipped) == 2 and all("GiB is available" in line for line in skipped), err
    need = float(skipped[0].split("needs about ")[1].split()[0])
    assert need >= 1e8 * 1024 * 4 / 2 ** 30                    # at least the head itself (float32)
    assert "2 of 2 fused-linear rows failed" in err


def test_bench_fused_linear_row_estimate_covers_the_logits():
    """What each path must hold: the unfused one the whole (tokens x vocab) logits, the fused one a chunk of them;
    both the head, and its gradient when trained."""
    from bandpo_lut.cli.bench import fused_linear

    n, h, v, c = 4096, 1024, 32768, 512
    assert fused_linear.row_bytes("unfused", n, h, v, False, c) >= 4 * (n * v + v * h)
    assert fused_linear.row_bytes("fused", n, h, v, True, c) >= 4 * (2 * v * h + c * v)
    assert fused_linear.row_bytes("fused", n, h, v, False, c) < fused_linear.row_bytes("unfused", n, h, v, False, c)
