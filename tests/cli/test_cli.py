"""The command line in process, through the CLI dispatcher: every command's --help, `info`, `bench`, `demo`, `plot`,
`generate` and `verify` (runs and bad arguments). The CLI as a user runs it, in fresh processes: test_cli_errors.py."""
from __future__ import annotations

import argparse
import importlib
import json
import re

import pytest

from bandpo_lut.cli import SUBCOMMANDS, main
from bandpo_lut.tables import store as tables


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: bandpo-lut " + command)
    parser = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(parser)
    for action in parser._actions:   # every option the command takes says what it does
        assert action.help and action.help != argparse.SUPPRESS, (command, action.option_strings or action.dest)


def test_top_level_help_names_every_method_the_demo_compares(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())        # argparse wraps the help lines
    demo = text.split(" demo ", 1)[1].split(" plot ", 1)[0]
    for method in ("canonical clip", "clip-higher", "DCPO", "DPPO", "BandPO"):   # the demo's five (docs/demo.md)
        assert method in demo, (method, demo)


def test_unknown_command_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_info_text_and_json(capsys):
    from bandpo_lut.tables import store as tables
    from bandpo_lut.tables import table_format

    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "with_cuda" in text and "kl:" in text and "sha256" in text and "file_sha256: header and payload" in text
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info["tables"]) >= {"kl", "tv", "chi2"}
    for name, t in info["tables"].items():       # the whole-file checksum, the one the reader verified
        header = tables.load(t["path"], name).header
        assert t["sha256"] == header["file_sha256"] != header["payload_sha256"] == t["payload_sha256"]
        assert t["format_version"] == table_format.FORMAT_VERSION
        assert t["accuracy"] == header["accuracy"]     # the measurement the generator stamped, as stamped


BENCH_ROWS = ("torch.clamp(ratio, 0.8, 1.28)", "tv closed form, plain PyTorch", "chi2 closed form, plain PyTorch",
              "bandpo_lut.bounds kl, scalar delta", "bandpo_lut.clip kl, scalar delta",
              "bandpo_lut.clip kl, log_p_old, scalar delta", "bandpo_lut.clip kl, per-token delta",
              "bandpo_lut.clip tv, scalar delta", "bandpo_lut.clip chi2, scalar delta",
              "bandpo_lut.clip hellinger, scalar delta")


def test_bench_prints_one_consistent_table(tmp_path, capsys):
    """Every row is timed (finite, positive), the printed ms and ratios are the JSON's times and their
    quotients by the row of the unit, and the accuracy rows measure errors within the README's bound."""
    record = tmp_path / "bench.json"
    args = ["bench", "--n", "4096", "--batch", "2", "--tokens", "64", "--repeats", "3", "--skip-bisection",
            "--skip-memory", "--accuracy-points", "40", "--json", str(record)]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    data = json.loads(record.read_text())
    rows, loss_rows = dict(data["rows"]), dict(data["loss_rows"])
    assert tuple(rows) == BENCH_ROWS and len(loss_rows) == 3
    copy_s, n, row_bytes = data["copy_seconds"], data["n"], data["bytes_per_element"]
    assert 0 < copy_s < 60 and n == 4096
    # the bytes each band row must move per element: what it reads and writes, counted here from the call
    assert row_bytes == {"torch.clamp(ratio, 0.8, 1.28)": 4 + 4, "bandpo_lut.bounds kl, scalar delta": 4 + 4 + 4,
                         **{name: 4 + 4 + 4 for name in BENCH_ROWS[4:] if "per-token" not in name},
                         "bandpo_lut.clip kl, per-token delta": 4 + 4 + 4 + 4}
    for table, unit in ((rows, rows["torch.clamp(ratio, 0.8, 1.28)"]), (loss_rows, next(iter(loss_rows.values())))):
        for name, seconds in table.items():
            assert 0 < seconds < 60, name
            line = next(line for line in out if line.startswith(name))
            ms, ratio, *share = line[len(name):].split()
            assert float(ms) == pytest.approx(seconds * 1e3, abs=6e-4), name
            assert float(ratio) == pytest.approx(seconds / unit, abs=0.051), name
            if table is rows:   # percent of copy bandwidth: bytes per second over the copy's 8 bytes per element
                want = 100 * (row_bytes[name] * n / seconds) / (8 * n / copy_s) if name in row_bytes else None
                assert share == (["-"] if want is None else share) and \
                    (want is None or float(share[0]) == pytest.approx(want, abs=0.051)), (name, share, want)
    # where the figures were measured: the CPU's vector ISA and the kernel variant it dispatched
    from bandpo_lut.runtime import _extension
    cpu = _extension.facts()["cpu"]
    assert f"CPU kernels: vector ISA {cpu['isa']}, variant {cpu['variant']}" in "\n".join(out)
    head = next(i for i, line in enumerate(out) if line.startswith("accuracy of bandpo_lut.bounds"))
    accuracy = [line.split() for line in out[head + 1:head + 4]]
    assert [a[0] for a in accuracy] == ["kl", "tv", "chi2"]
    for a in accuracy:   # "<name> upper max rel err <e> lower max err <e> ..."
        assert float(a[5]) <= 1e-6 and float(a[9]) <= 1e-6, a


