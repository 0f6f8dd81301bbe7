"""`bandpo-lut bench`, `info`, and every command's --help, through the CLI dispatcher."""
from __future__ import annotations

import json

import pytest

from bandpo_lut.cli import SUBCOMMANDS, main


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert "usage: bandpo-lut " + command in capsys.readouterr().out


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
    assert info["tables"]["kl"]["accuracy"]["upper_max_rel_error"] <= 2e-7
    for name, t in info["tables"].items():       # the whole-file checksum, the one the reader verified
        header = tables.load(t["path"], name).header
        assert t["sha256"] == header["file_sha256"] != header["payload_sha256"] == t["payload_sha256"]
        assert t["format_version"] == table_format.FORMAT_VERSION


def test_bench_small_run(capsys):
    args = ["bench", "--n", "4096", "--batch", "2", "--tokens", "64", "--repeats", "1", "--skip-bisection",
            "--skip-memory", "--accuracy-points", "5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for row in ("torch.clamp", "bandpo_lut.clip kl, scalar delta", "per-token delta", "canonical eager PPO loss",
                "bandpo_lut.policy_loss", "accuracy of bandpo_lut.bounds"):
        assert row in out


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
