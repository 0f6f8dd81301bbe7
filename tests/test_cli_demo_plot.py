"""`bandpo-lut demo` and `bandpo-lut plot` through the CLI dispatcher: runs and bad arguments."""
from __future__ import annotations

import re

import pytest

from bandpo_lut.cli import main

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
    assert methods == {"ppo-clip", "clip-higher", "dcpo", "bandpo"}
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_svg_subset_and_no_figure(tmp_path, capsys):
    out = tmp_path / "demo.svg"
    assert main(TINY_DEMO + ["--methods", "bandpo,ppo-clip", "--seeds", "2", "--out", str(out)]) == 0
    assert b"<svg" in out.read_bytes()[:500]
    assert main(TINY_DEMO + ["--methods", "dcpo", "--out", "none"]) == 0
    assert "figure written" not in capsys.readouterr().out.split("summary")[-1]


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
    (["plot", "--deltas", "5"], "delta"),  # outside the tables' range
]


@pytest.mark.parametrize("argv,message", RUN_ERRORS, ids=[" ".join(a[-2:]) for a, _ in RUN_ERRORS])
def test_bad_combinations_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written, but if it were, not into the repo
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_missing_extension_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    from bandpo_lut import _extension

    def not_built():
        raise ImportError("bandpo_lut._C is not built (stand-in for a failed build)")

    monkeypatch.setattr(_extension, "load", not_built)
    assert main(["plot", "--out", str(tmp_path / "bands.png")]) == 1
    err = capsys.readouterr().err
    assert err == "bandpo-lut plot: error: bandpo_lut._C is not built (stand-in for a failed build)\n"
    assert not (tmp_path / "bands.png").exists()
