"""The command line as a user meets it, in fresh processes: a bad argument prints one argparse-style line
naming it and exits 2, never a traceback; `verify` reports every file; `verify --tolerance 0` is honoured;
`generate` checks its output path and --t-max before computing, replaces only a regular file, never another run's
table, and Ctrl-C leaves no traceback and no file; `verify` refuses a huge file unread; `bench` shows its progress."""
from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
from helpers import fresh_env, run_fresh

from bandpo_lut.tables import store as tables
from bandpo_lut.tables import table_format

# Each test starts Python (and most a generation) several times: seconds each. The quick loop has the in-process
# CLI tests (test_cli.py).
pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

# A generate run that is quick when it runs at all (it must not, for the bad arguments below).
QUICK = ["--t-density", "1", "--s-nodes", "4", "--ghost", "0", "--dps", "30", "--accuracy-points", "0",
         "--workers", "1", "--quiet"]


def cli(*args, cwd, timeout=300):
    t0 = time.monotonic()
    r = run_fresh(["-m", "bandpo_lut.cli", *args], cwd=cwd, timeout=timeout)
    r.seconds = time.monotonic() - t0
    return r


def assert_usage_error(r, *names):
    """Exit 2, one `bandpo-lut CMD: error: ...` line naming the argument, the usage above it, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if re.match(r"bandpo-lut \w+: error: ", line)]
    assert len(errors) == 1, r.stderr
    for name in names:
        assert name in errors[0], (name, errors[0])
    assert r.stderr.lstrip().startswith("usage: bandpo-lut"), r.stderr
    return errors[0]


@pytest.mark.parametrize("args, names", [
    (["generate", "--divergence", "foo"], ["--divergence", "invalid choice: 'foo'", "kl"]),
    (["generate", "--divergence", "kl", "--t-max", "-1"], ["--t-max", "(0, 700]"]),
    (["generate", "--divergence", "kl", "--t-max", "1000"], ["--t-max", "(0, 700]"]),
    (["generate", "--divergence", "kl", "--t-max", "nan"], ["--t-max"]),
    (["generate", "--divergence", "kl", "--s-nodes", "2"], ["--s-nodes", ">= 4"]),
    (["generate", "--divergence", "kl", "--dps", "10"], ["--dps", ">= 30"]),
    (["generate", "--divergence", "kl", "--workers", "-2"], ["--workers", ">= 0"]),
    (["generate", "--divergence", "kl", "--delta-min", "0"], ["--delta-min", "> 0"]),
    (["generate", "--divergence", "kl", "--delta-min", "0.5", "--delta-max", "0.1"],
     ["--delta-min/--delta-max", "min < max"]),
    (["generate", "--divergence", "kl", "--t-max", "10.3", "--t-density", "4"], ["--t-max", "whole number"]),
    (["bench", "--repeats", "x"], ["--repeats", "integer"]),
    (["verify", "--tolerance", "-1", "x.bplut"], ["--tolerance", ">= 0"]),
    (["verify", "--points", "0", "x.bplut"], ["--points", ">= 1"]),
])
def test_bad_arguments_give_one_line_and_exit_2(args, names, tmp_path):
    # Quick settings first (the arguments under test come last and win), so that a run the validation
    # failed to stop ends soon.
    quick = {"generate": QUICK + ["--out", tmp_path / "t.bplut"],
             "bench": ["--n", "64", "--batch", "1", "--tokens", "8", "--repeats", "1", "--skip-bisection",
                       "--skip-memory", "--accuracy-points", "0"],
             "verify": []}[args[0]]
    r = cli(args[0], *quick, *args[1:], cwd=tmp_path, timeout=120)
    assert_usage_error(r, *names)
    assert not (tmp_path / "t.bplut").exists()


def test_generate_t_max_too_small_says_the_valid_range_before_computing(tmp_path):
    """--t-max 3 for kl over δ in [1e-3, 1] cannot hold the tail rules; the error says which T can."""
    r = cli("generate", "--divergence", "kl", "--t-max", "3", "--out", tmp_path / "kl.bplut",
            "--accuracy-points", "0", "--workers", "1", "--quiet", cwd=tmp_path, timeout=120)
    line = assert_usage_error(r, "--t-max", "3 is too small for 'kl'", "T >=")
    need = float(re.search(r"need T >= ([0-9.]+)", line).group(1))
    assert 10 < need <= 14, line             # the shipped kl table uses 14
    assert not (tmp_path / "kl.bplut").exists()


@pytest.mark.parametrize("where", ["under_a_file", "a_directory"])
def test_generate_refuses_an_unwritable_output_before_computing(where, tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a folder")
    out = blocker / "kl.bplut" if where == "under_a_file" else tmp_path
    # The default table would take minutes: an answer within the timeout shows nothing was computed first.
    r = cli("generate", "--divergence", "kl", "--out", out, "--quiet", "--workers", "1", cwd=tmp_path, timeout=90)
    assert_usage_error(r, "--out", f"cannot write {out}", "is not a folder" if where == "under_a_file"
                       else "is a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_verify_reports_every_file_and_fails_if_any_failed(tmp_path):
    good = tables.shipped_path("chi2")
    tf = table_format.decode(good.read_bytes())
    malformed = dict(tf.header, grid=[1, 2])              # a correct checksum over a malformed header
    bad = tmp_path / "bad.bplut"
    bad.write_bytes(table_format.encode(malformed, dict(tf.arrays)))
    missing = tmp_path / "missing.bplut"
    r = cli("verify", bad, missing, good, "--points", "20", "--dense-p", "200", "--dense-delta", "20",
            cwd=tmp_path)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stdout.splitlines()
    assert any(line.startswith(f"FAILED {bad}: ") and "'grid'" in line for line in lines), r.stdout
    assert any(line.startswith(f"FAILED {missing}: ") for line in lines), r.stdout
    assert any(line.startswith("ok") and str(good) in line for line in lines), r.stdout
    assert "1 of 3 files ok" in r.stdout


def test_verify_honours_tolerance_zero(tmp_path):
    good = tables.shipped_path("chi2")
    r = cli("verify", good, "--points", "20", "--dense-p", "200", "--dense-delta", "20", "--tolerance", "0",
            cwd=tmp_path)
    assert "Traceback" not in r.stderr, r.stderr
    assert re.search(r"; tolerance 0$", r.stdout, re.M), r.stdout
    eu = float(re.search(r"upper max rel err ([0-9.e+-]+)", r.stdout).group(1))
    el = float(re.search(r"lower max err ([0-9.e+-]+)", r.stdout).group(1))
    # strict: any error at all fails it (the header's 1e-6 would pass this table)
    assert r.returncode == (1 if eu > 0 or el > 0 else 0), r.stdout
    r = cli("verify", good, "--points", "20", "--dense-p", "200", "--dense-delta", "20", cwd=tmp_path)
    assert r.returncode == 0 and "tolerance 1e-06" in r.stdout, r.stdout


def _read_until(fd, done, seconds):
    """Bytes read from `fd` until done(text so far) or EOF or `seconds` have passed."""
    text, deadline = "", time.monotonic() + seconds
    while not done(text) and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            text += chunk.decode(errors="replace")
    return text


def _default_sigint():
    # A terminal's foreground job reacts to Ctrl-C; a test run started in the background of a non-interactive
    # shell (nohup, `&`) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("workers", [2, 1])
def test_ctrl_c_in_generate_prints_one_line_and_leaves_no_file(workers, tmp_path):
    """Ctrl-C reaches the terminal's whole process group, the pool's workers included."""
    out = tmp_path / "out" / "kl.bplut"
    proc = subprocess.Popen([sys.executable, "-m", "bandpo_lut.cli", "generate", "--divergence", "kl", "--out",
                             str(out), "--accuracy-points", "0", "--workers", str(workers)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path, env=fresh_env(),
                            start_new_session=True, preexec_fn=_default_sigint)
    try:
        fd = proc.stderr.fileno()
        # Wait until the computation has started (the progress bar shows), then interrupt.
        stderr = _read_until(fd, lambda text: "rows of log(delta)" in text, 120)
        assert "rows of log(delta)" in stderr, stderr
        time.sleep(1.5)
        os.killpg(proc.pid, signal.SIGINT)
        stderr += _read_until(fd, lambda text: False, 60)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stderr.close()
    assert proc.returncode == 130, (proc.returncode, stderr)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if "interrupted" in line]
    assert lines == [f"bandpo-lut generate: interrupted; no table written ({out} unchanged)"], stderr
    assert not out.exists()
    assert not any(out.parent.iterdir()), list(out.parent.iterdir())   # no temporary file either


def test_generate_force_does_not_lift_the_cost_limit(tmp_path):
    """--force consents to replacing --out, nothing more: a table past the cost limit (hours of CPU) is still
    refused at once, naming its own consent, --allow-expensive."""
    out = tmp_path / "kl.bplut"
    out.write_bytes(b"old")
    args = ["generate", "--divergence", "kl", "--out", out, *QUICK, "--force"]
    args[args.index("--t-density") + 1] = "100000000"
    r = cli(*args, cwd=tmp_path, timeout=120)
    assert_usage_error(r, "--t-density", "CPU-hours", "--allow-expensive")
    assert out.read_bytes() == b"old"


def _bench_env(tmp_path):
    return fresh_env(HOME=tmp_path / "no-such-home")    # bench's children must not need a home folder


def test_bench_without_a_home_folder_measures_memory(tmp_path):
    """bench's memory rows run in child processes; with HOME naming no folder (a service account, a
    container) they are measured, not reported as unmeasurable (the children ran in the home folder)."""
    small = ["--n", "64", "--batch", "2", "--tokens", "64", "--repeats", "1", "--skip-bisection", "--accuracy-points",
             "0"]
    r = run_fresh(["-m", "bandpo_lut.cli", "bench", *small], cwd=tmp_path, env=_bench_env(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"peak extra memory, fwd\+bwd: fused [0-9.]+ MB, eager [0-9.]+ MB", r.stdout), r.stdout[-2000:]


def test_bench_fused_linear_exits_non_zero_when_its_rows_fail(tmp_path):
    """Sizes whose rows cannot run (a 400 GB LM head): one error line saying which rows failed, exit 1; it
    used to exit 0 with an empty table."""
    args = ["--fused-linear", "--fl-tokens", "8", "--fl-hidden", "1024", "--fl-vocab", "100000000", "--fl-repeats",
            "1"]
    r = run_fresh(["-m", "bandpo_lut.cli", "bench", *args], cwd=tmp_path, env=_bench_env(tmp_path), timeout=300)
    assert r.returncode == 1, (r.returncode, r.stdout[-1000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("bandpo-lut bench: error: ")]
    assert len(errors) == 1 and "2 of 2 fused-linear rows failed" in errors[0] and "--fl-vocab 100000000" in \
        errors[0], r.stderr[-2000:]


def _make_special(kind, path):
    """Make a FIFO, a character device (a second /dev/null: major 1, minor 3, made here, the real one untouched), a
    socket or a symbolic link to a FIFO at `path`; skip where this machine does not allow it, saying why."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("making a device node needs root (CAP_MKNOD); the FIFO case covers the rest")
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.bind(str(path))
        except OSError as e:            # e.g. a temporary folder deeper than a socket path may be (~107 bytes)
            pytest.skip(f"cannot make a socket at {path}: {e}")
        finally:
            sock.close()
    else:
        os.mkfifo(path.with_suffix(".fifo"))
        path.symlink_to(path.with_suffix(".fifo"))


