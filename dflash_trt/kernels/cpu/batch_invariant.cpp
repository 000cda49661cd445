// Batch-invariant CPU kernels: every output row is computed by the same sequence of floating
// point operations whatever the number and content of the other rows in the call.
//
// Why: a bf16 forward rounds every op's fp32 result to bf16, so a last-bit difference in an fp32
// sum (a GEMM that picks its K blocking or its kernel by the number of rows M, an attention that
// tiles queries and keys by the query count) becomes a different bf16 value, grows over the
// layers and flips a greedy choice at a near tie. A decode step (1 row per sequence) and a verify
// block (B rows) then give the same position different logits, and speculative decoding stops
// being exactly plain decoding. These kernels fix the order of every reduction per row:
//
// dflash_cpu::bi_linear(x [M, K], w_panels [P, K, 16], bias?, n) -> [M, n]
//     y[m, j] = sum_k x[m, k] * w[j, k] (+ bias[j]), accumulated in fp32 one k at a time in
//     increasing k (one fused multiply-add per step), whatever M and whatever row m sits in;
//     the weight is stored in panels of 16 output columns (panel p, step k holds w[16p .. 16p+15, k])
//     so one vector load feeds 16 columns. Rows are processed MR at a time (the same FMA chain per
//     row, MR only sets how many chains share a weight load); threads split the panels, never K.
//     x and w: bf16 or fp32 (w bf16 is widened exactly); the output has x's dtype (fp32 results
//     rounded to nearest even for bf16).
//
// dflash_cpu::bi_attention(q [S, H, T, D], k [S, Hkv, L, D], v, mask [S|1, 1, T, L], scale)
//     -> [S, H, T, D] fp32: each (sequence, head, query) alone: scores over its visible keys in
//     key order (a dot product with a fixed lane order and a fixed horizontal sum), the max,
//     exp, their sum and the weighted sum of values in key order. Masked keys take no part at all,
//     so a query sees the same arithmetic over the same keys in a 1-query decode step and in a
//     B-query verify block, whatever the key width the batch was padded to.
//
// Vectors are GCC vector extensions as wide as the machine's registers (16 fp32 lanes with
// AVX-512, 8 with AVX2; a panel row is one or two of them);
// `a + b * c` on them compiles to one FMA where the target has it (-ffp-contract=fast, GCC's
// default), in every instantiation alike. Built once per machine by dflash_trt/kernels/cpu_ops.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int NR = 16;  // output columns per weight panel
constexpr int MR = 6;   // rows sharing one weight load
#ifdef __AVX512F__
constexpr int VL = 16;  // fp32 lanes of one vector register
#else
constexpr int VL = 8;
#endif
constexpr int NV = NR / VL;  // vectors per panel row

typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vf loadv(const c10::BFloat16* p) {  // bf16 -> fp32 is exact: the bits move up 16 places
  vh h;
  std::memcpy(&h, p, sizeof(h));
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
inline void store(T* out, float y) {
  *out = static_cast<T>(y);  // c10::BFloat16(float) rounds to nearest even
}

// rows [0, R) of x (fp32, row stride ldx) times one weight panel [K, 16] -> out [R][16] fp32
template <int R, typename W>
inline void panel_rows(const float* x, int64_t ldx, const W* panel, int64_t K, float* out) {
  vf acc[R][NV] = {};
  for (int64_t k = 0; k < K; ++k) {
    vf w[NV];
    for (int i = 0; i < NV; ++i) w[i] = loadv(panel + k * NR + i * VL);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      for (int i = 0; i < NV; ++i) acc[r][i] = acc[r][i] + xv * w[i];
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(out + r * NR, acc[r], sizeof(acc[r]));
}

template <typename W>
inline void panel_tail(int rows, const float* x, int64_t ldx, const W* panel, int64_t K, float* out) {
  switch (rows) {  // the same per-row FMA chain as panel_rows<MR>: only the sharing differs
    case 1: return panel_rows<1>(x, ldx, panel, K, out);
    case 2: return panel_rows<2>(x, ldx, panel, K, out);
    case 3: return panel_rows<3>(x, ldx, panel, K, out);
    case 4: return panel_rows<4>(x, ldx, panel, K, out);
    case 5: return panel_rows<5>(x, ldx, panel, K, out);
    default: return panel_rows<MR>(x, ldx, panel, K, out);
  }
}

template <typename W, typename O>
void linear_impl(const float* x, int64_t M, int64_t K, const W* w, int64_t P, const float* bias, int64_t N, O* out) {
  // threads take whole panels; every thread walks all rows of its panels, MR at a time
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, M * K));  // >= ~256K MACs a task
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    float acc[MR * NR];
    for (int64_t p = p0; p < p1; ++p) {
      const W* panel = w + p * K * NR;
      const int64_t c0 = p * NR;
      const int cols = static_cast<int>(std::min<int64_t>(NR, N - c0));
      for (int64_t m = 0; m < M; m += MR) {
        const int rows = static_cast<int>(std::min<int64_t>(MR, M - m));
        panel_tail(rows, x + m * K, K, panel, K, acc);
        for (int r = 0; r < rows; ++r) {
          const float* lanes = acc + r * NR;
          O* o = out + (m + r) * N + c0;
          for (int j = 0; j < cols; ++j) store(o + j, bias ? lanes[j] + bias[c0 + j] : lanes[j]);
        }
      }
    }
  });
}

