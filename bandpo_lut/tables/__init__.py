"""The bound tables, everything but the compiled code and the command line.

- `divergences`: the registry of f-divergences (f, the band equation's pieces, closed forms);
- `exact`: the mpmath solver of the band equation;
- `table_format`: the checksummed `.bplut` file format;
- `store`: loading a table file, the shipped tables (`get`, `load`, `Table`, `provenance`, re-exported here);
- `reader`: the pure-PyTorch float64 reader (`bandpo_lut.reference.bounds`, the oracle of the compiled ops);
- `generate`, `verify`, `accuracy`: making a table with mpmath and checking one (library halves; their command
  lines are `bandpo_lut.cli.generate` / `.verify`);
- `checks`: the argument checks every layer shares (numbers, δ against a table's range, the divergence name).

The shipped `.bplut` files are the repository's `tables/`, installed as this package's `data/`.
"""
from bandpo_lut.tables.store import SHIPPED, SUFFIX, Table, get, load, provenance, shipped_dir, shipped_path

__all__ = ["SHIPPED", "SUFFIX", "Table", "get", "load", "provenance", "shipped_dir", "shipped_path"]
