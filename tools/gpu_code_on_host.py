"""The GPU kernels' KL element code, compiled for the host: what a machine without a GPU can check of it.

csrc/kl_bit_cells.h holds the element code of the CUDA band kernels in float arithmetic (the scalar-δ cells in p's
bits, the per-token patches in the bits of p and δ) as host-device functions; the GPU's layout (no tail cells, both
sides from the grid's end) is not the CPU kernels'. tools/gpu_code_on_host.cpp builds that layout from a table with
the same functions and evaluates points with them. Used by tests/runtime/test_bit_cells.py and by
`tools/measure_accuracy.py --gpu-code-on-host`.

    code = HostGpuCode(table, workdir)        # compiles with c++ (or g++), about 5 s
    grid, fits, rows = code.scalar(p, log_p, [1e-3, 0.05])   # rows[k]: (n, 4): lo, up from p; lo, up from log p
    grid, fit, rows = code.token(p, log_p, delta)            # one δ per point
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PROGRAM = HERE / "gpu_code_on_host.cpp"
CSRC = HERE.parent / "csrc"


class HostGpuCode:
    def __init__(self, table, workdir: Path):
        cxx = shutil.which("c++") or shutil.which("g++")
        if cxx is None:
            raise RuntimeError("gpu_code_on_host: no C++ compiler (c++ or g++) on PATH")
        self.dir = Path(workdir)
        self.exe = self.dir / "gpu_code_on_host"
        subprocess.run([cxx, "-O2", "-std=c++17", f"-I{CSRC}", str(PROGRAM), "-o", str(self.exe)], check=True,
                       timeout=600)
        (self.dir / "table.bin").write_bytes(table.coefficients("cpu").numpy().astype(np.float32).tobytes())
        self.head = [str(self.exe), str(self.dir / "table.bin"), str(table.t.n), str(table.s.n), repr(table.t.min),
                     repr(table.t.step), repr(table.s.min), repr(table.s.step), repr(table.delta_min),
                     repr(table.delta_max), str(self.dir / "points.bin")]

    def _run(self, p, log_p, tail) -> list[str]:
        pairs = np.stack([np.asarray(p, np.float32), np.asarray(log_p, np.float32)], axis=1)
        (self.dir / "points.bin").write_bytes(np.ascontiguousarray(pairs).tobytes())
        out = subprocess.run([*self.head, *tail], check=True, capture_output=True, text=True, timeout=1800)
        return out.stdout.splitlines()

    @staticmethod
    def _grid(line: str) -> dict:
        f = line.split()[1:]
        return {"first_key": int(f[0]), "side_cells": int(f[1]), "x_lo": np.float32(f[2]),
                "x_cell": np.float32(f[3]), "x_tail_lo": float(f[4])}

    def scalar(self, p, log_p, deltas):
        """(grid, [(δ, fit error)], [rows per δ]) for scalar δ values."""
        lines = self._run(p, log_p, ["scalar", *map(repr, deltas)])
        n = len(p)
        fits, rows = [], []
        for k in range(len(deltas)):
            at = 1 + k * (n + 1)
            head = lines[at].split()
            fits.append((float(head[1]), float(head[2])))
            rows.append(np.loadtxt(lines[at + 1: at + 1 + n], dtype=np.float64, ndmin=2))
        return self._grid(lines[0]), fits, rows

    def token(self, p, log_p, delta):
        """(grid, (fit error, δ cells), rows) with one δ per point."""
        (self.dir / "deltas.bin").write_bytes(np.ascontiguousarray(delta, dtype=np.float32).tobytes())
        lines = self._run(p, log_p, ["token", str(self.dir / "deltas.bin")])
        head = lines[1].split()
        return self._grid(lines[0]), (float(head[2]), int(head[3])), np.loadtxt(lines[2:], dtype=np.float64, ndmin=2)
