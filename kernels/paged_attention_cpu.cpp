// Causal attention of each row's queries over that row's blocks, read through its block table where they lie: the CPU
// counterpart of paged_decode.py / paged_prefill.py's Triton kernels for the torch path (float32, no soft-cap, no
// sinks). A decode token is a row with one query; a prompt chunk a row with several. Registered as
// torch.ops.hf_paged_cache.paged_attention_cpu; kernels/cpu_attention.py builds and calls it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>  // AVX-512 / AVX2 when built with its CPU_CAPABILITY (cpu_attention.py)
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t LANES = Vec::size();
constexpr int64_t KEYS = 4 * LANES;    // keys per chunk: the width of a score tile (four vector registers)
constexpr int64_t QUERIES = 32;        // query positions per task (times the heads of a KV head's group)
constexpr int64_t ROWS = 4;            // query vectors whose scores are computed together (register blocking)
constexpr int64_t DIRECT_QUERIES = 4;  // tiles of fewer query positions read the keys where they lie
constexpr float MINUS_INF = -std::numeric_limits<float>::infinity();

// scores[r][0:KEYS] = q[r] . kt[:, 0:KEYS] for R query vectors of `q` ([R, dim]), held in registers; `kt` is a chunk's
// keys transposed ([dim, KEYS]).
template <int64_t R>
inline void score_rows(const float* q, int64_t dim, const float* kt, float* scores) {
  constexpr int64_t V = KEYS / LANES;
  Vec acc[R][V];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v) acc[r][v] = Vec(0.f);
  for (int64_t d = 0; d < dim; ++d) {
    Vec k[V];
    for (int64_t v = 0; v < V; ++v) k[v] = Vec::loadu(kt + d * KEYS + v * LANES);
    for (int64_t r = 0; r < R; ++r) {
      const Vec x(q[r * dim + d]);
      for (int64_t v = 0; v < V; ++v) acc[r][v] = at::vec::fmadd(x, k[v], acc[r][v]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v) acc[r][v].store(scores + r * KEYS + v * LANES);
}

// o[r] = o[r] * correction[r] + p[r][0:keys] @ values[0:keys] over one slab of V vectors of the value dim from `d0`
// (`values`: the chunk's value rows where they lie; o's rows `stride` floats apart), for R accumulators held in
// registers; p [R, KEYS].
template <int64_t R, int64_t V>
inline void add_values(float* o, int64_t stride, const float* p, const float* correction, const float* const* values,
                       int64_t d0, int64_t keys) {
  Vec acc[R][V];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v) acc[r][v] = Vec::loadu(o + r * stride + v * LANES) * Vec(correction[r]);
  for (int64_t j = 0; j < keys; ++j) {
    Vec x[V];
    for (int64_t v = 0; v < V; ++v) x[v] = Vec::loadu(values[j] + d0 + v * LANES);
    for (int64_t r = 0; r < R; ++r) {
      const Vec w(p[r * KEYS + j]);
      for (int64_t v = 0; v < V; ++v) acc[r][v] = at::vec::fmadd(w, x[v], acc[r][v]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v) acc[r][v].store(o + r * stride + v * LANES);
}

// The scores of `count` query vectors ([count, dim]) against a chunk's transposed keys, ROWS at a time.
void chunk_scores(const float* q, int64_t count, int64_t dim, const float* kt, float* scores) {
  int64_t m = 0;
  for (; m + ROWS <= count; m += ROWS) score_rows<ROWS>(q + m * dim, dim, kt, scores + m * KEYS);
  for (; m < count; ++m) score_rows<1>(q + m * dim, dim, kt, scores + m * KEYS);
}

// o[m] = o[m] * correction[m] + p[m][0:keys] @ values[0:keys] for `count` accumulators ([count, value_dim]), ROWS
// at a time; `values`: the chunk's value rows where they lie.
void chunk_values(float* o, int64_t count, int64_t value_dim, const float* p, const float* correction,
                  const float* const* values, int64_t keys) {
  int64_t d0 = 0;
  for (; d0 + 4 * LANES <= value_dim; d0 += 4 * LANES) {
    int64_t m = 0;
    for (; m + ROWS <= count; m += ROWS)
      add_values<ROWS, 4>(o + m * value_dim + d0, value_dim, p + m * KEYS, correction + m, values, d0, keys);
    for (; m < count; ++m)
      add_values<1, 4>(o + m * value_dim + d0, value_dim, p + m * KEYS, correction + m, values, d0, keys);
  }
  for (; d0 + LANES <= value_dim; d0 += LANES) {
    for (int64_t m = 0; m < count; ++m)
      add_values<1, 1>(o + m * value_dim + d0, value_dim, p + m * KEYS, correction + m, values, d0, keys);
  }
  for (int64_t m = 0; m < count && d0 < value_dim; ++m) {  // a value dim that is not whole vectors: plain loops
    float* out = o + m * value_dim;
    for (int64_t d = d0; d < value_dim; ++d) out[d] *= correction[m];
    for (int64_t j = 0; j < keys; ++j)
      for (int64_t d = d0; d < value_dim; ++d) out[d] += p[m * KEYS + j] * values[j][d];
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// A tile of few query vectors (a decode token) gains nothing from a transposed copy of the keys: its scores are dot
// products with the keys where they lie (`keys`: the chunk's `n` key rows).
void direct_scores(const float* q, int64_t count, int64_t dim, const float* const* keys, int64_t n, float* scores) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t m = 0; m < count; ++m) scores[m * KEYS + j] = dot(q + m * dim, keys[j], dim);
}

// query [tokens, heads, d] (any strides, unit stride along d): row r's queries are tokens query_starts[r] ..
// query_starts[r + 1] - 1, the last of its stored tokens first_tokens[r] .. seq_lens[r] - 1, each seeing the row's
// tokens from first_tokens[r] up to its own;
// k_cache / v_cache [num_blocks, block_size, kv_heads, d] (any strides, unit stride along d); block_tables [rows,
// width] (token t of row r in block block_tables[r][t / block_size], slot t % block_size).
at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_tables, const at::Tensor& query_starts,
                               const at::Tensor& seq_lens, const at::Tensor& first_tokens, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_attention_cpu: shapes");
  TORCH_CHECK(query.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat, "paged_attention_cpu: float32 only");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "paged_attention_cpu: head dim must be contiguous");
  const at::Tensor q = query.stride(2) == 1 ? query : query.contiguous();  // tokens and heads may be strided
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor starts = query_starts.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous(), firsts = first_tokens.to(at::kLong).contiguous();
  const int64_t rows = tables.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), value_dim = v_cache.size(3);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == dim, "paged_attention_cpu: head counts / dims");
  TORCH_CHECK(starts.numel() == rows + 1 && lens.numel() == rows && firsts.numel() == rows,
              "paged_attention_cpu: query_starts needs rows + 1 entries, seq_lens and first_tokens rows");
  const int64_t group = heads / kv_heads, width = tables.size(1);
  at::Tensor out = at::zeros({q.size(0), heads, value_dim}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* fp = firsts.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const float fscale = static_cast<float>(scale);
  const int64_t num_blocks = std::min(k_cache.size(0), v_cache.size(0));
  TORCH_CHECK(sp[0] == 0 && sp[rows] == q.size(0), "paged_attention_cpu: query_starts must run from 0 to the tokens");
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (row, first query of the tile)
  for (int64_t row = 0; row < rows; ++row) {  // checked here: the parallel loop below reads without checks
    const int64_t count = sp[row + 1] - sp[row];
    TORCH_CHECK(count >= 0 && fp[row] >= 0 && lp[row] <= width * block_size, "paged_attention_cpu: row ", row,
                " reads tokens ", fp[row], "..", lp[row], " of a table of ", width, " blocks of ", block_size);
    TORCH_CHECK(count <= 1 || lp[row] - fp[row] >= count, "paged_attention_cpu: row ", row, " has ", count,
                " queries but reads ", lp[row] - fp[row], " tokens: each query must see its own key");
    for (int64_t column = fp[row] / block_size; column * block_size < lp[row]; ++column) {
      const int64_t block = tp[row * width + column];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_attention_cpu: block id ", block, " out of range");
    }
    if (lp[row] > fp[row]) {  // a row that reads nothing stays zero
      for (int64_t first = 0; first < count; first += QUERIES) tiles.emplace_back(row, first);
    }
  }
  // Causal tiles differ in work (the keys their last query sees): the longest first, handed out one at a time, so
  // the threads finish together.
  const auto work = [&](const std::pair<int64_t, int64_t>& tile) {
    const int64_t count = sp[tile.first + 1] - sp[tile.first];
    return lp[tile.first] - count + std::min(tile.second + QUERIES, count) - fp[tile.first];
  };
  std::stable_sort(tiles.begin(), tiles.end(), [&](const auto& a, const auto& b) { return work(a) > work(b); });
  const int64_t tasks = static_cast<int64_t>(tiles.size()) * kv_heads;
  std::atomic<int64_t> next{0};

  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), tasks), 1, [&](int64_t, int64_t) {
    const int64_t most = group * QUERIES;
    std::vector<float> qs(most * dim), acc(most * value_dim), top(most), total(most), correction(most);
    std::vector<int64_t> limit(most);
    std::vector<float> kt(dim * KEYS), scores(most * KEYS);
    const float* key_rows[KEYS];
    const float* value_rows[KEYS];
    for (int64_t task = next++; task < tasks; task = next++) {
      const auto [row, tile] = tiles[task / kv_heads];
      const int64_t kvh = task % kv_heads;
      const int64_t count = sp[row + 1] - sp[row], n = std::min(QUERIES, count - tile);
      const int64_t first = fp[row], stop = lp[row], m_count = group * n;
      const bool direct = n < DIRECT_QUERIES;
      const int64_t* table = tp + row * width;
      // query vector m = g * n + i: head kvh * group + g of query tile + i, which sees tokens first .. its limit.
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t i = 0; i < n; ++i) {
          const float* src = qp + (sp[row] + tile + i) * qs0 + (kvh * group + g) * qs1;
          float* dst = qs.data() + (g * n + i) * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = src[d] * fscale;
          limit[g * n + i] = stop - count + tile + i;
        }
      }
      std::fill(acc.begin(), acc.begin() + m_count * value_dim, 0.f);
      std::fill(top.begin(), top.begin() + m_count, MINUS_INF);
      std::fill(total.begin(), total.begin() + m_count, 0.f);
      const int64_t last = stop - count + tile + n - 1;  // the key the tile's last query sees last
      for (int64_t t0 = first; t0 <= last; t0 += KEYS) {
        const int64_t keys = std::min(KEYS, last + 1 - t0);
        for (int64_t j = 0, column = t0 / block_size, slot = t0 % block_size; j < keys; ++j) {
          const int64_t block = table[column];
          key_rows[j] = kp + block * ks0 + slot * ks1 + kvh * ks2;
          value_rows[j] = vp + block * vs0 + slot * vs1 + kvh * vs2;
          if (++slot == block_size) {  // the next block (no division per key)
            slot = 0;
            ++column;
          }
        }
        if (direct) {
          direct_scores(qs.data(), m_count, dim, key_rows, keys, scores.data());
        } else {  // the chunk's keys transposed, so a score tile is a few vector products
          for (int64_t j = 0; j < KEYS; ++j)
            for (int64_t d = 0; d < dim; ++d) kt[d * KEYS + j] = j < keys ? key_rows[j][d] : 0.f;
          chunk_scores(qs.data(), m_count, dim, kt.data(), scores.data());
        }
        for (int64_t m = 0; m < m_count; ++m) {  // the online softmax: scores become weights, sums are corrected
          float* s = scores.data() + m * KEYS;
          const int64_t seen = std::min(keys, limit[m] - t0 + 1);  // the keys of the chunk query vector m sees
          if (seen <= 0) {  // none (a query before the chunk): nothing to add
            std::fill(s, s + KEYS, 0.f);
            correction[m] = 1.f;
            continue;
          }
          for (int64_t j = seen; j < KEYS; ++j) s[j] = MINUS_INF;
          Vec most = Vec::loadu(s);
          for (int64_t j = LANES; j < KEYS; j += LANES) most = at::vec::maximum(most, Vec::loadu(s + j));
          float lanes[LANES];
          most.store(lanes);
          const float new_top = std::max(top[m], *std::max_element(lanes, lanes + LANES));
          correction[m] = std::exp(top[m] - new_top);  // 0 for the first chunk (top -inf)
          Vec sums(0.f);
          for (int64_t j = 0; j < KEYS; j += LANES) {
            const Vec e = (Vec::loadu(s + j) - Vec(new_top)).exp();
            e.store(s + j);
            sums = sums + e;
          }
          sums.store(lanes);
          total[m] = total[m] * correction[m] + std::accumulate(lanes, lanes + LANES, 0.f);
          top[m] = new_top;
        }
        chunk_values(acc.data(), m_count, value_dim, scores.data(), correction.data(), value_rows, keys);
      }
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t i = 0; i < n; ++i) {
          const int64_t m = g * n + i;
          const float inverse = 1.f / total[m];
          const float* o = acc.data() + m * value_dim;
          float* dst = op + ((sp[row] + tile + i) * heads + kvh * group + g) * value_dim;
          for (int64_t d = 0; d < value_dim; ++d) dst[d] = o[d] * inverse;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(hf_paged_cache, m) {
  m.def("paged_attention_cpu(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_starts, "
        "Tensor seq_lens, Tensor first_tokens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_paged_cache, CPU, m) { m.impl("paged_attention_cpu", &paged_attention_cpu); }
