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
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

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

// dflash_cpu::screen_candidates(approx [R, V] fp32 or bf16 rows contiguous, a [V] fp32, c [V] fp32,
// h [R] fp32, g [R] fp32, rel, scale) -> int64 [N]: the tokens, ascending, that some row r keeps.
// With m_r = max_i |approx_i| and E_i = (h_r * a_i + g_r * c_i + rel * m_r) * scale (a bound on
// |logit_i - approx_i|, see models/screened_head.py), T_r = max_i (approx_i - E_i), and token i is
// kept where approx_i + E_i >= T_r - slack_r. The fp32 arithmetic here rounds each E_i, difference
// and sum by a few units in the last place of values below m_r + max E: slack_r = 2^-16 * (|T_r| +
// m_r + max_i E_i) covers them many times over, so a token the exact test keeps is never dropped
// (the caller's scale carries the margin for E's own products). Empty (never otherwise: a row's
// top token is always kept) when a screened value is not finite.
template <typename T>
bool screen_row(const T* p, int64_t n, const float* a, const float* c, float h, float g, float rel, float scale,
                uint8_t* keep) {
  const int64_t body = n / VL * VL;
  vf top_v = {}, bad_v = {};
  for (int64_t i = 0; i < body; i += VL) {
    const vf v = load(p + i), z = v - v;  // 0, or NaN where v is not finite
    bad_v += z;
    const vf m = v < 0 ? -v : v;
    top_v = m > top_v ? m : top_v;
  }
  float top = 0.f, bad = 0.f;
  for (int j = 0; j < VL; ++j) top = std::max(top, top_v[j]), bad += bad_v[j];
  for (int64_t i = body; i < n; ++i) bad += value(p, i) - value(p, i), top = std::max(top, std::fabs(value(p, i)));
  if (bad != 0.f) return false;  // (NaN: a value was not finite)
  const float k = rel * top;
  const vf hv = h - vf{}, gv = g - vf{}, kv = k - vf{}, sv = scale - vf{};
  vf t_v = -std::numeric_limits<float>::infinity() - vf{}, e_v = {};
  for (int64_t i = 0; i < body; i += VL) {
    const vf e = (hv * load(a + i) + gv * load(c + i) + kv) * sv, d = load(p + i) - e;
    t_v = d > t_v ? d : t_v;
    e_v = e > e_v ? e : e_v;
  }
  float t = -std::numeric_limits<float>::infinity(), emax = 0.f;
  for (int j = 0; j < VL; ++j) t = std::max(t, t_v[j]), emax = std::max(emax, e_v[j]);
  for (int64_t i = body; i < n; ++i) {
    const float e = (h * a[i] + g * c[i] + k) * scale;
    t = std::max(t, value(p, i) - e), emax = std::max(emax, e);
  }
  if (!std::isfinite(t) || !std::isfinite(emax)) return false;
  const float limit = t - 0x1p-16f * (std::fabs(t) + top + emax);
  const vf lv = limit - vf{};
  for (int64_t i = 0; i < body; i += VL) {
    const vi in = (load(p + i) + (hv * load(a + i) + gv * load(c + i) + kv) * sv) >= lv;
    for (int j = 0; j < VL; ++j) keep[i + j] = static_cast<uint8_t>(in[j] & 1);
  }
  for (int64_t i = body; i < n; ++i) keep[i] = static_cast<uint8_t>(value(p, i) + (h * a[i] + g * c[i] + k) * scale >= limit);
  return true;
}

at::Tensor screen_candidates(const at::Tensor& approx, const at::Tensor& a, const at::Tensor& c, const at::Tensor& h,
                             const at::Tensor& g, double rel, double scale) {
  const auto dt = approx.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "screen_candidates: fp32 or bf16 screen, got ", dt);
  TORCH_CHECK(approx.device().is_cpu() && approx.dim() == 2 && approx.stride(1) == 1,
              "screen_candidates: a CPU [R, V] screen with contiguous rows");
  const int64_t rows = approx.size(0), n = approx.size(1);
  for (const at::Tensor* t : {&a, &c})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n,
                "screen_candidates: a, c fp32 [V]");
  for (const at::Tensor* t : {&h, &g})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == rows,
                "screen_candidates: h, g fp32 [R]");
  std::vector<uint8_t> keep(static_cast<size_t>(rows * n), 0), ok(static_cast<size_t>(rows), 0);
  const float *pa = a.data_ptr<float>(), *pc = c.data_ptr<float>();
  const float *ph = h.data_ptr<float>(), *pg = g.data_ptr<float>();
  const float r32 = static_cast<float>(rel), s32 = static_cast<float>(scale);
  const int64_t stride = approx.stride(0);
#pragma omp parallel for if (rows > 1 && rows * n >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* kr = keep.data() + r * n;
    ok[r] = dt == at::kFloat
                ? screen_row(approx.data_ptr<float>() + r * stride, n, pa, pc, ph[r], pg[r], r32, s32, kr)
                : screen_row(approx.data_ptr<c10::BFloat16>() + r * stride, n, pa, pc, ph[r], pg[r], r32, s32, kr);
  }
  for (int64_t r = 0; r < rows; ++r)
    if (!ok[r]) return at::empty({0}, approx.options().dtype(at::kLong));
  for (int64_t r = 1; r < rows; ++r)  // the union, in row 0
    for (int64_t i = 0; i < n; ++i) keep[i] |= keep[r * n + i];
  std::vector<int64_t> out;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {  // (eight tokens at a time: nearly all are not kept)
    uint64_t w;
    std::memcpy(&w, keep.data() + i, 8);
    if (w)
      for (int j = 0; j < 8; ++j)
        if (keep[i + j]) out.push_back(i + j);
  }
  for (; i < n; ++i)
    if (keep[i]) out.push_back(i);
  at::Tensor res = at::empty({static_cast<int64_t>(out.size())}, approx.options().dtype(at::kLong));
  if (!out.empty()) std::memcpy(res.data_ptr<int64_t>(), out.data(), out.size() * sizeof(int64_t));
  return res;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash_cpu, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("screen_candidates(Tensor approx, Tensor a, Tensor c, Tensor h, Tensor g, float rel, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash_cpu, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("screen_candidates", &screen_candidates);
}
