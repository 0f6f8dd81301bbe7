#!/usr/bin/env python3
"""Regenerate shipped tables into tables/ with the default settings (the same as running
`bandpo-lut generate --divergence NAME` for each; use that command for other settings).

    python tools/generate_tables.py            # kl, tv, chi2, hellinger
    python tools/generate_tables.py kl tv

Each table takes one to two minutes on 2 cores; the same inputs give byte-identical files.
"""
import sys

from bandpo_lut.cli import main
from bandpo_lut.tables import SHIPPED

if __name__ == "__main__":
    names = sys.argv[1:] or list(SHIPPED)
    unknown = [n for n in names if n not in SHIPPED]
    if unknown:
        sys.exit(f"generate_tables.py: {unknown} are not shipped tables ({list(SHIPPED)}); "
                 "use `bandpo-lut generate --divergence NAME --out FILE` for others")
    sys.exit(max(main(["generate", "--divergence", name]) for name in names))
