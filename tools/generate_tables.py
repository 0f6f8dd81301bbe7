#!/usr/bin/env python3
"""Regenerate shipped tables into the repository's tables/ with the default settings (the same as running
`bandpo-lut generate --divergence NAME --out tables/NAME.bplut --force` for each; use that command for other
settings).

    python tools/generate_tables.py            # kl, tv, chi2, hellinger
    python tools/generate_tables.py kl tv

Each table takes one to two minutes on 2 cores; the same inputs give byte-identical files. Stops at the
first table that fails or is interrupted (Ctrl-C), leaving that table's file as it was.
"""
import sys
from pathlib import Path

from bandpo_lut.cli import main
from bandpo_lut.tables.store import SHIPPED

TABLES = Path(__file__).resolve().parent.parent / "tables"

if __name__ == "__main__":
    names = sys.argv[1:] or list(SHIPPED)
    unknown = [n for n in names if n not in SHIPPED]
    if unknown:
        sys.exit(f"generate_tables.py: {unknown} are not shipped tables ({list(SHIPPED)}); "
                 "use `bandpo-lut generate --divergence NAME --out FILE` for others")
    for name in names:
        rc = main(["generate", "--divergence", name, "--out", str(TABLES / f"{name}.bplut"), "--force"])
        if rc:
            sys.exit(rc)
