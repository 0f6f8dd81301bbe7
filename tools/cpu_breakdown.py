#!/usr/bin/env python
"""Where the CPU band's time goes: ns per element of each piece of the fused KL kernel (csrc/cpu/simd/kl_simd_body.inc),
for the AVX-512 and AVX2 variants this CPU runs, and of the work around it (output allocation, the parallel split).

The kernel's pieces are timed by a small C++ program compiled here from the repository's own headers
(g++ -O3 -march=native; the kernels keep the extension's per-ISA pragmas): each piece runs alone over an
L1-resident block, so its figure is its throughput cost; the whole kernel then runs over N elements from memory.
The op-level rows time bandpo_lut.clip against torch.clamp and torch.empty in this process, at 1 and 2 threads
(thread CPU time at 1 thread, so that a busy machine's descheduling does not count). Prints a table; needs g++ on
an x86-64 machine.

usage: python tools/cpu_breakdown.py [--n 4194304]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROGRAM = r"""
#include "cpu/simd/kl_simd.h"
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <random>
#include <vector>
using namespace bandpo;
static double now() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}
constexpr int B = 256;
alignas(64) static float in0[B], in1[B], in2[B], out0[B], out1[B];  // in1: t; in2: signed x (AVX2)
template <class Fn> double per_element(Fn fn, long reps) {
  double best = 1e9;
  for (int r = 0; r < 5; ++r) {
    const double t0 = now();
    for (long k = 0; k < reps; ++k) { fn(); asm volatile("" ::: "memory"); }
    best = std::min(best, (now() - t0) / reps / B * 1e9);
  }
  return best;
}
// The table read over a block as the kernel's pass 2 does it (kl_simd_body.inc table_pass: one loop, or cells then
// rows where the vector type reads rows from memory), its values stored.
alignas(64) static float u_b[B];
alignas(64) static std::int32_t off_b[B];
// Each piece over one L1-resident block, then the whole kernel over n elements from memory.
#define ROW(NS, NAME, BODY) printf("%-8s %-50s %6.2f\n", #NS, NAME, per_element([&] { BODY; }, 20000))
#define LOOP(EXPR) for (int i = 0; i < B; i += V::kLanes) EXPR
#define PIECES(NS, TABLES, AT)                                                                       \
  {                                                                                                 \
    using V = NS::V;                                                                                \
    using F = V::F;                                                                                 \
    const V::Consts k = V::consts();                                                                \
    const V::Grid g = V::grid(TABLES);                                                              \
    const V::Tail full = V::tail(V::kLanes);                                                        \
    auto in = [&](const float* a, int i) { return V::load(a + i, full); };                          \
    ROW(NS, "load + store (a copy)", LOOP(V::store(out0 + i, full, in(in0, i))));                  \
    ROW(NS, "division", LOOP(V::store(out0 + i, full, V::div(in(in0, i), in(in1, i)))));           \
    ROW(NS, "log (table-driven)", LOOP(V::store(out0 + i, full, V::log(in(in0, i), k))));          \
    ROW(NS, "exp", LOOP(V::store(out0 + i, full, V::exp(V::sub(V::set1(0.0f), in(in0, i))))));     \
    const auto table_block = [&] {                                                                  \
      F t_least = V::set1(kInf), t_most = V::set1(-kInf);                                           \
      NS::table_pass<V>(TABLES, g, B, AT, off_b, u_b, t_least, t_most, [&](int i, F q, F kap) {     \
        V::store(out0 + i, full, q);                                                                \
        V::store(out1 + i, full, kap);                                                              \
      });                                                                                           \
    };                                                                                              \
    ROW(NS, "table read (q and kappa)", table_block());                                             \
    band.wide = &w;                                                                                 \
    FastRun run{&band, &c, xs.data(), nullptr, rs.data(), nullptr, nullptr, os.data(), n};          \
    for (int clip = 0; clip < 2; ++clip)                                                            \
      for (int lg = 0; lg < 2; ++lg) {                                                              \
        run.x = lg ? ls.data() : xs.data();                                                         \
        run.out = clip ? os.data() : nullptr;                                                       \
        run.lo = clip ? nullptr : os.data();                                                        \
        run.up = clip ? nullptr : us.data();                                                        \
        double best = 1e9;                                                                          \
        for (int r = 0; r < 5; ++r) {                                                               \
          const double t0 = now();                                                                  \
          NS::kl_scalar(run, TABLES, lg, clip);                                                     \
          best = std::min(best, (now() - t0) / n * 1e9);                                            \
        }                                                                                           \
        printf("%-8s whole kernel: %-36s %6.2f\n", #NS, clip ? (lg ? "clip, log p" : "clip, p")    \
                                                             : (lg ? "bounds, log p" : "bounds, p"), best); \
      }                                                                                             \
  }
