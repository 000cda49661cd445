// Greedy token choice on the CPU: the argmax of each row of logits in one call
// (models/layers.argmax_last). torch's CPU argmax reduces a 49,152-wide bf16 row at ~1.5 GB/s
// (upcast to fp32 first: 12 rows ~1 ms, 32 rows ~3 ms of a 2-core step); this reads each row
// once, 16 fp32 lanes at a time, rows in parallel (indices as int32 lanes: V < 2^31).
//
// dflash_cpu::argmax_rows(x [R, V] fp32 or bf16, rows contiguous) -> int64 [R]: the index of each
// row's largest value, the first one on ties, the first NaN where a row has one (torch.argmax's
// rules; bf16 compares as its exact fp32 value).

// (ATen and the op registry only: no Python headers, which a runtime image does not have)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr int VL = 16;
typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

inline float value(const float* p, int64_t i) { return p[i]; }
inline float value(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vf load(const c10::BFloat16* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// the index of the row's largest value (first on ties), or of its first NaN: per lane the
// largest value and where it first came (strictly greater replaces), then the lowest index among
// the lanes holding the maximum
template <typename T>
int64_t row_argmax(const T* p, int64_t n) {
  const int64_t body = n / VL * VL;
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  if (body) {
    vf m = load(p);
    vi nan = m != m;
    vi idx, lane;
    for (int j = 0; j < VL; ++j) idx[j] = lane[j] = j;
    for (int64_t i = VL; i < body; i += VL) {
      const vf v = load(p + i);
      nan |= v != v;
      const vi up = v > m;
      m = up ? v : m;
      idx = up ? lane + static_cast<int32_t>(i) : idx;
    }
    bool any_nan = false;
    at = -1;
    for (int j = 0; j < VL; ++j) {
      any_nan |= nan[j] != 0;
      if (at < 0 || m[j] > best || (m[j] == best && idx[j] < at)) best = m[j], at = idx[j];
    }
    if (any_nan)
      for (int64_t i = 0; i < body; ++i)
        if (value(p, i) != value(p, i)) return i;
  }
  for (int64_t i = body; i < n; ++i) {
    const float v = value(p, i);
    if (v != v) return i;
    if (v > best) best = v, at = i;
  }
  return at;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "argmax_rows: fp32 or bf16, got ", dt);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0 &&
                  x.size(1) < std::numeric_limits<int32_t>::max(),
              "argmax_rows: a CPU [R, V] tensor with 1 <= V < 2^31 and contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  if (dt == at::kFloat) {
    const float* p = x.data_ptr<float>();
#pragma omp parallel for if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; ++r) o[r] = row_argmax(p + r * stride, n);
  } else {
    const c10::BFloat16* p = x.data_ptr<c10::BFloat16>();
#pragma omp parallel for if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; ++r) o[r] = row_argmax(p + r * stride, n);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash_cpu, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(dflash_cpu, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