def test_bench_baselines_compute_what_they_are_compared_with():
    """The plain-PyTorch rows time real band computations: the 50-step bisection finds the KL roots
    (mpmath), the tv/chi2 closed forms clip as `bandpo_lut.clip` does."""
    import numpy as np
    import torch

    import bandpo_lut
    from bandpo_lut.cli.bench import command as bench
    from bandpo_lut.tables import accuracy

    rng = np.random.default_rng(5)
    p = 1 / (1 + np.exp(-rng.uniform(-7, 7, 60)))
    rlo, rup = accuracy.exact_bounds_f64(p, np.full(60, 0.05), "kl")
    lo, up = bench.kl_bisection(torch.from_numpy(p), 0.05)
    np.testing.assert_allclose(up.numpy(), rup, rtol=1e-12)
    np.testing.assert_allclose(lo.numpy(), rlo, rtol=1e-12, atol=1e-14)
    g = torch.Generator().manual_seed(6)
    q = torch.sigmoid(torch.randn(5000, generator=g, dtype=torch.float64) * 3)
    ratio = torch.exp(torch.randn(5000, generator=g, dtype=torch.float64))
    for name, closed_form in (("tv", bench.tv_closed_form), ("chi2", bench.chi2_closed_form)):
        torch.testing.assert_close(closed_form(ratio, q, 0.05), bandpo_lut.clip(ratio, q, 0.05, name),
                                   rtol=1e-12, atol=0, msg=name)


@pytest.mark.parametrize("bad, message", [(["--n", "0"], "argument --n: expected an integer >= 1, got '0'"),
                                          (["--threads", "0"], "argument --threads: expected an integer >= 1"),
                                          (["--accuracy-points", "-1"], "argument --accuracy-points: expected"),
                                          (["--device", "nope"], "--device: unknown device 'nope'"),
                                          (["--device", "cuda:9"], "--device cuda:9"),
                                          (["--fused-linear", "--fl-dtype", "float16"],
                                           "argument --fl-dtype: invalid choice: 'float16'"),
                                          (["--fused-linear", "--fl-dtype", "bfloat16", "float32", "bfloat16"],
                                           "--fl-dtype: bfloat16 given more than once"),
                                          (["--fl-dtype", "bfloat16"], "--fl-dtype: the fused-linear section's "
                                                                       "options apply with --fused-linear only"),
                                          (["--fl-vocab", "64", "--fl-chunk", "8"], "--fl-vocab, --fl-chunk: the "
                                                                                     "fused-linear section's")])
def test_bench_bad_arguments(bad, message, capsys):
    """argparse-style: usage, one error line naming the argument, exit 2 (before any timing)."""
    import torch

    if bad[-1].startswith("cuda") and torch.cuda.device_count() > 9:
        pytest.skip("this machine has a tenth GPU")
    with pytest.raises(SystemExit) as e:
        main(["bench"] + bad)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: bandpo-lut bench") and f"bandpo-lut bench: error: {message}" in err, err


