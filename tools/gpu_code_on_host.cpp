// The GPU kernels' KL element code (csrc/kl_bit_cells.h), compiled for the host with the GPU's layout: the scalar-δ
// cells in p's bits from x_lo's cell (bit_grid_for without tail cells, fit_bit_cell, kl_bits_scalar_delta) and the
// per-token patches in the bits of p and δ (fit_bit_patch, kl_bits_token_delta). Built and run by
// tools/gpu_code_on_host.py; prints the grid, each fit's largest error, then per point "lo up lo_log up_log".
#include "kl_bit_cells.h"
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
using namespace bandpo;
static std::vector<float> read_floats(const char* path) {
  FILE* f = fopen(path, "rb");
  if (f == nullptr) exit(2);
  fseek(f, 0, SEEK_END);
  std::vector<float> v(static_cast<size_t>(ftell(f)) / sizeof(float));
  fseek(f, 0, SEEK_SET);
  if (fread(v.data(), sizeof(float), v.size(), f) != v.size()) exit(3);
  fclose(f);
  return v;
}
int main(int argc, char** argv) {
  // argv: table file (float32 [2][nt + 2][ns + 2]), nt, ns, t_min, t_step, s_min, s_step, δ_min, δ_max, points file
  // (float32 pairs: p, its log-probability), then "scalar" and δ values, or "token" and a file of one δ per point
  TableView tb{};
  tb.nt = atoi(argv[2]);
  tb.ns = atoi(argv[3]);
  tb.t_min = atof(argv[4]);
  tb.t_step = atof(argv[5]);
  tb.s_min = atof(argv[6]);
  tb.s_step = atof(argv[7]);
  tb.delta_min = atof(argv[8]);
  tb.delta_max = atof(argv[9]);
  const std::vector<float> coef = read_floats(argv[1]);
  if (coef.size() != 2 * static_cast<size_t>(tb.nt + 2) * (tb.ns + 2)) return 3;
  tb.coef = coef.data();
  const std::vector<float> xs = read_floats(argv[10]);
  BitGrid g{};
  if (!bit_grid_for(tb, /*tail_cells=*/false, g)) return 4;
  printf("grid %d %d %.9g %.9g %.9g\n", g.first_key, g.side_cells, g.x_lo, g.x_cell, g.x_tail_lo);
  if (std::string(argv[11]) == "token") {
    std::vector<float> patches(2 * static_cast<size_t>(g.side_cells) * g.d_cells * kPatchValues);
    double worst = 0.0;
    for (int c = 0; c < 2 * g.side_cells; ++c) {
      for (int k = 0; k < g.d_cells; ++k) {
        const size_t at = (static_cast<size_t>(c) * g.d_cells + k) * kPatchValues;
        const double e = fit_bit_patch(tb, g, c, k, &patches[at]);
        worst = (e > worst || e != e) ? e : worst;
      }
    }
    printf("fit token %.3g %d\n", worst, g.d_cells);
    const std::vector<float> ds = read_floats(argv[12]);
    for (size_t i = 0; i + 1 < xs.size(); i += 2) {
      float lo, up, llo, lup;
      kl_bits_token_delta<false>(g, patches.data(), xs[i], ds[i / 2], lo, up);
      kl_bits_token_delta<true>(g, patches.data(), xs[i + 1], ds[i / 2], llo, lup);
      printf("%.9g %.9g %.9g %.9g\n", lo, up, llo, lup);
    }
    return 0;
  }
  for (int a = 12; a < argc; ++a) {
    const double delta = atof(argv[a]);
    double ws[4];
    const int js = delta_weights(tb, delta, ws);
    std::vector<double> cell_d(8 * static_cast<size_t>(tb.nt - 1));
    for (int k = 0; k < tb.nt - 1; ++k) collapse_cell(tb, k, js, ws, &cell_d[8 * static_cast<size_t>(k)]);
    std::vector<float> cells(16 * static_cast<size_t>(g.side_cells));
    double worst = 0.0;
    const DeltaConsts<double> dc = delta_consts<double>(delta);
    for (int c = 0; c < 2 * g.side_cells; ++c) {
      const double e = fit_bit_cell(tb, cell_d.data(), dc, g, c, &cells[8 * static_cast<size_t>(c)]);
      worst = (e > worst || e != e) ? e : worst;
    }
    printf("fit %.17g %.3g\n", delta, worst);
    const DeltaConsts<float> c = delta_consts<float>(static_cast<float>(delta));
    for (size_t i = 0; i + 1 < xs.size(); i += 2) {
      float lo, up, llo, lup;
      kl_bits_scalar_delta<false>(g, cells.data(), c, xs[i], lo, up);
      kl_bits_scalar_delta<true>(g, cells.data(), c, xs[i + 1], llo, lup);
      printf("%.9g %.9g %.9g %.9g\n", lo, up, llo, lup);
    }
  }
  return 0;
}
