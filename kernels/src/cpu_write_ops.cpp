// A step's K/V stored at their slots of a paged cache on the CPU, keys and values in one call: the torch path's write
// (hf_paged_cache/layers/paged.py). Torch's index_copy_ takes one call per tensor, and each call waits on its
// destination rows one by one: the rows a decode step writes lie far apart in storage that has not been touched since
// the layer's previous step, so every row misses the caches. Here the destinations of the tokens ahead are prefetched
// while a token is copied. Registered as torch.ops.hf_paged_cache.write_kv_cpu; kernels/cpu_write.py calls it (its
// reference is kernels/reference.py's write_kv_ref). Built with the attention kernel (cpu_attention.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

namespace {

constexpr int64_t AHEAD = 8;     // tokens whose destinations are prefetched before their copy
constexpr int64_t GRAIN = 256;   // tokens per task: a decode step's few writes stay on one thread
constexpr int64_t LINE = 64;     // bytes per cache line

// One side (keys or values): `states` [tokens, heads, d] and `cache` [num_blocks, block_size, heads, d], both with a
// contiguous d; token t goes to slot slots[t] (block slots[t] / block_size, offset slots[t] % block_size).
struct Side {
  char* cache;
  const char* states;
  int64_t block_stride, offset_stride, cache_head_stride, token_stride, state_head_stride, heads, row_bytes,
      block_size;

  Side(const at::Tensor& cache_tensor, const at::Tensor& states_tensor)
      : cache(static_cast<char*>(cache_tensor.data_ptr())),
        states(static_cast<const char*>(states_tensor.data_ptr())),
        block_stride(cache_tensor.stride(0) * cache_tensor.element_size()),
        offset_stride(cache_tensor.stride(1) * cache_tensor.element_size()),
        cache_head_stride(cache_tensor.stride(2) * cache_tensor.element_size()),
        token_stride(states_tensor.stride(0) * states_tensor.element_size()),
        state_head_stride(states_tensor.stride(1) * states_tensor.element_size()),
        heads(states_tensor.size(1)),
        row_bytes(states_tensor.size(2) * states_tensor.element_size()),
        block_size(cache_tensor.size(1)) {}

  char* destination(int64_t slot, int64_t head) const {
    return cache + (slot / block_size) * block_stride + (slot % block_size) * offset_stride + head * cache_head_stride;
  }

  void prefetch(int64_t slot) const {
    for (int64_t h = 0; h < heads; ++h) {
      const char* row = destination(slot, h);
      for (int64_t at = 0; at < row_bytes; at += LINE) __builtin_prefetch(row + at, 1, 3);
    }
  }

  void copy(int64_t token, int64_t slot) const {
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(destination(slot, h), states + token * token_stride + h * state_head_stride, row_bytes);
  }
};

void check_side(const at::Tensor& cache, const at::Tensor& states, const char* name) {
  TORCH_CHECK(cache.device().is_cpu() && states.device().is_cpu(), "write_kv_cpu: CPU tensors only");
  TORCH_CHECK(cache.dim() == 4 && states.dim() == 3, "write_kv_cpu: ", name,
              " cache must be [num_blocks, block_size, heads, d] and its states [tokens, heads, d]");
  TORCH_CHECK(cache.scalar_type() == states.scalar_type(), "write_kv_cpu: ", name,
              " states must have the cache's dtype");
  TORCH_CHECK(cache.size(2) == states.size(1) && cache.size(3) == states.size(2), "write_kv_cpu: ", name,
              " states must have the cache's heads and head dim");
  TORCH_CHECK(cache.stride(3) == 1 && states.stride(2) == 1, "write_kv_cpu: ", name,
              " cache and states need a contiguous head dim");
}

// Token t of key / value [tokens, kv_heads, d] (any strides but a contiguous d) stored at slot slot_mapping[t] of
// k_cache / v_cache [num_blocks, block_size, kv_heads, d] (keys and values may differ in d); a negative slot (padding)
// is skipped. Every slot is checked before anything is written, so a refused call changes nothing.
void write_kv_cpu(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& key, const at::Tensor& value,
                  const at::Tensor& slot_mapping) {
  check_side(k_cache, key, "key");
  check_side(v_cache, value, "value");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong && slot_mapping.device().is_cpu(),
              "write_kv_cpu: slot_mapping must be a CPU int64 [tokens] tensor");
  TORCH_CHECK(key.size(0) == slot_mapping.size(0) && value.size(0) == slot_mapping.size(0),
              "write_kv_cpu: key, value and slot_mapping must agree on tokens");
  TORCH_CHECK(k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1),
              "write_kv_cpu: k_cache and v_cache must have the same blocks");
  const at::Tensor slots_tensor = slot_mapping.contiguous();
  const int64_t* slots = slots_tensor.data_ptr<int64_t>();
  const int64_t tokens = slots_tensor.size(0), capacity = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] < capacity, "write_kv_cpu: slot ", slots[t], " of token ", t, " is past the cache's ",
                capacity, " slots");
  const Side keys(k_cache, key), values(v_cache, value);
  at::parallel_for(0, tokens, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < std::min(end, begin + AHEAD); ++t)
      if (slots[t] >= 0) keys.prefetch(slots[t]), values.prefetch(slots[t]);
    for (int64_t t = begin; t < end; ++t) {
      if (t + AHEAD < end && slots[t + AHEAD] >= 0) keys.prefetch(slots[t + AHEAD]), values.prefetch(slots[t + AHEAD]);
      if (slots[t] >= 0) keys.copy(t, slots[t]), values.copy(t, slots[t]);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_paged_cache, m) {
  m.def("write_kv_cpu(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(hf_paged_cache, CPU, m) { m.impl("write_kv_cpu", &write_kv_cpu); }
