// DFlash KV injection's last step on the CPU in one call (kernels/context_kv.py: the layout, and
// context_kv_reference, the ~20 torch ops this replaces: ~0.5-0.7 ms of dispatch a drafting
// step at draft sizes on a 2-core CPU, where the arithmetic is a few thousand elements).
//
// dflash_cpu::context_kv(kv [T, L * 2 * Hkv * D], k_norm [L, D], eps, cos fp32 [T, D / 2],
//     sin fp32 [T, D / 2], slots int64 [T], k_pools [L, P, Hkv, D] (written), v_pools (written))
//     -> (): for token t, layer l, KV head h: k = kv's K head normed (the mean square in fp32,
//     rounded to the dtype, times k_norm[l], rounded), rotated by RoPE (rotate-half: k * cos +
//     roll(k, D / 2) with the first half negated * sin, cos / sin of token t's angles (the
//     caller's torch.cos / torch.sin, as the reference's) rounded to the dtype, each product and
//     the sum rounded), and written to k_pools[l, slots[t], h]; v_pools[l, slots[t], h] = the V
//     head as it is. Tokens in parallel (OpenMP) from 512 (token, layer, head) triples on.
//     fp32 or bf16, kv, k_norm and the pools of one dtype; the same roundings as the reference,
//     the mean square summed in order (the reference's sum order differs: an ulp now and then).

// (ATen and the op registry only: no Python headers, which a runtime image does not have)
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>

namespace {

constexpr int64_t kMaxHeadDim = 512;

// x rounded to bf16 (round to nearest even, as c10::BFloat16(float) rounds) and back; NaN kept
inline float round_to(float x, float) { return x; }
inline float round_to(float x, c10::BFloat16) {
  if (x != x) return x;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

template <typename T>
void context_kv_impl(const at::Tensor& kv, const at::Tensor& k_norm, double eps, const at::Tensor& cos,
                     const at::Tensor& sin, const at::Tensor& slots, at::Tensor& k_pools, at::Tensor& v_pools) {
  const int64_t n = kv.size(0), L = k_pools.size(0), hkv = k_pools.size(2), d = k_pools.size(3), half = d / 2;
  const T* src = kv.data_ptr<T>();
  const T* kn = k_norm.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  T* kp = k_pools.data_ptr<T>();
  T* vp = v_pools.data_ptr<T>();
  const int64_t row = kv.stride(0), layer_stride = k_pools.stride(0), slot_stride = k_pools.stride(1);
  const float e = static_cast<float>(eps), inv_d = 1.f / static_cast<float>(d);
#pragma omp parallel for if (n * L * hkv >= 512)
  for (int64_t t = 0; t < n; ++t) {
    const T tag{};
    float cs[kMaxHeadDim], sn[kMaxHeadDim], k[kMaxHeadDim];
    for (int64_t i = 0; i < half; ++i) {
      cs[i] = cs[i + half] = round_to(cp[t * half + i], tag);
      sn[i] = sn[i + half] = round_to(sp[t * half + i], tag);
    }
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t h = 0; h < hkv; ++h) {
        const T* kin = src + t * row + ((l * 2) * hkv + h) * d;
        const T* vin = src + t * row + ((l * 2 + 1) * hkv + h) * d;
        float ss = 0.f;
        for (int64_t i = 0; i < d; ++i) {
          const float x = static_cast<float>(kin[i]);
          ss += x * x;
        }
        const float r = 1.f / std::sqrt(ss * inv_d + e);
        for (int64_t i = 0; i < d; ++i)
          k[i] = round_to(round_to(static_cast<float>(kin[i]) * r, tag) * static_cast<float>(kn[l * d + i]), tag);
        T* kout = kp + l * layer_stride + slot[t] * slot_stride + h * d;
        T* vout = vp + l * layer_stride + slot[t] * slot_stride + h * d;
        for (int64_t i = 0; i < half; ++i)
          kout[i] = static_cast<T>(round_to(round_to(k[i] * cs[i], tag) + round_to(-k[i + half] * sn[i], tag), tag));
        for (int64_t i = half; i < d; ++i)
          kout[i] = static_cast<T>(round_to(round_to(k[i] * cs[i], tag) + round_to(k[i - half] * sn[i], tag), tag));
        std::memcpy(vout, vin, d * sizeof(T));
      }
    }
  }
}

void context_kv(const at::Tensor& kv, const at::Tensor& k_norm, double eps, const at::Tensor& cos,
                const at::Tensor& sin, const at::Tensor& slots, at::Tensor& k_pools, at::Tensor& v_pools) {
  const auto dt = kv.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "context_kv: fp32 or bf16, got ", dt);
  TORCH_CHECK(k_norm.scalar_type() == dt && k_pools.scalar_type() == dt && v_pools.scalar_type() == dt,
              "context_kv: kv, k_norm and the pools must share a dtype");
  TORCH_CHECK(kv.dim() == 2 && kv.stride(1) == 1 && k_norm.is_contiguous() && k_pools.dim() == 4 &&
                  k_pools.is_contiguous() && v_pools.is_contiguous() && v_pools.sizes() == k_pools.sizes(),
              "context_kv: kv [T, L * 2 * Hkv * D] (rows contiguous), pools [L, P, Hkv, D] contiguous");
  const int64_t n = kv.size(0), d = k_pools.size(3);
  TORCH_CHECK(kv.size(1) == k_pools.size(0) * 2 * k_pools.size(2) * d && k_norm.numel() == k_pools.size(0) * d &&
                  d % 2 == 0 && d <= kMaxHeadDim,
              "context_kv: kv and k_norm do not match the pools' layers, heads and head size (even, <= 512)");
  for (const at::Tensor* cs : {&cos, &sin})
    TORCH_CHECK(cs->scalar_type() == at::kFloat && cs->is_contiguous() && cs->dim() == 2 && cs->size(0) == n &&
                    cs->size(1) == d / 2,
                "context_kv: cos and sin fp32 [T, D / 2]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == n,
              "context_kv: slots int64 [T]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < k_pools.size(1), "context_kv: slot ", slot[t], " out of the pools' range");
  if (dt == at::kFloat)
    context_kv_impl<float>(kv, k_norm, eps, cos, sin, slots, k_pools, v_pools);
  else
    context_kv_impl<c10::BFloat16>(kv, k_norm, eps, cos, sin, slots, k_pools, v_pools);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash_cpu, m) {
  m.def(
      "context_kv(Tensor kv, Tensor k_norm, float eps, Tensor cos, Tensor sin, Tensor slots, "
      "Tensor(a!) k_pools, Tensor(b!) v_pools) -> ()");
}

TORCH_LIBRARY_IMPL(dflash_cpu, CPU, m) { m.impl("context_kv", &context_kv); }
