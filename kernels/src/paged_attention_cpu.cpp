// Causal attention of each row's queries over that row's blocks, read through its block table where they lie: the CPU
// counterpart of paged_decode.py / paged_prefill.py's Triton kernels for the torch path (float32, no soft-cap, no
// sinks). A decode token is a row with one query; a prompt chunk a row with several. A quantized cache's rows read
// their sealed blocks first, decoded here a chunk of keys at a time (int8, and unrotated 4 / 2-bit codes), and the
// blocks a step reads both ways (a transition) as the caller decoded them and as they were. Registered as
// torch.ops.hf_paged_cache.paged_attention_cpu; kernels/cpu_attention.py builds and calls it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>  // AVX-512 / AVX2 when built with its CPU_CAPABILITY (cpu_attention.py)
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t LANES = Vec::size();
constexpr int64_t KEYS = 4 * LANES;    // keys per chunk: the width of a score tile (four vector registers)
constexpr int64_t QUERIES = 32;        // query positions per task (times the heads of a KV head's group)
constexpr int64_t ROWS = 4;            // query vectors whose values are added together (register blocking)
constexpr int64_t DIRECT_QUERIES = 4;  // tiles of fewer query positions read the keys where they lie
constexpr int64_t PREDECODED_FLOATS = int64_t{8} << 20;  // a call's sealed prompt tokens decoded once (32 MiB)
constexpr float MINUS_INF = -std::numeric_limits<float>::infinity();

constexpr int64_t KEY_ROWS = LANES >= 16 ? 4 : 2;  // keys scored together against a slab of query vectors
constexpr int64_t SLAB = 4;                           // query vectors (LANES queries each) of a score slab
// With 32 vector registers (AVX-512): a slab of 6 query vectors against KEY_ROWS keys (24 accumulators), and 6 rows'
// values at a time (24 accumulators), so each key or value vector loaded serves more products; AVX2's 16 registers
// would spill them.
constexpr int64_t WIDE_SLAB = LANES >= 16 ? 6 : SLAB;
constexpr int64_t WIDE_ROWS = LANES >= 16 ? 6 : ROWS;

// A prompt tile's scores are kept transposed, st [keys, stride] (a key's scores against every query of the tile, the
// queries padded to whole vectors), so the online softmax runs across queries a vector at a time, with no sum or
// maximum across the lanes of a vector; and the tile's queries are transposed once, qt [dim, stride], so the keys are
// read where they lie (a key's channel is broadcast), never copied.

// st[r][v] = keys[r] . qt[:, v] for R keys and V query vectors from `qt` (held in registers).
template <int64_t R, int64_t V>
inline void score_keys(const float* const* keys, const float* qt, int64_t stride, int64_t dim, float* st) {
  Vec acc[R][V];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v) acc[r][v] = Vec(0.f);
  for (int64_t d = 0; d < dim; ++d) {
    Vec q[V];
    for (int64_t v = 0; v < V; ++v) q[v] = Vec::loadu(qt + d * stride + v * LANES);
    for (int64_t r = 0; r < R; ++r) {
      const Vec k(keys[r][d]);
      for (int64_t v = 0; v < V; ++v) acc[r][v] = at::vec::fmadd(k, q[v], acc[r][v]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v) acc[r][v].store(st + r * stride + v * LANES);
}

// The scores of R keys against `vectors` query vectors, a slab at a time.
template <int64_t R>
inline void score_key_rows(const float* const* keys, const float* qt, int64_t stride, int64_t vectors, int64_t dim,
                           float* st) {
  int64_t v = 0;
  if constexpr (WIDE_SLAB > SLAB && R == KEY_ROWS)  // a tile of 32 positions of a group of 3 heads: 6 vectors
    for (; v + WIDE_SLAB <= vectors; v += WIDE_SLAB)
      score_keys<R, WIDE_SLAB>(keys, qt + v * LANES, stride, dim, st + v * LANES);
  for (; v + SLAB <= vectors; v += SLAB) score_keys<R, SLAB>(keys, qt + v * LANES, stride, dim, st + v * LANES);
  for (; v + 2 <= vectors; v += 2) score_keys<R, 2>(keys, qt + v * LANES, stride, dim, st + v * LANES);
  for (; v < vectors; ++v) score_keys<R, 1>(keys, qt + v * LANES, stride, dim, st + v * LANES);
}

// st [n, stride]: the scores of a chunk's `n` keys (`keys`: their rows where they lie) against the tile's queries.
void transposed_scores(const float* const* keys, int64_t n, const float* qt, int64_t stride, int64_t dim, float* st) {
  const int64_t vectors = stride / LANES;
  int64_t j = 0;
  for (; j + KEY_ROWS <= n; j += KEY_ROWS)
    score_key_rows<KEY_ROWS>(keys + j, qt, stride, vectors, dim, st + j * stride);
  for (; j < n; ++j) score_key_rows<1>(keys + j, qt, stride, vectors, dim, st + j * stride);
}

// The online softmax of a chunk's transposed scores st [n, stride] (key t0 + j at row j): query m sees keys
// [lo[m], hi[m]) (`masked`: some query does not see the whole chunk); the scores become weights, and each query's
// running maximum `top`, sum `total` and the `correction` of its earlier sums are updated. A query that has seen no key
// yet keeps weights 0 (its maximum stays -inf). The exponentials (here and in a decode tile's softmax) are at::vec's
// exp_u20, as torch's CPU flash attention takes them: a few ulp less exact than exp, and fewer instructions on the
// floating-point units the tile's products need.
void transposed_softmax(float* st, int64_t n, int64_t stride, int64_t t0, const float* lo, const float* hi, bool masked,
                        float* top, float* total, float* correction) {
  const Vec minus_inf(MINUS_INF), zero(0.f);
  for (int64_t v = 0; v < stride; v += LANES) {
    const Vec low = Vec::loadu(lo + v), high = Vec::loadu(hi + v);
    Vec most(MINUS_INF);
    for (int64_t j = 0; j < n; ++j) {
      Vec s = Vec::loadu(st + j * stride + v);
      if (masked) {
        const Vec position(static_cast<float>(t0 + j));
        s = Vec::blendv(minus_inf, s, (position >= low) & (position < high));
        s.store(st + j * stride + v);
      }
      most = at::vec::maximum(most, s);
    }
    const Vec old_top = Vec::loadu(top + v);
    const Vec new_top = at::vec::maximum(old_top, most);
    const Vec base = Vec::blendv(new_top, zero, new_top == minus_inf);  // no key seen yet: exp(-inf - 0) = 0
    const Vec scale = (old_top - base).exp_u20();
    Vec sums(0.f);
    for (int64_t j = 0; j < n; ++j) {
      const Vec e = (Vec::loadu(st + j * stride + v) - base).exp_u20();
      e.store(st + j * stride + v);
      sums = sums + e;
    }
    (Vec::loadu(total + v) * scale + sums).store(total + v);
    new_top.store(top + v);
    scale.store(correction + v);
  }
}

// o[r] = o[r] * correction[r] + sum_j p[r][j] * values[j] over one slab of V vectors of the value dim from `d0`
// (`values`: the chunk's value rows where they lie; o's rows `stride` floats apart), for R accumulators held in
// registers; weight p[r][j] at p[r * row + j * key] (scores row-major [m, KEYS], or transposed [keys, m]).
template <int64_t R, int64_t V>
inline void add_values(float* o, int64_t stride, const float* p, int64_t row, int64_t key, const float* correction,
                       const float* const* values, int64_t d0, int64_t keys) {
  Vec acc[R][V];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v) acc[r][v] = Vec::loadu(o + r * stride + v * LANES) * Vec(correction[r]);
  for (int64_t j = 0; j < keys; ++j) {
    Vec x[V];
    for (int64_t v = 0; v < V; ++v) x[v] = Vec::loadu(values[j] + d0 + v * LANES);
    for (int64_t r = 0; r < R; ++r) {
      const Vec w(p[r * row + j * key]);
      for (int64_t v = 0; v < V; ++v) acc[r][v] = at::vec::fmadd(w, x[v], acc[r][v]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v) acc[r][v].store(o + r * stride + v * LANES);
}

// o[m] = o[m] * correction[m] + p[m][0:keys] @ values[0:keys] for `count` accumulators ([count, value_dim]), ROWS
// at a time; `values`: the chunk's value rows where they lie; weights as for `add_values`.
void chunk_values(float* o, int64_t count, int64_t value_dim, const float* p, int64_t row, int64_t key,
                  const float* correction, const float* const* values, int64_t keys) {
  int64_t d0 = 0;
  for (; d0 + 4 * LANES <= value_dim; d0 += 4 * LANES) {
    int64_t m = 0;
    for (; m + WIDE_ROWS <= count; m += WIDE_ROWS)
      add_values<WIDE_ROWS, 4>(o + m * value_dim + d0, value_dim, p + m * row, row, key, correction + m, values, d0,
                               keys);
    for (; m + ROWS <= count; m += ROWS)
      add_values<ROWS, 4>(o + m * value_dim + d0, value_dim, p + m * row, row, key, correction + m, values, d0, keys);
    for (; m + 3 <= count; m += 3)  // a decode token of a group of three heads: each value row loaded once for all
      add_values<3, 4>(o + m * value_dim + d0, value_dim, p + m * row, row, key, correction + m, values, d0, keys);
    for (; m < count; ++m)
      add_values<1, 4>(o + m * value_dim + d0, value_dim, p + m * row, row, key, correction + m, values, d0, keys);
  }
  for (; d0 + LANES <= value_dim; d0 += LANES) {
    for (int64_t m = 0; m < count; ++m)
      add_values<1, 1>(o + m * value_dim + d0, value_dim, p + m * row, row, key, correction + m, values, d0, keys);
  }
  for (int64_t m = 0; m < count && d0 < value_dim; ++m) {  // a value dim that is not whole vectors: plain loops
    float* out = o + m * value_dim;
    for (int64_t d = d0; d < value_dim; ++d) out[d] *= correction[m];
    for (int64_t j = 0; j < keys; ++j)
      for (int64_t d = d0; d < value_dim; ++d) out[d] += p[m * row + j * key] * values[j][d];
  }
}

// Two vector accumulators, summed across lanes by a shuffle tree (a scalar loop would add the lanes one by one, a chain
// of adds longer than the products).
inline float dot(const float* a, const float* b, int64_t n) {
  Vec even(0.f), odd(0.f);
  int64_t i = 0;
  for (; i + 2 * LANES <= n; i += 2 * LANES) {
    even = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), even);
    odd = at::vec::fmadd(Vec::loadu(a + i + LANES), Vec::loadu(b + i + LANES), odd);
  }
  for (; i + LANES <= n; i += LANES) even = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), even);
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, even + odd);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// A tile of few query vectors (a decode token) gains nothing from transposed queries (`transposed_scores`): its scores
// are dot products with the keys where they lie (`keys`: the chunk's `n` key rows). Such a tile mostly waits on memory,
// and the hardware prefetcher starts again at every block (a page): the chunk's value rows (`value_dim` floats each)
// are fetched into the cache while its keys are scored, so that the weights find them there.
void direct_scores(const float* q, int64_t count, int64_t dim, const float* const* keys, int64_t n, float* scores,
                   const float* const* values, int64_t value_dim) {
  constexpr int64_t LINE = 64 / sizeof(float);  // floats per cache line
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t d = 0; d < value_dim; d += LINE) __builtin_prefetch(values[j] + d, 0, 3);
    for (int64_t m = 0; m < count; ++m) scores[m * KEYS + j] = dot(q + m * dim, keys[j], dim);
  }
}