def test_bench_fused_linear_options_parse_with_their_defaults(monkeypatch):
    """--fl-dtype takes one or both dtypes, in the order given; the options not given get their documented
    defaults (the section is stopped before its first child: `run` is replaced by a recorder)."""
    from bandpo_lut.cli.bench import fused_linear

    seen = []
    monkeypatch.setattr(fused_linear, "run", lambda args, device: seen.append(args) or 0)
    assert main(["bench", "--fused-linear", "--fl-dtype", "bfloat16", "float32", "--fl-vocab", "64"]) == 0
    assert main(["bench", "--fused-linear"]) == 0
    given, default = seen
    assert given.fl_dtype == ["bfloat16", "float32"] and given.fl_vocab == [64] and given.fl_tokens == 4096
    assert (default.fl_dtype, default.fl_tokens, default.fl_hidden, default.fl_vocab, default.fl_repeats,
            default.fl_chunk) == (["float32"], 4096, 1024, [32768, 131072], 3, None)


def test_bench_liger_row_says_why_it_is_missing(monkeypatch):
    """Liger's row is timed on CUDA only, and only where liger-kernel is installed (found without importing it);
    otherwise the reason names the device or the package to install."""
    import importlib.util

    import torch

    from bandpo_lut.cli.bench import fused_linear

    assert "on cpu" in fused_linear.liger_missing(torch.device("cpu"))
    real_find_spec = importlib.util.find_spec
    installed = {"liger_kernel": False}

    def find_spec(name, *args):
        if name == "liger_kernel":
            return object() if installed[name] else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    why = fused_linear.liger_missing(torch.device("cuda"))
    assert "not installed" in why and f"pip install liger-kernel=={fused_linear.LIGER_VERSION}" in why, why
    installed["liger_kernel"] = True
    assert fused_linear.liger_missing(torch.device("cuda")) is None


