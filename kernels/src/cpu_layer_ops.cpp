// The element-wise steps of a Llama-style decoder layer, one pass each, for the batch generator's fused layers
// (hf_paged_cache/serving/fused_layers.py): an RMS norm and the rotary embedding of queries and keys. In eager torch
// each is a chain of small ops (a norm six, a rotary twelve), every one a pass over the tokens and an allocation.
// Registered as torch.ops.hf_paged_cache.rms_norm_cpu / rotary_cpu; kernels/cpu_layer.py calls them, and holds their
// torch references. Built with the attention kernel (cpu_attention.py), with floating-point contraction off, so a
// product and a sum round as torch's separate ops do.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t LANES = Vec::size();
constexpr int64_t GRAIN = 16;  // tokens per task: a norm or a rotation of one token is too little to hand a thread

// x [..., hidden] float32 (contiguous): weight * (x * rsqrt(mean(x^2) + eps)) per token, as transformers' LlamaRMSNorm
// computes it in float32 (the mean's sum in another order, so it may differ from torch's in the last bit).
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm_cpu: float32 only");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden, "rms_norm_cpu: weight must be [hidden]");
  const at::Tensor input = x.contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty_like(input);
  const int64_t tokens = hidden ? input.numel() / hidden : 0;
  const float* xp = input.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, tokens, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * hidden;
      float* dst = op + t * hidden;
      Vec even(0.f), odd(0.f);
      int64_t i = 0;
      for (; i + 2 * LANES <= hidden; i += 2 * LANES) {
        const Vec a = Vec::loadu(row + i), b = Vec::loadu(row + i + LANES);
        even = at::vec::fmadd(a, a, even);
        odd = at::vec::fmadd(b, b, odd);
      }
      for (; i + LANES <= hidden; i += LANES) {
        const Vec a = Vec::loadu(row + i);
        even = at::vec::fmadd(a, a, even);
      }
      float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, even + odd);
      for (; i < hidden; ++i) sum += row[i] * row[i];
      const float inverse = 1.f / std::sqrt(sum / static_cast<float>(hidden) + epsilon);
      const Vec scale(inverse);
      i = 0;
      for (; i + LANES <= hidden; i += LANES)
        (Vec::loadu(wp + i) * (Vec::loadu(row + i) * scale)).store(dst + i);
      for (; i < hidden; ++i) dst[i] = wp[i] * (row[i] * inverse);
    }
  });
  return out;
}

// One head's rotation: out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half]).
inline void rotate(const float* x, const float* cos, const float* sin, int64_t half, float* out) {
  int64_t i = 0;
  for (; i + LANES <= half; i += LANES) {
    const Vec low = Vec::loadu(x + i), high = Vec::loadu(x + half + i);
    (low * Vec::loadu(cos + i) + high.neg() * Vec::loadu(sin + i)).store(out + i);
    (high * Vec::loadu(cos + half + i) + low * Vec::loadu(sin + half + i)).store(out + half + i);
  }
  for (; i < half; ++i) {
    out[i] = x[i] * cos[i] + (-x[half + i]) * sin[i];
    out[half + i] = x[half + i] * cos[half + i] + x[i] * sin[half + i];
  }
}

// q [batch, tokens, heads, d] and k [batch, tokens, kv_heads, d] (float32, d contiguous; e.g. the projections' outputs
// viewed by head), cos / sin [batch, tokens, d]: both rotated as transformers' apply_rotary_pos_emb does, into new
// tensors of the same shapes (contiguous).
std::tuple<at::Tensor, at::Tensor> rotary_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                              const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos.dim() == 3 && sin.sizes() == cos.sizes(), "rotary_cpu: shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat, "rotary_cpu: float32 only");
  const int64_t batch = q.size(0), tokens = q.size(1), dim = q.size(3);
  TORCH_CHECK(k.size(0) == batch && k.size(1) == tokens && k.size(3) == dim && cos.size(0) == batch &&
                  cos.size(1) == tokens && cos.size(2) == dim && dim % 2 == 0,
              "rotary_cpu: q, k, cos and sin must agree on batch, tokens and an even head dim");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor q_out = at::empty_like(qc), k_out = at::empty_like(kc);
  const int64_t heads = q.size(2), kv_heads = k.size(2), half = dim / 2;
  const float *qp = qc.data_ptr<float>(), *kp = kc.data_ptr<float>();
  const float *cp = cc.data_ptr<float>(), *sp = sc.data_ptr<float>();
  float *qo = q_out.data_ptr<float>(), *ko = k_out.data_ptr<float>();
  at::parallel_for(0, batch * tokens, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cp + t * dim, *s = sp + t * dim;
      for (int64_t h = 0; h < heads; ++h) rotate(qp + (t * heads + h) * dim, c, s, half, qo + (t * heads + h) * dim);
      for (int64_t h = 0; h < kv_heads; ++h)
        rotate(kp + (t * kv_heads + h) * dim, c, s, half, ko + (t * kv_heads + h) * dim);
    }
  });
  return {q_out, k_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_paged_cache, m) {
  m.def("rms_norm_cpu(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_cpu(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hf_paged_cache, CPU, m) {
  m.impl("rms_norm_cpu", &rms_norm_cpu);
  m.impl("rotary_cpu", &rotary_cpu);
}