// One side (keys or values) of a quantized pool as `hf_paged_cache.quantization` stores it: codes [blocks, block_size,
// kv_heads, bytes] (int8, or 4 / 2-bit codes packed planar into uint8), and a scale (and a zero point) per group of
// `group` channels, read through [blocks, slots, kv_heads, groups] views whose slot stride is 0 for a format with one
// per block (keys per channel). An 8-bit scale counts steps of a float16 unit stored at zero[..., unit].
struct QuantSide {
  const uint8_t* codes = nullptr;
  int64_t c0 = 0, c1 = 0, c2 = 0;
  const at::Half* scale16 = nullptr;
  const uint8_t* scale8 = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  const at::Half* zero = nullptr;
  int64_t z0 = 0, z1 = 0, z2 = 0, z3 = 0;
  int64_t bits = 8, group = 1, unit = -1;

  // Tokens slot .. slot + count - 1 of block `block`, KV head `head`, decoded into rows of `out` `stride` floats
  // apart as the format's torch decode does it: code * scale + zero (0 without), in float32. The scales and zero points
  // are expanded per channel into `meta` ([2, dim] floats): once per call for a format with one per block.
  void decode(int64_t block, int64_t slot, int64_t count, int64_t head, int64_t dim, float* out, int64_t stride,
              float* meta) const {
    float* scales = meta;
    float* zeros = meta + dim;
    for (int64_t t = 0; t < count; ++t) {
      if (t == 0 || !per_block()) metadata(block, slot + t, head, dim, scales, zeros);
      float* o = out + t * stride;
      unpack(block, slot + t, head, dim, o);
      for (int64_t d = 0; d < dim; ++d) o[d] = o[d] * scales[d] + zeros[d];
    }
  }

  // Whether one scale (and zero point) serves every token of a block (keys per channel).
  bool per_block() const { return s1 == 0 && (zero == nullptr || z1 == 0); }

  // The scale and zero point (0 without) of group g of a token.
  void group_metadata(int64_t block, int64_t slot, int64_t head, int64_t g, float& scale, float& offset) const {
    const int64_t at_scale = block * s0 + slot * s1 + head * s2, at_zero = block * z0 + slot * z1 + head * z2;
    const float step = unit >= 0 ? static_cast<float>(zero[at_zero + unit * z3]) : 1.f;
    scale = scale8 ? static_cast<float>(scale8[at_scale + g * s3]) * step
                   : static_cast<float>(scale16[at_scale + g * s3]);
    offset = zero ? static_cast<float>(zero[at_zero + g * z3]) : 0.f;
  }

  // The codes of one token as floats.
  void unpack(int64_t block, int64_t slot, int64_t head, int64_t dim, float* out) const {
    const uint8_t* c = codes + block * c0 + slot * c1 + head * c2;
    if (bits == 8) {
      unpack_plane(c, dim, 0, 0, out);
      return;
    }
    const int64_t m = dim * bits / 8, per_byte = 8 / bits;  // planar: byte i holds code i + k * m at bit k * bits
    for (int64_t k = 0; k < per_byte; ++k) unpack_plane(c, m, static_cast<int>(k * bits), (1 << bits) - 1, out + k * m);
  }