@pytest.mark.slow
def test_bench_fused_linear_bfloat16_rows_and_a_failed_liger_child(tmp_path, capsys, monkeypatch):
    """bfloat16 rows are measured (the unfused path holding float32 logits); a Liger child that fails (here: made
    to run where liger-kernel cannot, on the CPU) is reported once, in its row's note, and never fails the bench
    (exit 0; no Liger child for the later rows)."""
    from bandpo_lut.cli.bench import fused_linear

    monkeypatch.setattr(fused_linear, "liger_missing", lambda device: None)
    record = tmp_path / "fl.json"
    argv = ["bench", "--fused-linear", "--fl-tokens", "64", "--fl-hidden", "16", "--fl-vocab", "4096", "--fl-repeats",
            "1", "--fl-dtype", "bfloat16", "--json", str(record)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    children = [line for line in err.splitlines() if line.startswith("bench: [")]
    assert [line.split(", ")[-1].split(" path")[0] for line in children] == ["unfused", "fused", "liger", "unfused",
                                                                             "fused"], err
    data = json.loads(record.read_text())
    assert [(r["dtype"], r["head"]) for r in data["fused_linear_rows"]] == [("bfloat16", "frozen"),
                                                                            ("bfloat16", "trained")]
    for row in data["fused_linear_rows"]:
        assert row["unfused_mb"] >= 64 * 4096 * 4 / 2 ** 20 and row["fused_s"] > 0 and row["liger_s"] is None, row
    assert data["liger_missing"].startswith("its child failed: ") and data["liger_missing"] in out, out


# --- demo, plot, generate, verify ----------------------------------------------------------------------------------

# a demo small enough for a unit test (well under a second per method)
TINY_DEMO = ["demo", "--steps", "3", "--contexts", "4", "--vocab", "200", "--good", "2",
             "--good-ranks", "5,50", "--group", "4", "--tokens", "4", "--minibatches", "2"]
SUMMARY = re.compile(r"([\w-]+): final entropy ([\d.]+), low-prob clip-high rate ([\d.]+)")


def test_demo_tiny_run_writes_table_summary_and_figure(tmp_path, capsys):
    out = tmp_path / "fig" / "demo.png"
    assert main(TINY_DEMO + ["--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "lowprob_clip_high" in text and "summary" in text
    methods = {m for m, _, _ in SUMMARY.findall(text)}
    assert methods == {"ppo-clip", "clip-higher", "dcpo", "bandpo", "dppo"}
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_svg_subset_and_no_figure(tmp_path, capsys):
    out = tmp_path / "demo.svg"
    assert main(TINY_DEMO + ["--methods", "bandpo,ppo-clip", "--seeds", "2", "--out", str(out)]) == 0
    assert b"<svg" in out.read_bytes()[:500]
    assert main(TINY_DEMO + ["--methods", "dcpo", "--out", "none"]) == 0
    assert "figure written" not in capsys.readouterr().out.split("summary")[-1]


@pytest.mark.slow
def test_demo_quick_shows_the_mechanism(tmp_path, capsys):
    """The acceptance run: --quick exits 0 and BandPO clips low-probability upward moves less."""
    assert main(["demo", "--quick", "--out", str(tmp_path / "demo.png")]) == 0
    rates = {m: float(rate) for m, _, rate in SUMMARY.findall(capsys.readouterr().out)}
    assert rates["bandpo"] < rates["ppo-clip"], rates


def test_plot_png_and_svg(tmp_path, capsys):
    png, svg = tmp_path / "bands.png", tmp_path / "sub" / "bands.svg"
    assert main(["plot", "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", "--divergences", "kl", "--deltas", "0.02", "--max-ratio", "10",
                 "--no-baselines", "--p-min", "1e-3", "--out", str(svg)]) == 0
    assert b"<svg" in svg.read_bytes()[:500]
    assert "written to" in capsys.readouterr().out


ARGPARSE_ERRORS = [  # rejected by argparse itself: exit status 2, the option named
    (["demo", "--steps", "0"], "--steps"),
    (["demo", "--steps", "many"], "--steps"),
    (["demo", "--methods", "ppo,bandpo"], "unknown method"),
    (["demo", "--max-ratio", "0.5"], "--max-ratio"),
    (["demo", "--good-ranks", "5"], "--good-ranks"),
    (["demo", "--lr", "-1"], "--lr"),
    (["plot", "--divergences", "kl,nope"], "unknown divergence"),
    (["plot", "--divergences", "reverse_kl"], "the compiled ones: chi2,hellinger,kl,tv"),  # no kernel to draw
    (["plot", "--deltas", "0.05,-1"], "--deltas"),
    (["plot", "--p-min", "0"], "--p-min"),
    (["plot", "--p-min", "abc"], "expected a number in (0, 0.5), got 'abc'"),
    (["plot", "--max-ratio", "abc"], "expected a number >= 1 or 'none', got 'abc'"),
    (["plot", "--deltas", "5"], "--deltas: delta: 5.0 is outside"),  # outside the tables' range: named by its flag
    (["verify", "--seed", "-5", "x.bplut"], "--seed"),
    (["demo", "--no-such-option"], "unrecognized arguments"),
]


@pytest.mark.parametrize("argv,message", ARGPARSE_ERRORS, ids=[" ".join(a) for a, _ in ARGPARSE_ERRORS])
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


RUN_ERRORS = [  # checks that involve several arguments or the tables: returned status 2 and a message
    (TINY_DEMO + ["--out", "demo.jpg"], ".png or .svg"),
    (TINY_DEMO + ["--vocab", "20"], "--good-ranks"),
    (TINY_DEMO + ["--minibatches", "100"], "--minibatches"),
    (["plot", "--out", "bands.pdf"], ".png or .svg"),
]


@pytest.mark.parametrize("argv,message", RUN_ERRORS, ids=[" ".join(a[-2:]) for a, _ in RUN_ERRORS])
def test_bad_combinations_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written, but if it were, not into the repo
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv,message", [
    (["generate", "--divergence", "kl", "--out", "newtables/"], "--out: cannot write newtables/: it names a folder"),
    (["bench", "--json", "tables/kl.bplut"], "--json 'tables/kl.bplut': the name must end in .json"),
    (["bench", "--json", "rows/"], "the name must end in .json"),
    (["bench", "--json", ""], "the name must end in .json"),
])
def test_an_output_path_that_cannot_be_meant_is_refused_before_any_work(argv, message, capsys, tmp_path, monkeypatch):
    """A folder name for a file (a trailing slash), or a bench report over a file that is not a .json (a table):
    refused naming the flag before minutes of work, nothing written or replaced."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tables").mkdir()
    table = tmp_path / "tables" / "kl.bplut"
    table.write_bytes(b"a table")
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tables"] and table.read_bytes() == b"a table"


def test_info_exits_1_when_a_shipped_table_does_not_load(capsys, tmp_path, monkeypatch):
    """A damaged shipped table is reported in its place (the others still shown), and the command fails."""
    from bandpo_lut.tables import store as tables

    for name in tables.SHIPPED:
        (tmp_path / f"{name}.bplut").write_bytes(tables.shipped_path(name).read_bytes())
    (tmp_path / "kl.bplut").write_bytes(b"damaged")
    monkeypatch.setattr(tables, "shipped_dir", lambda: tmp_path)
    tables._load_shipped.cache_clear()
    try:
        assert main(["info"]) == 1
        text = capsys.readouterr().out
        assert "kl: " in text and "tv: " + str(tmp_path / "tv.bplut") in text
        assert main(["info", "--json"]) == 1
        info = json.loads(capsys.readouterr().out)
        assert "error" in info["tables"]["kl"] and "error" not in info["tables"]["tv"]
    finally:
        tables._load_shipped.cache_clear()


def test_a_missing_extension_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    from bandpo_lut.runtime import _extension

    def not_built():
        raise ImportError("bandpo_lut._C is not built (stand-in for a failed build)")

    monkeypatch.setattr(_extension, "load", not_built)
    assert main(["plot", "--out", str(tmp_path / "bands.png")]) == 1
    err = capsys.readouterr().err
    assert err == "bandpo-lut plot: error: bandpo_lut._C is not built (stand-in for a failed build)\n"
    assert not (tmp_path / "bands.png").exists()


@pytest.mark.slow
def test_generate_and_verify_cli(tmp_path, capsys):
    out = tmp_path / "kl_small.bplut"
    args = ["generate", "--divergence", "kl", "--out", str(out), "--t-max", "10", "--t-density", "4",
            "--delta-min", "0.05", "--delta-max", "0.5", "--s-nodes", "6", "--ghost", "6", "--dps", "30",
            "--accuracy-points", "10", "--workers", "2", "--quiet", "--allow-inaccurate"]
    assert main(args) == 0
    assert "wrote" in capsys.readouterr().out
    # a coarse table misses 1e-6 and must fail verify; a shipped table passes
    assert main(["verify", str(out), "--points", "30", "--dense-p", "200", "--dense-delta", "20"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert main(["verify", str(tables.shipped_path("chi2")), "--points", "30", "--dense-p", "400",
                 "--dense-delta", "40"]) == 0
    corrupt = tmp_path / "bad.bplut"
    corrupt.write_bytes(out.read_bytes()[:-7])
    assert main(["verify", str(corrupt), "--points", "5"]) == 1
    assert "truncated" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["generate", "--divergence", "kl", "--s-nodes", "2"])
    with pytest.raises(SystemExit):
        main(["generate"])      # --divergence is required


def _imports_of(path, package):
    """The bandpo_lut modules a file imports, at its top or inside a function."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)   # `from pkg import module`
    return {name for name in found if name.startswith(package)}


def test_the_bench_modules_import_no_cycle_and_run_no_code_strings():
    """`bench`'s modules import downward only (command -> fused_linear -> measure; the child imports the two
    it measures), and its child processes run a module (`python -m`), not code kept in a string (`-c`)."""
    from pathlib import Path

    import bandpo_lut.cli.bench as bench_package

    folder = Path(bench_package.__file__).parent
    package = "bandpo_lut.cli.bench"
    graph = {f"{package}.{p.stem}": _imports_of(p, package) - {package} for p in folder.glob("*.py")
             if p.stem != "__init__"}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph.get(start, ()))

    cycles = [m for m in graph if reaches(m, m)]
    assert not cycles, {m: graph[m] for m in cycles}
    for path in folder.glob("*.py"):
        assert '"-c"' not in path.read_text(), path.name
