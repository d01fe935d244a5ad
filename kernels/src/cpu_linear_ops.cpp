// Matrix products of few rows (a decode step's tokens) on a linear layer's plain weight [out, in], for the batch
// generator's packed forwards: x @ weight.T (+ bias) (+ residual), and a gated-SiLU MLP's two products with the SiLU
// and the product of the two. oneDNN's kernels suit many rows; with few, a product is a read of the whole weight, and
// this one streams the weight once (each tile's rows prefetched while the tile before them is computed), keeps every
// input row in registers against it, and needs no packed copy of the weight. Registered as
// torch.ops.hf_paged_cache.linear_rows_cpu / gated_rows_cpu; kernels/cpu_linear.py calls them and holds their torch
// references. Built with the attention kernel (cpu_attention.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t LANES = Vec::size();
constexpr int NR = 4;                     // weight rows (outputs) per tile
constexpr int MR = LANES >= 16 ? 6 : 2;  // input rows per tile: MR * NR accumulators, NR weights and an input in registers

// sums[j] = the sum across the lanes of acc[j], j < N.
template <int N>
inline void lane_sums(const Vec* acc, float* sums) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (N == 4) {  // four at once: pairs of lanes added across the vectors, then the halves of what is left
    const __m512 a = acc[0], b = acc[1], c = acc[2], d = acc[3];
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                      _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
    _mm_storeu_ps(sums, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
    return;
  }
#endif
  for (int j = 0; j < N; ++j) {
    float lanes[LANES];
    acc[j].store(lanes);
    float total = 0.f;
    for (int64_t l = 0; l < LANES; ++l) total += lanes[l];
    sums[j] = total;
  }
}

// sums [M][N] (row stride NR) = rows x[0:M] (`k` floats apart) . weight rows w[0:N] (`k` floats apart), while the
// `ahead` weight rows at `next` (the next tile's) are fetched into the cache.
// acc[i][j] += x[i][c : c + count] . w[j][c : c + count] (count < LANES: a partial step, zeros past the end).
template <int M, int N, bool PARTIAL>
__attribute__((always_inline)) inline void step(const float* x, const float* w, int64_t k, int64_t c, int64_t count,
                                                Vec (&acc)[M][N]) {
  Vec wv[N];
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) wv[j] = PARTIAL ? Vec::loadu(w + j * k + c, count) : Vec::loadu(w + j * k + c);
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) {
    const Vec xv = PARTIAL ? Vec::loadu(x + i * k + c, count) : Vec::loadu(x + i * k + c);
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j) acc[i][j] = at::vec::fmadd(xv, wv[j], acc[i][j]);
  }
}

// sums [M][N] (row stride NR) = rows x[0:M] (`k` floats apart) . weight rows w[0:N] (`k` floats apart), while the
// `ahead` weight rows at `next` (the next tile's) are fetched into the cache.
template <int M, int N>
void tile(const float* x, const float* w, int64_t k, float* sums, const float* next, int ahead) {
  Vec acc[M][N];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j) acc[i][j] = Vec(0.f);
  int64_t c = 0;
  for (; c + LANES <= k; c += LANES) {
    for (int r = 0; r < ahead; ++r) __builtin_prefetch(next + r * k + c, 0, 3);
    step<M, N, false>(x, w, k, c, LANES, acc);
  }
  if (c < k) step<M, N, true>(x, w, k, c, k - c, acc);
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) lane_sums<N>(acc[i], sums + i * NR);
}

// y[m, n] = x[m] . w[n] (+ bias[n]) (+ residual[m, n]) for outputs [n0, n1) of every row: tiles of NR outputs (then one
// at a time), MR rows at a time (then two, then one), each tile fetching the next one's weight rows.
void products(const float* x, int64_t rows, int64_t k, const float* w, const float* bias, const float* residual,
              float* y, int64_t n_total, int64_t n0, int64_t n1) {
  const int64_t blocks = rows / MR + (rows % MR) / 2 + (rows % MR) % 2;  // the tile calls per output tile
  float sums[MR * NR];
  for (int64_t n = n0; n < n1;) {
    const int wide = n + NR <= n1 ? NR : 1;
    const int64_t after = n + wide;  // the next tile's first weight row, prefetched over this tile's calls
    const int ahead_total = static_cast<int>(std::min<int64_t>(after < n1 ? NR : 0, n1 - after));
    const float* wn = w + n * k;
    int64_t block = 0;
    for (int64_t m = 0; m < rows; ++block) {
      const int64_t first = block * ahead_total / blocks, last = (block + 1) * ahead_total / blocks;
      const float* next = w + (after + first) * k;
      const int ahead = static_cast<int>(last - first);
      const float* xm = x + m * k;
      int count;
      if (rows - m >= MR) {
        count = MR;
        wide == NR ? tile<MR, NR>(xm, wn, k, sums, next, ahead) : tile<MR, 1>(xm, wn, k, sums, next, ahead);
      } else if (rows - m >= 2) {
        count = 2;
        wide == NR ? tile<2, NR>(xm, wn, k, sums, next, ahead) : tile<2, 1>(xm, wn, k, sums, next, ahead);
      } else {
        count = 1;
        wide == NR ? tile<1, NR>(xm, wn, k, sums, next, ahead) : tile<1, 1>(xm, wn, k, sums, next, ahead);
      }
      for (int i = 0; i < count; ++i) {
        for (int j = 0; j < wide; ++j) {
          float value = sums[i * NR + j];
          if (bias) value += bias[n + j];  // the product rounds, then each sum: as separate ops would
          if (residual) value += residual[(m + i) * n_total + n + j];
          y[(m + i) * n_total + n + j] = value;
        }
      }
      m += count;
    }
    n += wide;
  }
}