  // o[i] = (c[i] >> shift) & mask as floats for i < n; mask 0: c holds signed 8-bit codes. Vector instructions where
  // the build has them (the compiler leaves the byte-to-float conversion scalar).
  static void unpack_plane(const uint8_t* c, int64_t n, int shift, int mask, float* o) {
    int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
    const __m512i shifts = _mm512_set1_epi32(shift), masks = _mm512_set1_epi32(mask);
    for (; i + 16 <= n; i += 16) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i));
      const __m512i wide = mask ? _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(bytes), shifts), masks)
                                : _mm512_cvtepi8_epi32(bytes);
      _mm512_storeu_ps(o + i, _mm512_cvtepi32_ps(wide));
    }
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256i shifts = _mm256_set1_epi32(shift), masks = _mm256_set1_epi32(mask);
    for (; i + 8 <= n; i += 8) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i));
      const __m256i wide = mask ? _mm256_and_si256(_mm256_srlv_epi32(_mm256_cvtepu8_epi32(bytes), shifts), masks)
                                : _mm256_cvtepi8_epi32(bytes);
      _mm256_storeu_ps(o + i, _mm256_cvtepi32_ps(wide));
    }
#endif
    for (; i < n; ++i)
      o[i] = mask ? static_cast<float>((c[i] >> shift) & mask) : static_cast<float>(static_cast<int8_t>(c[i]));
  }

  // Every channel's scale and zero point (0 without) for a token, expanded from its groups. A group of one channel
  // (keys per channel) reads them as vectors where they lie contiguously: a block's keys decode them at every read.
  void metadata(int64_t block, int64_t slot, int64_t head, int64_t dim, float* scales, float* zeros) const {
    if (group == 1 && s3 == 1 && (zero == nullptr || z3 == 1)) {
      const int64_t at_scale = block * s0 + slot * s1 + head * s2, at_zero = block * z0 + slot * z1 + head * z2;
      const float step = unit >= 0 ? static_cast<float>(zero[at_zero + unit]) : 1.f;
      int64_t d = 0;
#if defined(CPU_CAPABILITY_AVX512)
      for (; scale8 && d + 16 <= dim; d += 16) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scale8 + at_scale + d));
        _mm512_storeu_ps(scales + d, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)),
                                                   _mm512_set1_ps(step)));
        if (zero)
          _mm512_storeu_ps(zeros + d, _mm512_cvtph_ps(_mm256_loadu_si256(
                                          reinterpret_cast<const __m256i*>(zero + at_zero + d))));
        else
          _mm512_storeu_ps(zeros + d, _mm512_setzero_ps());
      }
#endif
      for (; d < dim; ++d) {
        scales[d] = scale8 ? static_cast<float>(scale8[at_scale + d]) * step : static_cast<float>(scale16[at_scale + d]);
        zeros[d] = zero ? static_cast<float>(zero[at_zero + d]) : 0.f;
      }
      return;
    }
    for (int64_t g = 0; g * group < dim; ++g) {
      float scale, offset;
      group_metadata(block, slot, head, g, scale, offset);
      for (int64_t d = g * group; d < std::min((g + 1) * group, dim); ++d) scales[d] = scale, zeros[d] = offset;
    }
  }
};

QuantSide quant_side(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero, int64_t bits,
                     int64_t group, int64_t unit, int64_t dim) {
  TORCH_CHECK(codes.dim() == 4 && codes.element_size() == 1 && codes.stride(3) == 1 && codes.size(3) * 8 == dim * bits,
              "paged_attention_cpu: quantized codes must be [blocks, block_size, kv_heads, head_dim * bits / 8] bytes");
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "paged_attention_cpu: codes of 8, 4 or 2 bits");
  TORCH_CHECK(scale.dim() == 4 && (scale.scalar_type() == at::kHalf || scale.scalar_type() == at::kByte) &&
                  group >= 1 && scale.size(3) * group >= dim,
              "paged_attention_cpu: scales must be float16 or uint8 [blocks, slots, kv_heads, groups]");
  const auto stride = [](const at::Tensor& t, int64_t d) { return t.size(d) == 1 ? 0 : t.stride(d); };
  QuantSide side;
  side.codes = static_cast<const uint8_t*>(codes.data_ptr());
  side.c0 = codes.stride(0), side.c1 = codes.stride(1), side.c2 = codes.stride(2);
  if (scale.scalar_type() == at::kByte) side.scale8 = scale.data_ptr<uint8_t>();
  else side.scale16 = scale.data_ptr<at::Half>();
  side.s0 = stride(scale, 0), side.s1 = stride(scale, 1), side.s2 = stride(scale, 2), side.s3 = stride(scale, 3);
  if (zero.numel()) {
    TORCH_CHECK(zero.dim() == 4 && zero.scalar_type() == at::kHalf, "paged_attention_cpu: zero points are float16");
    side.zero = zero.data_ptr<at::Half>();
    side.z0 = stride(zero, 0), side.z1 = stride(zero, 1), side.z2 = stride(zero, 2), side.z3 = stride(zero, 3);
  }
  TORCH_CHECK((unit < 0 || side.zero) && (side.scale8 == nullptr) == (unit < 0),
              "paged_attention_cpu: an 8-bit scale needs its unit among the zero points, and only it");
  side.bits = bits, side.group = group, side.unit = unit;
  return side;
}

// Where a row's keys come from, in the order it reads them: its quantized tokens (decoded here), the transition's
// tokens both ways (given decoded and exact, each query reading those of a block quantized once the block ends at least
// `window` positions before it, as it would have one token at a time), then its full-precision tokens.
enum Segment { QUANTIZED = 0, DECODED = 1, EXACT = 2, FULL = 3 };