int main(int argc, char** argv) {
  const long n = std::atol(argv[1]);
  const bool avx512 = argc > 2 && std::string(argv[2]) == "avx512";
  std::mt19937 gen(1); std::uniform_real_distribution<float> U(0, 1);
  for (int i = 0; i < B; ++i) {
    in0[i] = 0.001f + U(gen);
    in1[i] = -13.0f + 26.0f * U(gen);
    in2[i] = (i % 2 ? -0.5f : 0.5f) * std::exp(-13.0f * U(gen));
  }
  std::vector<float> xs(n), ls(n), rs(n), os(n), us(n), cells(448 * 8);
  for (long i = 0; i < n; ++i) {
    ls[i] = -10.0f * U(gen);
    xs[i] = std::exp(ls[i]);
    rs[i] = std::exp(0.3f * (U(gen) - 0.5f));
  }
  for (int kk = 0; kk < 448; ++kk) for (int j = 0; j < 8; ++j) cells[8 * kk + j] = (j % 4 == 0) ? 0.5f : 0.01f;
  WideCells w{}; w.t_min = -14; w.t_max = 14; w.width = 0.875f; w.inv_width = 1 / 0.875f;
  for (int j = 0; j <= WideCells::kDegree; ++j)
    for (int c = 0; c < WideCells::kCells; ++c) w.q[j][c] = j ? 0.01f : 0.5f, w.kappa[j][c] = j ? 0.01f : 1.0f;
  BandParams band{};
  band.max_ratio = 10, band.table.t_min = -14, band.table.t_step = 0.0625, band.table.nt = 449;
  band.cell_f = cells.data();
  const DeltaConsts<float> c = delta_consts<float>(0.05f);
  std::vector<float> bit_cells(2 * 321 * 8);  // cells in p's bits (bit_cells.h), the shipped grid's geometry
  for (size_t i = 0; i < bit_cells.size(); ++i) bit_cells[i] = (i % 4 == 0) ? 0.5f : 0.01f;
  const avx2::V::Tables narrow{bit_cells.data(), 321, (127 - 21) << 4, 8.3152e-7f};
#if defined(__AVX512F__)
  if (avx512) PIECES(avx512, w, in1)
#endif
  PIECES(avx2, narrow, in2)
}
"""


def kernel_rows(n: int) -> list[str]:
    gxx = shutil.which("g++")
    if gxx is None:
        sys.exit("cpu_breakdown: g++ not found (the kernel pieces are timed by a C++ program compiled here)")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "pieces.cpp", Path(tmp) / "pieces"
        src.write_text(PROGRAM)
        cmd = [gxx, "-O3", "-march=native", "-std=c++17", f"-I{REPO / 'csrc'}", str(src), "-o", str(exe)]
        subprocess.run(cmd, check=True)
        avx512 = "avx512f" in Path("/proc/cpuinfo").read_text()
        out = subprocess.run([str(exe), str(n), "avx512" if avx512 else "avx2"], check=True, capture_output=True,
                             text=True)
        return out.stdout.splitlines()


def op_rows(n: int) -> list[str]:
    import torch

    import bandpo_lut

    torch.manual_seed(0)
    logp = -torch.rand(n) * 10
    p, ratio = logp.exp(), torch.exp(torch.randn(n) * 0.3)
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        clock = time.thread_time if threads == 1 else time.perf_counter

        def med(fn, reps=10):
            fn()
            ts = []
            for _ in range(reps):
                t0 = clock()
                fn()
                ts.append(clock() - t0)
            return statistics.median(ts) / n * 1e9

        for name, fn in (("torch.empty (the output's allocation)", lambda: torch.empty(n)),
                         ("torch.empty + fill (allocation, first touch)", lambda: torch.empty(n).fill_(1.0)),
                         ("torch.clamp(ratio, 0.8, 1.28)", lambda: torch.clamp(ratio, 0.8, 1.28)),
                         ("bandpo_lut.clip kl, p, scalar delta", lambda: bandpo_lut.clip(ratio, p, 0.05)),
                         ("bandpo_lut.clip kl, log p, scalar delta", lambda: bandpo_lut.clip(ratio, log_p_old=logp))):
            rows.append(f"{'op':8s} {name + f' ({threads} thr)':50s} {med(fn):6.2f}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1 << 22, help="elements for the whole-kernel and op rows")
    a = ap.parse_args(argv)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"CPU {cpu}, {os.cpu_count()} cores; ns per element (best of 5, kernel rows: thread CPU time)")
    print(f"{'variant':8s} {'piece':50s} {'ns/el':>6s}")
    for line in kernel_rows(a.n):
        print(line)
    for line in op_rows(a.n):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
