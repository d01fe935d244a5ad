// One decode query per row over that row's blocks, read through its block table where they lie: the CPU
// counterpart of paged_decode.py's Triton kernel for the torch path (float32, no soft-cap, no sinks).
// Registered as torch.ops.hf_paged_cache.paged_decode_cpu; kernels/cpu_decode.py builds and calls it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>  // AVX2 when built with CPU_CAPABILITY_AVX2 (cpu_decode.py), else portable loops
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// query [rows, heads, d]; k_cache / v_cache [num_blocks, block_size, kv_heads, d] (any strides, unit stride
// along d); block_tables [rows, width] (int32 or int64); seq_lens, first_tokens [rows]: row r reads its tokens
// first_tokens[r] .. seq_lens[r] - 1 (token t in block block_tables[r][t / block_size], slot t % block_size).
at::Tensor paged_decode_cpu(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const at::Tensor& first_tokens, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_decode_cpu: shapes");
  TORCH_CHECK(query.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat, "paged_decode_cpu: float32 only");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "paged_decode_cpu: head dim must be contiguous");
  const at::Tensor q = query.contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous(), firsts = first_tokens.to(at::kLong).contiguous();
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), value_dim = v_cache.size(3);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == dim, "paged_decode_cpu: head counts / dims");
  const int64_t group = heads / kv_heads, width = tables.size(1);
  at::Tensor out = at::zeros({rows, heads, value_dim}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* fp = firsts.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const float fscale = static_cast<float>(scale);
  const int64_t num_blocks = std::min(k_cache.size(0), v_cache.size(0));
  for (int64_t row = 0; row < rows; ++row) {  // checked here: the parallel loop below reads without checks
    TORCH_CHECK(fp[row] >= 0 && lp[row] <= width * block_size, "paged_decode_cpu: row ", row, " reads tokens ",
                fp[row], "..", lp[row], " of a table of ", width, " blocks of ", block_size);
    for (int64_t column = fp[row] / block_size; column * block_size < lp[row]; ++column) {
      const int64_t block = tp[row * width + column];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_cpu: block id ", block, " out of range");
    }
  }

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, kvh = task % kv_heads;
      const int64_t first = fp[row], n = lp[row] - first;
      if (n <= 0) continue;  // nothing to read: zeros
      scores.assign(group * n, 0.f);
      const float* qrow = qp + (row * heads + kvh * group) * dim;
      const int64_t* table = tp + row * width;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = first + i;
        const float* key = kp + table[t / block_size] * ks0 + (t % block_size) * ks1 + kvh * ks2;
        for (int64_t g = 0; g < group; ++g) scores[g * n + i] = dot(qrow + g * dim, key, dim) * fscale;
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        const float top = *std::max_element(s, s + n);
        using Vec = at::vec::Vectorized<float>;
        Vec sums(0.f);
        int64_t i = 0;
        for (; i + Vec::size() <= n; i += Vec::size()) {
          const Vec e = (Vec::loadu(s + i) - Vec(top)).exp();
          e.store(s + i);
          sums = sums + e;
        }
        float total = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sums);
        for (; i < n; ++i) total += (s[i] = std::exp(s[i] - top));
        const float inverse = 1.f / total;
        for (int64_t i = 0; i < n; ++i) s[i] *= inverse;
      }
      float* orow = op + (row * heads + kvh * group) * value_dim;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = first + i;
        const float* value = vp + table[t / block_size] * vs0 + (t % block_size) * vs1 + kvh * vs2;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + i];
          float* acc = orow + g * value_dim;
#pragma omp simd
          for (int64_t d = 0; d < value_dim; ++d) acc[d] += p * value[d];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(hf_paged_cache, m) {
  m.def("paged_decode_cpu(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor first_tokens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_paged_cache, CPU, m) { m.impl("paged_decode_cpu", &paged_decode_cpu); }