// query [tokens, heads, d] (any strides, unit stride along d): row r's queries are tokens query_starts[r] ..
// query_starts[r + 1] - 1, the last of the keys it reads, each seeing the keys up to its own position (`causal`; else
// every key the row reads: queries of several sequences over a prefix they share);
// k_cache / v_cache [num_blocks, block_size, kv_heads, d] (any strides, unit stride along d); block_tables [rows,
// width] (stored token t of row r in block block_tables[r][t / block_size], slot t % block_size); row r reads stored
// tokens first_tokens[r] .. seq_lens[r] - 1 of them, after
//   - quantized[0:6] (key codes, scales, zero points, then the values'; an empty zero point for a symmetric format) of
//     a quantized pool read through quantized_tables [rows, width], tokens quantized_reads[r][0] ..
//     quantized_reads[r][1] - 1 of row r's table, formats (bits, group, unit) per side in quantized_formats;
//   - transition[0:4] (exact keys, exact values, decoded keys, decoded values; [kv_heads, tokens, d]) tokens
//     transition_starts[r] .. transition_starts[r + 1] - 1 for row r, whole blocks of block_size; or transition[0:2]
//     only, the decoded tokens being the last of the row's quantized read (blocks sealed as they arrived).
// Returns the outputs [tokens, heads, value_dim] and each query's log-sum-exp of the logits it saw [tokens, heads]
// (-inf where it saw none), with which attention over disjoint parts of the keys merges exactly.
std::tuple<at::Tensor, at::Tensor> paged_attention_cpu(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_tables, const at::Tensor& query_starts,
                               const at::Tensor& seq_lens, const at::Tensor& first_tokens, double scale,
                               at::TensorList quantized, const c10::optional<at::Tensor>& quantized_tables,
                               const c10::optional<at::Tensor>& quantized_reads, at::IntArrayRef quantized_formats,
                               at::TensorList transition, const c10::optional<at::Tensor>& transition_starts,
                               int64_t window, bool causal) {
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

  // The quantized prefix, if any.
  const bool has_quantized = !quantized.empty();
  QuantSide qkey, qvalue;
  at::Tensor qtables, qreads;
  int64_t qwidth = 0, qblocks = 0;
  if (has_quantized) {
    TORCH_CHECK(quantized.size() == 6 && quantized_formats.size() == 6 && quantized_tables && quantized_reads,
                "paged_attention_cpu: a quantized prefix needs 6 fields, 6 format numbers, tables and reads");
    qkey = quant_side(quantized[0], quantized[1], quantized[2], quantized_formats[0], quantized_formats[1],
                      quantized_formats[2], dim);
    qvalue = quant_side(quantized[3], quantized[4], quantized[5], quantized_formats[3], quantized_formats[4],
                        quantized_formats[5], value_dim);
    TORCH_CHECK(quantized[0].size(1) == block_size && quantized[0].size(2) == kv_heads &&
                    quantized[3].size(1) == block_size && quantized[3].size(2) == kv_heads,
                "paged_attention_cpu: quantized blocks must have the cache's block size and KV heads");
    qtables = quantized_tables->to(at::kLong).contiguous();
    qreads = quantized_reads->to(at::kLong).contiguous();
    TORCH_CHECK(qtables.dim() == 2 && qtables.size(0) == rows && qreads.numel() == 2 * rows,
                "paged_attention_cpu: quantized_tables [rows, width] and quantized_reads [rows, 2]");
    qwidth = qtables.size(1);
    qblocks = std::min(quantized[0].size(0), quantized[3].size(0));
    for (const auto& field : quantized)
      if (field.numel()) qblocks = std::min(qblocks, field.size(0));
  }
  // The transition, if any.
  const bool has_transition = !transition.empty();
  const bool decoded_codes = transition.size() == 2;  // the decoded tokens are the end of the quantized read
  at::Tensor tstarts;
  if (has_transition) {
    TORCH_CHECK((transition.size() == 4 || (decoded_codes && has_quantized)) && transition_starts && window >= 0,
                "paged_attention_cpu: a transition needs its exact and decoded tensors (or only the exact ones, after "
                "a quantized prefix that ends with its decoded blocks), transition_starts and a window >= 0");
    tstarts = transition_starts->to(at::kLong).contiguous();
    TORCH_CHECK(tstarts.numel() == rows + 1, "paged_attention_cpu: transition_starts needs rows + 1 entries");
    for (int64_t i = 0; i < static_cast<int64_t>(transition.size()); ++i) {
      const at::Tensor& t = transition[i];
      TORCH_CHECK(t.dim() == 3 && t.scalar_type() == at::kFloat && t.stride(2) == 1 && t.size(0) == kv_heads &&
                      t.size(1) >= tstarts.data_ptr<int64_t>()[rows] && t.size(2) == (i % 2 ? value_dim : dim),
                  "paged_attention_cpu: transition tensors must be float32 [kv_heads, tokens, d] covering every row");
    }
  }

  at::Tensor out = at::empty({q.size(0), heads, value_dim}, q.options());  // every tile writes its queries' rows
  at::Tensor lse = at::full({q.size(0), heads}, MINUS_INF, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* fp = firsts.data_ptr<int64_t>();
  const int64_t* qtp = has_quantized ? qtables.data_ptr<int64_t>() : nullptr;
  const int64_t* qrp = has_quantized ? qreads.data_ptr<int64_t>() : nullptr;
  const int64_t* tsp = has_transition ? tstarts.data_ptr<int64_t>() : nullptr;
  float* op = out.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const float* tsrc[4] = {nullptr, nullptr, nullptr, nullptr};  // exact K, exact V, decoded K, decoded V
  int64_t th[4] = {0, 0, 0, 0}, tt[4] = {0, 0, 0, 0};
  for (int64_t i = 0; i < static_cast<int64_t>(transition.size()); ++i)
    tsrc[i] = transition[i].data_ptr<float>(), th[i] = transition[i].stride(0), tt[i] = transition[i].stride(1);
  const float fscale = static_cast<float>(scale);
  const int64_t num_blocks = std::min(k_cache.size(0), v_cache.size(0));
  TORCH_CHECK(sp[0] == 0 && sp[rows] == q.size(0), "paged_attention_cpu: query_starts must run from 0 to the tokens");
  // Per row: where each segment begins in the row's read (QUANTIZED, DECODED = EXACT, FULL) and the keys it reads.
  std::vector<std::array<int64_t, 3>> bounds(rows);
  std::vector<int64_t> reads(rows);
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (row, first query of the tile)
  for (int64_t row = 0; row < rows; ++row) {  // checked here: the parallel loop below reads without checks
    const int64_t count = sp[row + 1] - sp[row];
    TORCH_CHECK(count >= 0 && fp[row] >= 0 && lp[row] <= width * block_size, "paged_attention_cpu: row ", row,
                " reads tokens ", fp[row], "..", lp[row], " of a table of ", width, " blocks of ", block_size);
    for (int64_t column = fp[row] / block_size; column * block_size < lp[row]; ++column) {
      const int64_t block = tp[row * width + column];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_attention_cpu: block id ", block, " out of range");
    }
    int64_t quantized_keys = 0, transition_keys = 0;
    if (has_quantized) {
      const int64_t first = qrp[2 * row], stop = qrp[2 * row + 1];
      TORCH_CHECK(first >= 0 && stop <= qwidth * block_size, "paged_attention_cpu: row ", row,
                  " reads quantized tokens ", first, "..", stop, " of a table of ", qwidth, " blocks");
      for (int64_t column = first / block_size; column * block_size < stop; ++column) {
        const int64_t block = qtp[row * qwidth + column];
        TORCH_CHECK(block >= 0 && block < qblocks, "paged_attention_cpu: quantized block id ", block, " out of range");
      }
      quantized_keys = std::max<int64_t>(stop - first, 0);
    }
    if (has_transition) {
      transition_keys = tsp[row + 1] - tsp[row];
      TORCH_CHECK(transition_keys >= 0 && transition_keys % block_size == 0 && tsp[row] >= 0,
                  "paged_attention_cpu: row ", row, "'s transition must be whole blocks");
    }
    TORCH_CHECK(!decoded_codes || transition_keys <= quantized_keys, "paged_attention_cpu: row ", row, "'s transition "
                "is longer than its quantized read, whose end it is");
    if (decoded_codes) quantized_keys -= transition_keys;
    bounds[row] = {0, quantized_keys, quantized_keys + transition_keys};
    reads[row] = quantized_keys + transition_keys + std::max<int64_t>(lp[row] - fp[row], 0);
    TORCH_CHECK(!causal || count <= 1 || reads[row] >= count, "paged_attention_cpu: row ", row, " has ", count,
                " queries but reads ", reads[row], " keys: each query must see its own key");
    if (reads[row] > 0) {
      for (int64_t first = 0; first < count; first += QUERIES) tiles.emplace_back(row, first);
    } else {  // a row that reads nothing: zeros
      out.narrow(0, sp[row], count).zero_();
    }
  }
  // Causal tiles differ in work (the keys their last query sees): the longest first, handed out one at a time, so
  // the threads finish together.
  const auto work = [&](const std::pair<int64_t, int64_t>& tile) {
    const int64_t count = sp[tile.first + 1] - sp[tile.first];
    return causal ? reads[tile.first] - count + std::min(tile.second + QUERIES, count) : reads[tile.first];
  };
  std::stable_sort(tiles.begin(), tiles.end(), [&](const auto& a, const auto& b) { return work(a) > work(b); });
  const int64_t tasks = static_cast<int64_t>(tiles.size()) * kv_heads;
  std::atomic<int64_t> next{0};

  // A prompt row's sealed tokens (its quantized read) decoded once for all its query tiles, while every such row's fit
  // in PREDECODED_FLOATS: each tile would decode them again. Row r's keys are [kv_heads, n, dim] from
  // predecoded[first[r]], its values [kv_heads, n, value_dim] after them (n: its quantized read); first[r] < 0: its
  // tiles decode their own chunks.
  std::vector<int64_t> predecoded_first(rows, -1);
  std::unique_ptr<float[]> predecoded;  // every float is written before it is read: no zeroing
  if (has_quantized) {
    int64_t total = 0;
    std::vector<std::array<int64_t, 2>> runs;  // (row, first read position of a block's run)
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t count = sp[row + 1] - sp[row], n = std::max<int64_t>(qrp[2 * row + 1] - qrp[2 * row], 0);
      if (count < QUERIES + DIRECT_QUERIES || n == 0) continue;  // fewer than two tiles read it as a chunk
      predecoded_first[row] = total;
      total += n * kv_heads * (dim + value_dim);
      for (int64_t t = 0; t < n; t += block_size - (qrp[2 * row] + t) % block_size) runs.push_back({row, t});
    }
    if (total > PREDECODED_FLOATS) {
      std::fill(predecoded_first.begin(), predecoded_first.end(), -1);
      runs.clear();
      total = 0;
    }
    predecoded.reset(new float[total]);
    const int64_t jobs = static_cast<int64_t>(runs.size()) * kv_heads;
    at::parallel_for(0, jobs, 16, [&](int64_t job_begin, int64_t job_end) {
      std::vector<float> meta(2 * std::max(dim, value_dim));
      for (int64_t job = job_begin; job < job_end; ++job) {
        const auto [row, t] = runs[job / kv_heads];
        const int64_t kvh = job % kv_heads, n = qrp[2 * row + 1] - qrp[2 * row], token = qrp[2 * row] + t;
        const int64_t block = qtp[row * qwidth + token / block_size], slot = token % block_size;
        const int64_t run = std::min(block_size - slot, n - t);
        float* keys = predecoded.get() + predecoded_first[row];
        float* values = keys + n * kv_heads * dim;
        qkey.decode(block, slot, run, kvh, dim, keys + (kvh * n + t) * dim, dim, meta.data());
        qvalue.decode(block, slot, run, kvh, value_dim, values + (kvh * n + t) * value_dim, value_dim, meta.data());
      }
    });
  }

  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), tasks), 1, [&](int64_t, int64_t) {
    const int64_t most = group * QUERIES, padded = (most + LANES - 1) / LANES * LANES;
    std::vector<float> qs(most * dim), acc(most * value_dim), top(padded), total(padded), correction(padded);
    std::vector<int64_t> position(most), lo(most), hi(most);
    std::vector<float> scores(most * KEYS), qt(dim * padded), st(KEYS * padded), low(padded), high(padded);
    std::vector<float> decoded_keys(has_quantized ? KEYS * dim : 0);
    std::vector<float> decoded_values(has_quantized ? KEYS * value_dim : 0);
    std::vector<float> meta(has_quantized ? 2 * std::max(dim, value_dim) : 0);
    std::vector<float> folded_queries(has_quantized ? most * dim : 0), folded_offsets(most);
    std::vector<float> value_scales(KEYS), value_offsets(KEYS);
    bool folded = false;
    const float* key_rows[KEYS];
    const float* value_rows[KEYS];
    for (int64_t task = next++; task < tasks; task = next++) {
      const auto [row, tile] = tiles[task / kv_heads];
      const int64_t kvh = task % kv_heads;
      const int64_t count = sp[row + 1] - sp[row], n = std::min(QUERIES, count - tile), m_count = group * n;
      const bool direct = n < DIRECT_QUERIES;
      const int64_t* table = tp + row * width;
      const int64_t read = reads[row], exact_end = bounds[row][2];
      // query vector m = g * n + i: head kvh * group + g of query tile + i, at read position `position[m]`.
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t i = 0; i < n; ++i) {
          const float* src = qp + (sp[row] + tile + i) * qs0 + (kvh * group + g) * qs1;
          float* dst = qs.data() + (g * n + i) * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = src[d] * fscale;
          position[g * n + i] = causal ? read - count + tile + i : read - 1;  // not causal: every key
        }
      }
      std::fill(acc.begin(), acc.begin() + m_count * value_dim, 0.f);
      std::fill(top.begin(), top.end(), MINUS_INF);
      std::fill(total.begin(), total.end(), 0.f);
      // A prompt tile's queries transposed, padded to whole vectors (`transposed_scores`).
      const int64_t stride = (m_count + LANES - 1) / LANES * LANES;
      if (!direct) {
        at::vec::transpose_mxn<float>(qs.data(), dim, qt.data(), stride, m_count, dim);
        for (int64_t d = 0; d < dim && m_count < stride; ++d)
          std::fill(qt.begin() + d * stride + m_count, qt.begin() + (d + 1) * stride, 0.f);
      }
      for (int segment = QUANTIZED; segment <= FULL; ++segment) {
        const int64_t begin = bounds[row][segment == QUANTIZED ? 0 : segment == FULL ? 2 : 1];
        const int64_t end = segment == QUANTIZED ? bounds[row][1] : segment == FULL ? read : exact_end;
        if (end <= begin) continue;
        // The keys of [begin, end) query vector m sees: [lo[m], hi[m]); the tile's span of them.
        int64_t span_lo = end, span_hi = begin;
        for (int64_t m = 0; m < m_count; ++m) {
          const int64_t p = position[m];
          lo[m] = begin;
          hi[m] = std::min(end, p + 1);
          if (segment == DECODED || segment == EXACT) {  // a block read quantized once it ends <= p + 1 - window
            const int64_t ahead = p + 1 - window - begin;
            const int64_t sealed = ahead < 0 ? begin : std::min(end, begin + ahead / block_size * block_size);
            if (segment == DECODED) hi[m] = std::min(hi[m], sealed);
            else lo[m] = sealed;
          }
          if (hi[m] > lo[m]) span_lo = std::min(span_lo, lo[m]), span_hi = std::max(span_hi, hi[m]);
        }
        if (!direct) {  // as floats for the vectors of `transposed_softmax` (the padding sees every key)
          for (int64_t m = 0; m < stride; ++m) {
            low[m] = m < m_count ? static_cast<float>(lo[m]) : 0.f;
            high[m] = m < m_count ? static_cast<float>(hi[m]) : std::numeric_limits<float>::infinity();
          }
        }
        for (int64_t t0 = span_lo; t0 < span_hi; t0 += KEYS) {
          const int64_t keys = std::min(KEYS, span_hi - t0);
          const bool codes = segment == QUANTIZED || (segment == DECODED && decoded_codes);
          // A decode tile folds the scales into its query and weights instead of decoding every key and value: the
          // scores of a block's keys are (q * scale) . codes + q . zero, and the values of a token whose channels
          // form one group add (p * scale) * codes + p * zero (`folded`).
          const bool folded_keys = codes && direct && qkey.per_block();
          folded = codes && direct && qvalue.group >= value_dim;
          if (folded_keys || folded) {
            const int64_t* qtable = qtp + row * qwidth;
            for (int64_t j = 0, token = qrp[2 * row] + t0; j < keys;) {
              const int64_t block = qtable[token / block_size], slot = token % block_size;
              const int64_t run = std::min(keys - j, block_size - slot);
              if (token + run < qrp[2 * row + 1]) {  // the next block's codes fetched while this one is read
                const int64_t next = qtable[(token + run) / block_size];
                for (int64_t t = 0; t < block_size; ++t) {
                  __builtin_prefetch(qkey.codes + next * qkey.c0 + t * qkey.c1 + kvh * qkey.c2, 0, 3);
                  __builtin_prefetch(qvalue.codes + next * qvalue.c0 + t * qvalue.c1 + kvh * qvalue.c2, 0, 3);
                }
              }
              if (folded_keys) {
                qkey.metadata(block, slot, kvh, dim, meta.data(), meta.data() + dim);
                for (int64_t m = 0; m < m_count; ++m) {
                  const float* query_m = qs.data() + m * dim;
                  for (int64_t d = 0; d < dim; ++d) folded_queries[m * dim + d] = query_m[d] * meta[d];
                  folded_offsets[m] = dot(query_m, meta.data() + dim, dim);
                }
                for (int64_t r = 0; r < run; ++r) {
                  qkey.unpack(block, slot + r, kvh, dim, decoded_keys.data());
                  for (int64_t m = 0; m < m_count; ++m)
                    scores[m * KEYS + j + r] = dot(folded_queries.data() + m * dim, decoded_keys.data(), dim) +
                                               folded_offsets[m];
                }
              } else {
                qkey.decode(block, slot, run, kvh, dim, decoded_keys.data(), dim, meta.data());
                for (int64_t r = 0; r < run; ++r)
                  for (int64_t m = 0; m < m_count; ++m)
                    scores[m * KEYS + j + r] = dot(qs.data() + m * dim, decoded_keys.data() + r * dim, dim);
              }
              for (int64_t r = 0; r < run; ++r) {
                float* row_values = decoded_values.data() + (j + r) * value_dim;
                if (folded) {
                  qvalue.unpack(block, slot + r, kvh, value_dim, row_values);
                  qvalue.group_metadata(block, slot + r, kvh, 0, value_scales[j + r], value_offsets[j + r]);
                } else {
                  qvalue.decode(block, slot + r, 1, kvh, value_dim, row_values, value_dim, meta.data());
                }
                value_rows[j + r] = row_values;
              }
              j += run;
              token += run;
            }
          } else if (codes && predecoded_first[row] >= 0) {  // decoded once for the row's tiles
            const int64_t n = qrp[2 * row + 1] - qrp[2 * row];
            const float* row_keys = predecoded.get() + predecoded_first[row] + (kvh * n + t0) * dim;
            const float* row_values = predecoded.get() + predecoded_first[row] + n * kv_heads * dim +
                                      (kvh * n + t0) * value_dim;
            for (int64_t j = 0; j < keys; ++j)
              key_rows[j] = row_keys + j * dim, value_rows[j] = row_values + j * value_dim;
          } else if (codes) {
            // decoded here, into this thread's buffers, a block's run at a time (read position t: quantized token t)
            const int64_t* qtable = qtp + row * qwidth;
            for (int64_t j = 0, token = qrp[2 * row] + t0; j < keys;) {
              const int64_t block = qtable[token / block_size], slot = token % block_size;
              const int64_t run = std::min(keys - j, block_size - slot);
              qkey.decode(block, slot, run, kvh, dim, decoded_keys.data() + j * dim, dim, meta.data());
              qvalue.decode(block, slot, run, kvh, value_dim, decoded_values.data() + j * value_dim, value_dim,
                            meta.data());
              for (int64_t r = 0; r < run; ++r, ++j) {
                key_rows[j] = decoded_keys.data() + j * dim;
                value_rows[j] = decoded_values.data() + j * value_dim;
              }
              token += run;
            }
          } else if (segment == FULL) {
            const int64_t stored = fp[row] + t0 - begin;
            for (int64_t j = 0, column = stored / block_size, slot = stored % block_size; j < keys; ++j) {
              const int64_t block = table[column];
              key_rows[j] = kp + block * ks0 + slot * ks1 + kvh * ks2;
              value_rows[j] = vp + block * vs0 + slot * vs1 + kvh * vs2;
              if (++slot == block_size) {  // the next block (no division per key)
                slot = 0;
                ++column;
              }
            }
          } else {
            const int64_t k = segment == EXACT ? 0 : 2;  // the exact or the decoded pair
            for (int64_t j = 0, token = tsp[row] + t0 - begin; j < keys; ++j, ++token) {
              key_rows[j] = tsrc[k] + kvh * th[k] + token * tt[k];
              value_rows[j] = tsrc[k + 1] + kvh * th[k + 1] + token * tt[k + 1];
            }
          }
          if (!direct) {  // a prompt tile: scores, weights and values with the scores transposed
            bool masked = false;
            for (int64_t m = 0; m < m_count && !masked; ++m) masked = lo[m] > t0 || hi[m] < t0 + keys;
            transposed_scores(key_rows, keys, qt.data(), stride, dim, st.data());
            transposed_softmax(st.data(), keys, stride, t0, low.data(), high.data(), masked, top.data(), total.data(),
                               correction.data());
            chunk_values(acc.data(), m_count, value_dim, st.data(), 1, stride, correction.data(), value_rows, keys);
            continue;
          }
          if (!folded_keys && !folded)
            direct_scores(qs.data(), m_count, dim, key_rows, keys, scores.data(), value_rows, value_dim);
          for (int64_t m = 0; m < m_count; ++m) {  // the online softmax: scores become weights, sums are corrected
            float* s = scores.data() + m * KEYS;
            const int64_t from = std::max<int64_t>(lo[m] - t0, 0), to = std::min(keys, hi[m] - t0);
            if (to <= from) {  // the query vector sees none of the chunk: nothing to add
              std::fill(s, s + KEYS, 0.f);
              correction[m] = 1.f;
              continue;
            }
            std::fill(s, s + from, MINUS_INF);
            std::fill(s + to, s + KEYS, MINUS_INF);
            Vec most = Vec::loadu(s);
            for (int64_t j = LANES; j < KEYS; j += LANES) most = at::vec::maximum(most, Vec::loadu(s + j));
            float lanes[LANES];
            most.store(lanes);
            const float new_top = std::max(top[m], *std::max_element(lanes, lanes + LANES));
            correction[m] = std::exp(top[m] - new_top);  // 0 for the first chunk (top -inf)
            Vec sums(0.f);
            for (int64_t j = 0; j < KEYS; j += LANES) {
              const Vec e = (Vec::loadu(s + j) - Vec(new_top)).exp_u20();
              e.store(s + j);
              sums = sums + e;
            }
            sums.store(lanes);
            total[m] = total[m] * correction[m] + std::accumulate(lanes, lanes + LANES, 0.f);
            top[m] = new_top;
          }
          if (folded) {  // weights times the tokens' scales on the codes, then the zero points' share
            for (int64_t m = 0; m < m_count; ++m) {
              float* p = scores.data() + m * KEYS;
              Vec offsets(0.f);
              for (int64_t j = 0; j < keys; j += LANES) {
                const int64_t count = std::min(LANES, keys - j);
                const Vec weights = Vec::loadu(p + j, count);
                offsets = offsets + weights * Vec::loadu(value_offsets.data() + j, count);
                (weights * Vec::loadu(value_scales.data() + j, count)).store(p + j, count);
              }
              folded_offsets[m] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, offsets);
            }
          }
          chunk_values(acc.data(), m_count, value_dim, scores.data(), KEYS, 1, correction.data(), value_rows, keys);
          if (folded) {
            for (int64_t m = 0; m < m_count; ++m)
              for (int64_t d = 0; d < value_dim; ++d) acc[m * value_dim + d] += folded_offsets[m];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t i = 0; i < n; ++i) {
          const int64_t m = g * n + i;
          const float inverse = total[m] > 0.f ? 1.f / total[m] : 0.f;
          const float* o = acc.data() + m * value_dim;
          const int64_t at = (sp[row] + tile + i) * heads + kvh * group + g;
          float* dst = op + at * value_dim;
          for (int64_t d = 0; d < value_dim; ++d) dst[d] = o[d] * inverse;
          if (total[m] > 0.f) lsep[at] = top[m] + std::log(total[m]);  // the scores are scaled: the logits'
        }
      }
    }
  });
  return {out, lse};
}

