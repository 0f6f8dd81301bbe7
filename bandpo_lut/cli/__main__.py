"""`python -m bandpo_lut.cli ...`: the `bandpo-lut` command (what the tests run in fresh processes, and a way in
where the console script is not on PATH)."""
import sys

from bandpo_lut.cli import main

sys.exit(main())