at::Tensor bi_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == NR, "bi_linear: x [M, K] and w [P, K, 16] expected");
  TORCH_CHECK(x.size(1) == w.size(1), "bi_linear: x has ", x.size(1), " inputs, the weight ", w.size(1));
  TORCH_CHECK(n > 0 && n <= w.size(0) * NR, "bi_linear: ", n, " outputs do not fit ", w.size(0), " panels");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "bi_linear: x must be fp32 or bf16");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "bi_linear: w must be fp32 or bf16");
  TORCH_CHECK(w.is_contiguous(), "bi_linear: the weight panels must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), P = w.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // exact for bf16
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bi_linear: bias has ", bias->numel(), " values for ", n, " outputs");
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* b = bf.defined() ? bf.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0) return out;
  const float* xp = xf.data_ptr<float>();
  const bool wb = w.scalar_type() == at::kBFloat16, ob = x.scalar_type() == at::kBFloat16;
  if (wb && ob) {
    linear_impl(xp, M, K, w.data_ptr<c10::BFloat16>(), P, b, n, out.data_ptr<c10::BFloat16>());
  } else if (wb) {
    linear_impl(xp, M, K, w.data_ptr<c10::BFloat16>(), P, b, n, out.data_ptr<float>());
  } else if (ob) {
    linear_impl(xp, M, K, w.data_ptr<float>(), P, b, n, out.data_ptr<c10::BFloat16>());
  } else {
    linear_impl(xp, M, K, w.data_ptr<float>(), P, b, n, out.data_ptr<float>());
  }
  return out;
}

// q . k over D, fixed order: VL-lane FMA chunks in order, lanes summed 0..VL-1, then a scalar tail
template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  int64_t d = 0;
  float s = 0.f;
  if (D >= VL) {
    vf acc = vf{};
    for (; d + VL <= D; d += VL) acc = acc + loadv(q + d) * loadv(k + d);
    float lanes[VL];
    std::memcpy(lanes, &acc, sizeof(lanes));
    for (int i = 0; i < VL; ++i) s += lanes[i];
  }
  for (; d < D; ++d) s = std::fma(q[d], to_float(k[d]), s);
  return s;
}

// out[D] += p * v[D], per element one FMA
template <typename T>
inline void axpy(float p, const T* v, float* out, int64_t D) {
  int64_t d = 0;
  for (; d + VL <= D; d += VL) {
    vf o = loadv(out + d) + p * loadv(v + d);
    std::memcpy(out + d, &o, sizeof(o));
  }
  for (; d < D; ++d) out[d] = std::fma(p, to_float(v[d]), out[d]);
}

template <typename T>
void attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                    double scale, at::Tensor& out) {
  const int64_t S = q.size(0), H = q.size(1), T_ = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), L = k.size(2), group = H / Hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const auto qs = q.strides(), ks = k.strides(), vs = v.strides(), ms = mask.strides();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, S * H * T_, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> score(L), qf(D), acc(D);
    std::vector<int64_t> seen(L);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / (H * T_), h = (i / T_) % H, t = i % T_, hk = h / group;
      const T* qrow = qp + s * qs[0] + h * qs[1] + t * qs[2];
      for (int64_t d = 0; d < D; ++d) qf[d] = to_float(qrow[d]);
      const bool* mrow = mp + s * ms[0] + t * ms[2];
      const T* kb = kp + s * ks[0] + hk * ks[1];
      const T* vb = vp + s * vs[0] + hk * vs[1];
      int64_t n = 0;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t l = 0; l < L; ++l) {
        if (!mrow[l * ms[3]]) continue;
        const float sl = dot(qf.data(), kb + l * ks[2], D) * sc;
        score[n] = sl;
        seen[n++] = l;
        mx = std::max(mx, sl);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        const float e = std::exp(score[j] - mx);
        sum += e;
        axpy(e, vb + seen[j] * vs[2], acc.data(), D);
      }
      float* o = op + ((s * H + h) * T_ + t) * D;
      const float inv = n ? 1.f / sum : 0.f;
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
    }
  });
}

at::Tensor bi_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                        double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4, "bi_attention: 4-d tensors expected");
  TORCH_CHECK(k.sizes() == v.sizes(), "bi_attention: k and v shapes differ");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), "bi_attention: q [S, H, T, D] vs k [S, Hkv, L, D]");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "bi_attention: ", q.size(1), " query heads over ", k.size(1), " KV heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "bi_attention: mixed dtypes");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "bi_attention: mask must be bool");
  const at::Tensor m = mask.expand({q.size(0), 1, q.size(2), k.size(2)});
  auto last = [](const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); };
  const at::Tensor qc = last(q), kc = last(k), vc = last(v);
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), q.size(3)}, q.options().dtype(at::kFloat));
  if (q.scalar_type() == at::kBFloat16) {
    attention_impl<c10::BFloat16>(qc, kc, vc, m, scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "bi_attention: fp32 or bf16 expected");
    attention_impl<float>(qc, kc, vc, m, scale, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(dflash_cpu, m) {
  m.def("bi_linear(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
  m.def("bi_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash_cpu, CPU, m) {
  m.impl("bi_linear", &bi_linear);
  m.impl("bi_attention", &bi_attention);
}
