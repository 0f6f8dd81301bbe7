"""Build helpers for setup.py, importable and tested without building (tests/build/test_setup_helpers.py).

setup.py puts tools/ on sys.path and imports this package; it is not installed with bandpo_lut.
  common.py          BuildConfigError (a refused build), env flags, a command runner
  cuda.py            CUDA or CPU-only: toolkit detection, nvcc version and architectures, the decision
  build_facts.py     the facts a build records (_build_config.py, the build-facts header), the sources
  flags.py           the extension's compiler and linker flags
  toolchain_probe.py refuses a compiler whose shared objects crash next to torch
"""
