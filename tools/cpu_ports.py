#!/usr/bin/env python
"""Which AVX-512 instructions of the fused KL kernel compete with its FMAs for the same execution pipes, on this CPU.

Every instruction the kernel leans on is timed in 12 independent chains (zmm registers, enough to cover its
latency), alone and interleaved one-to-one with an FMA, by a small C++ program compiled here (g++ -O2
-march=native). Times are in units of the FMA's own throughput (one FMA alone = 1.00). A pair that costs 2.00
shares the FMA's pipes; 1.00 runs beside them. On AMD Zen 4 a 512-bit FMA occupies both FMA pipes, so every
instruction that needs one of them (multiplies, permutes, compares into a mask register, vscalefps for two slots)
adds to the FMA count that bounds the kernel, while adds, min/max, conversions, roundings and integer adds run on
other pipes. This is what csrc/cpu/simd/simd_avx512.h's exp and kl_simd_body.inc's passes are arranged around.

usage: python tools/cpu_ports.py   (x86-64 with AVX-512F/DQ and g++; prints a table)
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROGRAM = r"""
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
template <class Fn> double best_of(Fn fn) {
  double best = 1e9;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}
#define HIDE asm volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), \
                               "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11))
#define RUN(O1, O2)                                                                                  \
  best_of([&] {                                                                                      \
    __m512 a0 = x, a1 = x, a2 = x, a3 = x, a4 = x, a5 = x, a6 = x, a7 = x, a8 = x, a9 = x, a10 = x, a11 = x; \
    for (long i = 0; i < kIters; ++i) {                                                              \
      O1(a0); O2(a1); O1(a2); O2(a3); O1(a4); O2(a5); O1(a6); O2(a7); O1(a8); O2(a9); O1(a10); O2(a11); \
      HIDE;                                                                                          \
    }                                                                                                \
    sink = _mm512_add_ps(sink, _mm512_add_ps(a0, a11));                                              \
  }) / (kIters * 12.0)
#define FMA(a) a = _mm512_fmadd_ps(a, c0, c1)
#define MUL(a) a = _mm512_mul_ps(a, c0)
#define ADD(a) a = _mm512_add_ps(a, c0)
#define MAX(a) a = _mm512_max_ps(a, c0)
#define CVT(a) a = _mm512_cvtepi32_ps(_mm512_castps_si512(a))
#define ROUND(a) a = _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define PERM2(a) a = _mm512_permutex2var_ps(a, idx, c1)
#define PERM1(a) a = _mm512_permutexvar_ps(idx, a)
#define SCALEF(a) a = _mm512_scalef_ps(a, c0)
#define IADD(a) a = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), idx))
#define BLEND(a) a = _mm512_mask_blend_ps(0x5555, a, c0)
#define CMPMASK(a) a = _mm512_mask_mov_ps(a, _mm512_cmp_ps_mask(a, c0, _CMP_LT_OQ), c1)
#define FPCLASS(a) a = _mm512_mask_mov_ps(a, _mm512_fpclass_ps_mask(a, 0xff), c1)
#define ROW(NAME, OP) printf("%-40s %6.2f %6.2f\n", NAME, RUN(OP, OP) / unit, 2.0 * RUN(OP, FMA) / unit)
int main() {
  const long kIters = 10000000;
  __m512 x = _mm512_set1_ps(1.0f), sink = _mm512_setzero_ps();
  __m512i idx = _mm512_set_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 c0 = _mm512_set1_ps(0.5f), c1 = _mm512_set1_ps(0.25f);
  asm volatile("" : "+v"(idx), "+v"(c0), "+v"(c1), "+v"(x));
  const double unit = RUN(FMA, FMA);
  printf("%-40s %6s %6s\n", "instruction (zmm)", "alone", "+FMA");
  ROW("vfmadd (the unit)", FMA);
  ROW("vmulps", MUL);
  ROW("vpermt2ps (32-entry permute)", PERM2);
  ROW("vpermps (16-entry permute)", PERM1);
  ROW("vscalefps", SCALEF);
  ROW("vcmpps into a mask, masked move", CMPMASK);
  ROW("vfpclassps into a mask, masked move", FPCLASS);
  ROW("vaddps", ADD);
  ROW("vmaxps", MAX);
  ROW("vcvtdq2ps", CVT);
  ROW("vrndscaleps", ROUND);
  ROW("vpaddd", IADD);
  ROW("vblendmps", BLEND);
  float s[16];
  _mm512_storeu_ps(s, sink);
  return s[0] == 12345.0f;
}
"""


def main() -> int:
    gxx = shutil.which("g++")
    if gxx is None:
        sys.exit("cpu_ports: g++ not found (the instructions are timed by a C++ program compiled here)")
    flags = open("/proc/cpuinfo").read() if Path("/proc/cpuinfo").exists() else ""
    if " avx512f " not in flags or " avx512dq " not in flags:
        sys.exit("cpu_ports: this CPU has no AVX-512F/DQ; the table is about the AVX-512 kernel")
    model = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("model name")), "?")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "ports.cpp", Path(tmp) / "ports"
        src.write_text(PROGRAM)
        subprocess.run([gxx, "-O2", "-march=native", "-std=c++17", str(src), "-o", str(exe)], check=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    print(f"CPU {model}; reciprocal throughput in units of one zmm FMA's (alone: per instruction; +FMA: per pair)")
    print(out, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