// float16 rounding as hf_paged_cache/quantization/scales.py does it: a float16 is the nearest (ties to even), moved one
// step outward where it fell on the wrong side.
constexpr float FP16_MAX = 65504.f;

inline at::Half half_bits(uint16_t bits) { return at::Half(bits, at::Half::from_bits()); }

// The smallest float16 >= x, for x >= 0 (saturating at the float16 max).
inline at::Half fp16_up(float x) {
  x = std::min(x, FP16_MAX);
  const at::Half h(x);
  return static_cast<float>(h) < x ? half_bits(static_cast<uint16_t>(h.x + 1)) : h;
}

// The largest float16 <= x.
inline at::Half fp16_down(float x) {
  x = std::min(std::max(x, -FP16_MAX), FP16_MAX);
  const at::Half h(x);
  if (static_cast<float>(h) <= x) return h;
  if (h.x == 0 || h.x == 0x8000) return half_bits(0x8001);  // below zero: the smallest negative subnormal
  return half_bits(static_cast<uint16_t>(h.x & 0x8000 ? h.x + 1 : h.x - 1));
}

inline float nonzero(float scale) { return scale == 0.f ? 1.f : scale; }

// The least of low[0:n] and the greatest of high[0:n] (one array for both: its range), a vector's lanes at a time, then
// across them (the same in any order).
inline void range_of(const float* low, const float* high, int64_t n, float& lo, float& hi) {
  int64_t i = 0;
  lo = std::numeric_limits<float>::infinity(), hi = -lo;
  if (n >= LANES) {
    Vec least = Vec::loadu(low), most = Vec::loadu(high);
    for (i = LANES; i + LANES <= n; i += LANES)
      least = at::vec::minimum(least, Vec::loadu(low + i)), most = at::vec::maximum(most, Vec::loadu(high + i));
    float lanes[LANES];
    least.store(lanes);
    lo = *std::min_element(lanes, lanes + LANES);
    most.store(lanes);
    hi = *std::max_element(lanes, lanes + LANES);
  }
  for (; i < n; ++i) lo = std::min(lo, low[i]), hi = std::max(hi, high[i]);
}