@pytest.mark.parametrize("kind, what", [("fifo", "is a FIFO (named pipe)"), ("device", "is a character device"),
                                        ("socket", "is a socket"),
                                        ("link", "is a symbolic link to a FIFO (named pipe)")])
def test_generate_force_replaces_only_a_regular_file(kind, what, tmp_path):
    """--force consents to replacing a file: a FIFO, a device node or a socket at --out (as /dev/null would be
    for root) is refused before computing, naming what it is, and left as it was."""
    out = tmp_path / "out.bplut"
    _make_special(kind, out)
    before = os.stat(out)                      # followed through the link: what the user would lose
    r = cli("generate", "--divergence", "kl", "--out", out, *QUICK, "--force", cwd=tmp_path, timeout=120)
    assert_usage_error(r, "--out", f"{out} {what}, not a regular file")
    after = os.stat(out)
    assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode) and after.st_ino == before.st_ino
    assert out.is_symlink() == (kind == "link")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_two_generate_runs_to_one_new_out_never_replace_each_other(tmp_path):
    """Both runs check that --out is new before computing; the one that finishes second must not replace the
    first's table: it exits 1 saying so, and keeps its own table where the message says. Run A is held
    (SIGSTOP) once it computes, run B writes meanwhile, then A goes on."""
    out = tmp_path / "kl.bplut"
    slow = ["--t-density", "4", "--s-nodes", "16", "--ghost", "0", "--dps", "30", "--accuracy-points", "0",
            "--workers", "1"]
    a = subprocess.Popen([sys.executable, "-m", "bandpo_lut.cli", "generate", "--divergence", "kl", "--out",
                          str(out), *slow], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                         env=fresh_env(), start_new_session=True)
    try:
        err = _read_until(a.stderr.fileno(), lambda text: "rows of log(delta)" in text, 120)
        a.send_signal(signal.SIGSTOP)          # past its check, computing
        assert "rows of log(delta)" in err and a.poll() is None, err
        b = cli("generate", "--divergence", "kl", "--out", out, *QUICK, cwd=tmp_path, timeout=120)
        assert b.returncode == 0, b.stderr
        b_table = out.read_bytes()
        a.send_signal(signal.SIGCONT)
        a_out, a_err = a.communicate(timeout=120)
    finally:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
            a.wait()
    a_err = err + a_err.decode()
    assert a.returncode == 1, (a.returncode, a_err)
    assert out.read_bytes() == b_table                           # B's table stands
    errors = [line for line in a_err.splitlines() if line.startswith("bandpo-lut generate: error: ")]
    assert len(errors) == 1 and f"{out} was created by another process" in errors[0], a_err
    kept = re.search(r"this run's table is in (\S+): move it", errors[0]).group(1)
    a_table = table_format.decode(open(kept, "rb").read())       # A's work, whole, where the message says
    assert a_table.header["grid"]["s"]["n"] == 16
    assert table_format.decode(b_table).header["grid"]["s"]["n"] == 4