// Splits outputs [0, n) among torch's threads in whole tiles.
template <typename F>
void over_outputs(int64_t n, const F& body) {
  const int64_t tiles = (n + NR - 1) / NR;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) { body(begin * NR, std::min(end * NR, n)); });
}

void check(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, name, ": float32 only");
  TORCH_CHECK(weight.dim() == 2 && x.size(-1) == weight.size(1), name, ": x [..., in] and weight [out, in]");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == weight.size(0)), name,
              ": bias must be float32 [out]");
}

at::Tensor linear_rows_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                           const c10::optional<at::Tensor>& residual) {
  check(x, weight, bias, "linear_rows_cpu");
  const at::Tensor input = x.contiguous(), w = weight.contiguous();
  const int64_t k = w.size(1), n = w.size(0), rows = k ? input.numel() / k : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, input.options());
  at::Tensor b = bias ? bias->contiguous() : at::Tensor(), r;
  if (residual) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->numel() == rows * n,
                "linear_rows_cpu: residual must be float32 of the output's shape");
    r = residual->contiguous();
  }
  if (rows == 0 || n == 0) return out;
  const float* xp = input.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  const float* rp = residual ? r.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  over_outputs(n, [&](int64_t n0, int64_t n1) { products(xp, rows, k, wp, bp, rp, op, n, n0, n1); });
  return out;
}

at::Tensor gated_rows_cpu(const at::Tensor& x, const at::Tensor& gate_weight, const c10::optional<at::Tensor>& gate_bias,
                          const at::Tensor& up_weight, const c10::optional<at::Tensor>& up_bias) {
  check(x, gate_weight, gate_bias, "gated_rows_cpu");
  check(x, up_weight, up_bias, "gated_rows_cpu");
  TORCH_CHECK(gate_weight.sizes() == up_weight.sizes(), "gated_rows_cpu: gate and up weights of one shape");
  const at::Tensor input = x.contiguous(), gw = gate_weight.contiguous(), uw = up_weight.contiguous();
  const int64_t k = gw.size(1), n = gw.size(0), rows = k ? input.numel() / k : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, input.options());
  at::Tensor up = at::empty({rows, n}, input.options());
  at::Tensor gb = gate_bias ? gate_bias->contiguous() : at::Tensor(), ub = up_bias ? up_bias->contiguous() : at::Tensor();
  if (rows == 0 || n == 0) return out;
  const float* xp = input.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* up_p = up.data_ptr<float>();
  over_outputs(n, [&](int64_t n0, int64_t n1) {
    products(xp, rows, k, gw.data_ptr<float>(), gate_bias ? gb.data_ptr<float>() : nullptr, nullptr, op, n, n0, n1);
    products(xp, rows, k, uw.data_ptr<float>(), up_bias ? ub.data_ptr<float>() : nullptr, nullptr, up_p, n, n0, n1);
    // silu(gate) * up over this thread's outputs, as torch's SiLU computes it: x / (1 + exp(-x))
    const Vec one(1.f);
    for (int64_t m = 0; m < rows; ++m) {
      float* g = op + m * n;
      const float* u = up_p + m * n;
      int64_t j = n0;
      for (; j + LANES <= n1; j += LANES) {
        const Vec gv = Vec::loadu(g + j);
        (gv / (one + gv.neg().exp()) * Vec::loadu(u + j)).store(g + j);
      }
      if (j < n1) {
        const int64_t count = n1 - j;
        const Vec gv = Vec::loadu(g + j, count);
        (gv / (one + gv.neg().exp()) * Vec::loadu(u + j, count)).store(g + j, count);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_paged_cache, m) {
  m.def("linear_rows_cpu(Tensor x, Tensor weight, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("gated_rows_cpu(Tensor x, Tensor gate_weight, Tensor? gate_bias, Tensor up_weight, Tensor? up_bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_paged_cache, CPU, m) {
  m.impl("linear_rows_cpu", &linear_rows_cpu);
  m.impl("gated_rows_cpu", &gated_rows_cpu);
}