// lowest[d] / highest[d] widened to take x[d] in, for d < n.
inline void widen(const float* x, int64_t n, float* lowest, float* highest) {
  int64_t d = 0;
  for (; d + LANES <= n; d += LANES) {
    const Vec v = Vec::loadu(x + d);
    at::vec::minimum(Vec::loadu(lowest + d), v).store(lowest + d);
    at::vec::maximum(Vec::loadu(highest + d), v).store(highest + d);
  }
  for (; d < n; ++d) lowest[d] = std::min(lowest[d], x[d]), highest[d] = std::max(highest[d], x[d]);
}

// c[d] = round((v[d] - zeros[d]) / divisors[d]) clamped to [floor, top] (no zeros: 0), rounding half to even as the
// torch encode's `round` does.
inline void encode_codes(const float* v, const float* zeros, const float* divisors, float floor, float top,
                         int64_t n, float* c) {
  int64_t d = 0;
  for (; d + LANES <= n; d += LANES) {
    const Vec shifted = zeros ? Vec::loadu(v + d) - Vec::loadu(zeros + d) : Vec::loadu(v + d);
    const Vec code = (shifted / Vec::loadu(divisors + d)).round();
    at::vec::minimum(at::vec::maximum(code, Vec(floor)), Vec(top)).store(c + d);
  }
  for (; d < n; ++d)
    c[d] = std::min(std::max(std::nearbyint((zeros ? v[d] - zeros[d] : v[d]) / divisors[d]), floor), top);
}