@pytest.mark.parametrize("start", [b"", table_format.MAGIC + b"\x02\x00\x00\x00\x00\x10\x00\x00"])
def test_verify_refuses_a_huge_file_without_reading_it(start, tmp_path):
    """A 100 GiB file (sparse: no disk used), foreign or with a table's first bytes: one FAILED line at once,
    no MemoryError (the whole file used to be read before its magic bytes)."""
    huge = tmp_path / "huge.bplut"
    with open(huge, "wb") as fh:
        fh.write(start)
        fh.truncate(100 * 2 ** 30)
    r = cli("verify", huge, "--points", "20", "--dense-p", "200", "--dense-delta", "20", cwd=tmp_path, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "MemoryError" not in r.stderr, r.stderr[-2000:]
    why = "bad magic bytes" if not start else f"{100 * 2 ** 30} bytes, past the"
    assert r.stdout.startswith(f"FAILED {huge}: ") and why in r.stdout, r.stdout


def test_bench_shows_progress_per_row_as_it_goes(tmp_path):
    """The table comes at the end (stdout); each row says it is done on stderr while the run goes on."""
    small = ["--n", "64", "--batch", "2", "--tokens", "64", "--repeats", "1", "--skip-bisection", "--accuracy-points",
             "5"]
    proc = subprocess.Popen([sys.executable, "-m", "bandpo_lut.cli", "bench", *small], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=tmp_path, env=_bench_env(tmp_path))
    try:
        first = _read_until(proc.stderr.fileno(), lambda text: "\n" in text, 120)
        running = proc.poll() is None            # the first row was reported before the run ended
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    lines = [line for line in (first + err.decode()).splitlines() if line.startswith("bench: [")]
    # ten clip rows, the copy, three loss rows, the accuracy rows, two memory rows
    assert [line.split("]")[0] for line in lines] == [f"bench: [{k}/17" for k in range(1, 18)], lines
    assert running, first
    assert "bench: [" not in out.decode()        # stdout: the table only, as before
    assert re.search(r"peak extra memory, fwd\+bwd: fused [0-9.]+ MB", out.decode()), out.decode()[-2000:]


def test_bench_fused_linear_measures_each_row_in_a_child_and_says_so_as_it_goes(tmp_path):
    """Tiny sizes: each of the four (V, head) x (unfused, fused) children is announced on stderr before it runs,
    and each row's peak memory is at least what the unfused path must hold beyond the gradients (the logits)."""
    args = ["--fused-linear", "--fl-tokens", "64", "--fl-hidden", "16", "--fl-vocab", "4096", "--fl-repeats", "1",
            "--json", tmp_path / "fl.json"]
    r = run_fresh(["-m", "bandpo_lut.cli", "bench", *args], cwd=tmp_path, env=_bench_env(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("bench: [")]
    assert [line.split("]")[0] for line in lines] == [f"bench: [{k}/4" for k in range(1, 5)], r.stderr
    assert [line.split(", ")[-1] for line in lines] == ["unfused path (a child process)", "fused path (a child "
                                                        "process)"] * 2, lines
    rows = json.loads((tmp_path / "fl.json").read_text())["fused_linear_rows"]
    assert [(row["vocab"], row["head"]) for row in rows] == [(4096, "frozen"), (4096, "trained")]
    for row in rows:
        assert row["unfused_mb"] >= 64 * 4096 * 4 / 2 ** 20 and row["unfused_s"] > 0 and row["fused_s"] > 0, row
