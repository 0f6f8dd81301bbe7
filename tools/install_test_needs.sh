#!/usr/bin/env bash
# Install what `pytest -q tests` needs into the active environment (torch and bandpo_lut come first: README).
#   1. requirements-test.txt: pytest, mpmath, numpy, matplotlib and the pinned verl and TRL (with their deps);
#   2. skyrl-train (and the ray 2.51 it needs), WITHOUT dependencies, into .skyrl-site/ (requirements-skyrl.txt
#      says why it cannot share the venv);
#   3. skyrl 0.4 (SkyRL's current package; and the two small packages its loss path imports), WITHOUT
#      dependencies, into .skyrl04-site/ (requirements-skyrl04.txt says why);
#   4. openrlhf and deepspeed, WITHOUT dependencies, into .openrlhf-site/ (requirements-openrlhf.txt says why).
# The folders sit at the repository root, where their tests look for them. A folder made from the same
# requirements file is kept (a second venv on the same interpreter reuses it); a changed pin reinstalls it.
set -euo pipefail
cd "$(dirname "$0")/.."

pip install -r requirements-test.txt

# install_apart FOLDER REQUIREMENTS PIP-FLAGS...: `pip install --no-deps --target FOLDER`, unless FOLDER was made
# from this very REQUIREMENTS file.
install_apart() {
  local folder=$1 requirements=$2
  shift 2
  if cmp -s "$requirements" "$folder/.installed-from"; then
    echo "$folder: up to date with $requirements"
    return 0
  fi
  rm -rf "$folder"
  pip install --no-deps --target "$folder" "$@" -r "$requirements"
  cp "$requirements" "$folder/.installed-from"
}

install_apart .skyrl-site requirements-skyrl.txt --ignore-requires-python --upgrade
install_apart .skyrl04-site requirements-skyrl04.txt --ignore-requires-python
install_apart .openrlhf-site requirements-openrlhf.txt --no-build-isolation