// A token's codes c[0:bytes * 8 / bits] (whole numbers as floats) into its bytes: as int8 for 8 bits, else planar
// (byte b holds code b + k * bytes at bit k * bits).
inline void pack_codes(const float* c, int64_t bits, int64_t bytes, uint8_t* out) {
  const int64_t planes = 8 / bits;
  int64_t b = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; b + 16 <= bytes; b += 16) {
    __m512i word = _mm512_setzero_si512();
    for (int64_t k = 0; k < planes; ++k)
      word = _mm512_or_si512(word, _mm512_slli_epi32(_mm512_cvtps_epi32(_mm512_loadu_ps(c + b + k * bytes)),
                                                     static_cast<unsigned>(k * bits)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + b), _mm512_cvtepi32_epi8(word));
  }
#endif
  for (; b < bytes; ++b) {
    if (bits == 8) {
      out[b] = static_cast<uint8_t>(static_cast<int8_t>(c[b]));
      continue;
    }
    uint8_t byte = 0;
    for (int64_t k = 0; k < planes; ++k) byte |= static_cast<uint8_t>(static_cast<uint8_t>(c[b + k * bytes]) << (k * bits));
    out[b] = byte;
  }
}

// Blocks `sources[i]` of x [blocks, block_size, kv_heads, d] (float32, unit stride along d) quantized into block
// targets[i] of a pool of one format (hf_paged_cache.quantization: Int8, or IntN without rotation), bit for bit as
// its torch encode: codes [pool, block_size, kv_heads, bytes]; scale (and zero) [pool, block_size, kv_heads(, groups)]
// per token (`per_token`), or [pool, kv_heads, groups (+ 1 with 8-bit scales: the unit, stored after the zero points)]
// per block. errors [block_size, kv_heads] receives the first block's reconstruction error per token and head,
// relative to the head's mean token norm in the block (the layer's sampled error statistics).
void quantize_blocks_cpu(const at::Tensor& x, const at::Tensor& sources, at::Tensor codes, at::Tensor scale,
                         at::Tensor zero, const at::Tensor& targets, int64_t bits, int64_t group, bool per_token,
                         int64_t scale_bits, at::Tensor errors) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == at::kFloat && x.stride(3) == 1, "quantize_blocks_cpu: x must be "
              "float32 [blocks, block_size, kv_heads, d] with unit stride along d");
  const at::Tensor src = sources.to(at::kLong).contiguous(), dst = targets.to(at::kLong).contiguous();
  const int64_t n = src.numel(), block_size = x.size(1), heads = x.size(2), dim = x.size(3);
  TORCH_CHECK(dst.numel() == n && codes.is_contiguous() && scale.is_contiguous() &&
                  (!zero.numel() || zero.is_contiguous()),
              "quantize_blocks_cpu: one target per source and contiguous pool fields");
  TORCH_CHECK(codes.size(1) == block_size && codes.size(2) == heads && codes.size(3) * 8 == dim * bits &&
                  group >= 1 && dim % group == 0 && (bits == 8) == (zero.numel() == 0) &&
                  (scale_bits == 16 || !per_token),
              "quantize_blocks_cpu: pool fields do not match x and the format");
  const int64_t groups = dim / group, levels = bits == 8 ? 127 : (1 << bits) - 1, bytes = codes.size(3);
  const int64_t* sp = src.data_ptr<int64_t>();
  const int64_t* tp = dst.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < x.size(0) && tp[i] >= 0 && tp[i] < codes.size(0) && tp[i] < scale.size(0),
                "quantize_blocks_cpu: block id out of range");
  }
  const float* xp = x.data_ptr<float>();
  const int64_t x0 = x.stride(0), x1 = x.stride(1), x2 = x.stride(2);
  uint8_t* cp = static_cast<uint8_t*>(codes.data_ptr());
  at::Half* zp = zero.numel() ? zero.data_ptr<at::Half>() : nullptr;
  at::Half* scale16 = scale.scalar_type() == at::kHalf ? scale.data_ptr<at::Half>() : nullptr;
  uint8_t* scale8 = scale.scalar_type() == at::kByte ? scale.data_ptr<uint8_t>() : nullptr;
  TORCH_CHECK((scale_bits == 8) == (scale8 != nullptr), "quantize_blocks_cpu: scale dtype does not match scale_bits");
  TORCH_CHECK(errors.scalar_type() == at::kFloat && errors.is_contiguous() && errors.numel() == block_size * heads,
              "quantize_blocks_cpu: errors must be float32 [block_size, kv_heads]");
  float* ep = errors.data_ptr<float>();
  const int64_t meta = per_token ? groups : groups + (scale_bits == 8 ? 1 : 0);  // per (token or block) and head

  at::parallel_for(0, n * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> values(block_size * dim), step(groups), low(groups), exact(groups);
    std::vector<float> decoded(block_size * dim), lowest(dim), highest(dim), zero_points(dim), divisors(dim);
    std::vector<float> steps(dim), codes_of_token(dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / heads, h = task % heads, block = tp[i];
      for (int64_t t = 0; t < block_size; ++t) {  // clamped to the float16 range (asymmetric formats)
        const float* row = xp + sp[i] * x0 + t * x1 + h * x2;
        for (int64_t d = 0; d < dim; ++d)
          values[t * dim + d] = bits == 8 ? row[d] : std::min(std::max(row[d], -FP16_MAX), FP16_MAX);
      }
      // Token t's codes from its values: round((v - zero) / divisor) clamped to [floor, top] per channel, into its
      // bytes (planar for sub-byte codes); for the sampled block, its decode `code * step + zero` for the error.
      const auto encode = [&](int64_t t, const float* zeros, float floor, float top) {
        uint8_t* out = cp + ((block * block_size + t) * heads + h) * bytes;
        float* c = codes_of_token.data();
        encode_codes(values.data() + t * dim, zeros, divisors.data(), floor, top, dim, c);
        if (i == 0) {
          for (int64_t d = 0; d < dim; ++d) decoded[t * dim + d] = c[d] * steps[d] + (zeros ? zeros[d] : 0.f);
        }
        pack_codes(c, bits, bytes, out);
      };
      if (bits == 8) {  // symmetric per token: scale = absmax / 127 rounded up
        for (int64_t t = 0; t < block_size; ++t) {
          float lo, hi;
          range_of(values.data() + t * dim, values.data() + t * dim, dim, lo, hi);
          const at::Half s = fp16_up(std::max(std::fabs(lo), std::fabs(hi)) / 127.f);
          scale16[(block * block_size + t) * heads + h] = s;
          std::fill(divisors.begin(), divisors.end(), nonzero(static_cast<float>(s)));
          std::fill(steps.begin(), steps.end(), static_cast<float>(s));
          encode(t, nullptr, -127.f, 127.f);
        }
      } else {  // asymmetric: (scale, zero) per group of a token, or of the block's tokens; 8-bit scales count units
        const int64_t slices = per_token ? block_size : 1, tokens = per_token ? 1 : block_size;
        for (int64_t slice = 0; slice < slices; ++slice) {
          const int64_t base = (per_token ? (block * block_size + slice) * heads + h : block * heads + h) * meta;
          // each channel's range over the slice's tokens, then each group's over its channels
          std::copy_n(values.data() + slice * tokens * dim, dim, lowest.data());
          std::copy_n(values.data() + slice * tokens * dim, dim, highest.data());
          for (int64_t t = slice * tokens + 1; t < (slice + 1) * tokens; ++t)
            widen(values.data() + t * dim, dim, lowest.data(), highest.data());
          float exact_most = 0.f;
          for (int64_t g = 0; g < groups; ++g) {
            float lo, hi;
            range_of(lowest.data() + g * group, highest.data() + g * group, group, lo, hi);
            const at::Half z = fp16_down(lo);
            low[g] = static_cast<float>(z);
            exact[g] = (hi - low[g]) / static_cast<float>(levels);
            exact_most = std::max(exact_most, exact[g]);
            zp[base + g] = z;
          }
          if (scale8) {  // steps of a unit = the largest scale / 255, rounded up
            const at::Half unit = fp16_up(exact_most / 255.f);
            zp[base + groups] = unit;
            scale8[base + groups] = 0;
            const float u = static_cast<float>(unit);
            for (int64_t g = 0; g < groups; ++g) {
              const float count = std::min(std::max(std::ceil(exact[g] / nonzero(u)), 0.f), 255.f);
              scale8[base + g] = static_cast<uint8_t>(count);
              step[g] = static_cast<float>(scale8[base + g]) * u;
            }
          } else {
            for (int64_t g = 0; g < groups; ++g) {
              const at::Half s = fp16_up(exact[g]);
              scale16[base + g] = s;
              step[g] = static_cast<float>(s);
            }
          }
          for (int64_t g = 0; g < groups; ++g) {  // per channel, so the loop over a token's channels vectorizes
            for (int64_t d = g * group; d < (g + 1) * group; ++d)
              zero_points[d] = low[g], divisors[d] = nonzero(step[g]), steps[d] = step[g];
          }
          for (int64_t t = slice * tokens; t < (slice + 1) * tokens; ++t)
            encode(t, zero_points.data(), 0.f, static_cast<float>(levels));
        }
      }
      if (i == 0) {  // |decoded - x| per token over the head's mean |x| in the block
        float norms = 0.f;
        for (int64_t t = 0; t < block_size; ++t) {
          const float* row = xp + sp[0] * x0 + t * x1 + h * x2;
          float norm = 0.f, error = 0.f;
          for (int64_t d = 0; d < dim; ++d) {
            norm += row[d] * row[d];
            error += (decoded[t * dim + d] - row[d]) * (decoded[t * dim + d] - row[d]);
          }
          norms += std::sqrt(norm);
          ep[t * heads + h] = std::sqrt(error);
        }
        const float mean = std::max(norms / static_cast<float>(block_size), 1e-12f);
        for (int64_t t = 0; t < block_size; ++t) ep[t * heads + h] /= mean;
      }
    }
  });
}


}  // namespace

TORCH_LIBRARY(hf_paged_cache, m) {
  m.def("paged_attention_cpu(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_starts, "
        "Tensor seq_lens, Tensor first_tokens, float scale, Tensor[] quantized, Tensor? quantized_tables, "
        "Tensor? quantized_reads, int[] quantized_formats, Tensor[] transition, Tensor? transition_starts, "
        "int window, bool causal=True) -> (Tensor, Tensor)");
  m.def("quantize_blocks_cpu(Tensor x, Tensor sources, Tensor(a!) codes, Tensor(b!) scale, Tensor(c!) zero, "
        "Tensor targets, int bits, int group, bool per_token, int scale_bits, Tensor(d!) errors) -> ()");
}

TORCH_LIBRARY_IMPL(hf_paged_cache, CPU, m) {
  m.impl("paged_attention_cpu", &paged_attention_cpu);
  m.impl("quantize_blocks_cpu", &quantize_blocks_cpu);
}
