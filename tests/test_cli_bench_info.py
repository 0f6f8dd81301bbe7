"""`bandpo-lut bench`, `info`, and every command's --help, through the CLI dispatcher."""
from __future__ import annotations

import argparse
import importlib
import json

import pytest

from bandpo_lut.cli import SUBCOMMANDS, main


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


def test_unknown_command_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_info_text_and_json(capsys):
    from bandpo_lut import table_format, tables

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
              "bandpo_lut.clip kl, scalar delta", "bandpo_lut.clip kl, log_p_old, scalar delta",
              "bandpo_lut.clip kl, per-token delta", "bandpo_lut.clip tv, scalar delta",
              "bandpo_lut.clip chi2, scalar delta")


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
    assert tuple(rows) == BENCH_ROWS and len(loss_rows) == 2
    for table, unit in ((rows, rows["torch.clamp(ratio, 0.8, 1.28)"]), (loss_rows, next(iter(loss_rows.values())))):
        for name, seconds in table.items():
            assert 0 < seconds < 60, name
            line = next(line for line in out if line.startswith(name))
            ms, ratio = (float(v) for v in line[len(name):].split())
            assert ms == pytest.approx(seconds * 1e3, abs=6e-4), name
            assert ratio == pytest.approx(seconds / unit, abs=0.051), name
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
    from bandpo_lut import accuracy, bench

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
                                          (["--device", "cuda:9"], "--device cuda:9")])
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
