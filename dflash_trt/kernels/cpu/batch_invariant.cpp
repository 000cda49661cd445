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
// dflash_cpu::bi_linear(x [M, K], w [N, K], bias?) -> [M, N]
// dflash_cpu::bi_pack(w [N, K]) -> wp [ceil(N / VL), K, VL]
// dflash_cpu::bi_linear_packed(x [M, K], wp, N, bias?) -> [M, N]
//     y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), accumulated in fp32 in a fixed order per
//     output: one FMA per k in increasing k, starting from 0 (then + bias), whatever M and
//     whatever row m sits in. The weight (fp32 or bf16, widened exactly) is read packed: panels
//     of VL output columns, k-major inside a panel (bi_pack; bi_linear packs the [N, K] weight
//     on every call, a module packs once; bf16 weights on a CPU with AVX512-BF16 with rows k and
//     k + 1, k even, interleaved column by column), so that a register tile of up to 8 rows x C
//     panels takes one broadcast input and C weight vectors per k (the GEMM micro-kernel of BLIS and
//     oneDNN, without their split of K). The tile's size only sets how many outputs share each
//     load; threads split the output columns, never K. The output has x's dtype (fp32 results
//     rounded to nearest even for bf16). bf16 x with bf16 weights on a CPU with AVX512-BF16:
//     vdpbf16ps over the pairs of inputs (0, 1), (2, 3), ... instead (tile_bf16; a fixed order
//     per output too, twice the inputs an instruction); on a CPU with AMX and K a multiple of 32,
//     tdpbf16ps on tiles of up to 16 rows (tile_amx; 32 inputs an instruction, in order; two row tiles
//     share each weight tile past 16 rows: tile_amx_pair).
// dflash_cpu::bf16_gemm() -> str: which of those a process uses ("amx", "avx512-bf16", "fma").
//
// dflash_cpu::int4_linear(x [M, K], codes [S, K / 8, 8, 32] uint8, scales [S, K / g, 2, 8, 8], N, g, bias?)
//     -> [M, N]: int4 group-wise asymmetric weights (w = q * scale + zero) against activations
//     quantized per row to int8 in blocks of 32 (GGUF Q8_1's rule), integer dot products per
//     block (vpmaddubsw, or VNNI vpdpbusd, or from 8 rows on AMX tdpbsud: the same integers),
//     then fp32: llama.cpp's Q4_1 x Q8_1 arithmetic, in a fixed order per row.
// dflash_cpu::int8_linear(x [M, K], codes [S, K / 4, 8, 32] uint8, scales [S, 8, 8], N, bias?)
//     -> [M, N]: int8 per output row (w = q * scale) against the activations rounded as
//     int4_linear rounds them, integer dot products per block (VNNI vpdpbusd, or vpmaddubsw, or
//     from 8 rows on AMX tdpbsud), then fp32: GGUF Q8_0 x Q8_0's arithmetic with a scale per
//     row. Both: output in x's dtype (layouts and order of the sums where the kernels are).
//
// dflash_cpu::bi_attention(q [S, H, T, D], k [S, Hkv, L, D], v, mask [S|1, 1, T, L], scale, sinks?)
//     -> [S, H, T, D] fp32: each (sequence, head, query) alone: scores over its visible keys in
//     key order (a dot product with a fixed lane order and a fixed horizontal sum; in bf16 on a
//     CPU with AMX, tdpbf16ps over 32-input chunks in order, amx_scores), the max,
//     exp, their sum and the weighted sum of values in key order. Masked keys take no part at all,
//     so a query sees the same arithmetic over the same keys in a 1-query decode step and in a
//     B-query verify block, whatever the key width the batch was padded to. Optional attention
//     sinks (gpt-oss; fp32 [H], one logit per query head): the head's sink joins the max after
//     the keys and its exp(sink - max) is added to the sum after the keys' exps; it has no value
//     vector (transformers' GptOssAttention: softmax over [scores, sink], the sink column dropped).
//     Without sinks the arithmetic is the same as before they existed.
//
// dflash_cpu::bi_paged_attention(q [S, H, T, D], k_pool [slots, Hkv, D], v_pool, slots [S, L]
//     int64, mask [S|1, 1, T, L], scale, sinks?) -> [S, H, T, D] fp32: bi_attention over key l of
//     sequence s read at pool slot slots[s, l] (the paged KV cache's read table), with no
//     gathered copy of the keys; masked entries (padding) are never read. Bit for bit
//     bi_attention(q, k_pool[slots], v_pool[slots], ...).
//
// dflash_cpu::rms_norm(x [M, D], w [D], eps) -> [M, D] in x's dtype (fp32 or bf16, w the same):
//     per row alone: ss = sum_d x[d]^2 in fp32 (VL-lane FMA chunks in order from zero, lanes
//     summed 0..VL-1, then a scalar tail), r = 1 / sqrt(ss / D + eps), y = round(x * r) to x's
//     dtype, out = round(w * y): HF Llama's RMSNorm (normalize in fp32, round to the input
//     dtype, scale by the weight) in one call instead of torch's seven-op composite (~20-60 us a
//     call on one thread against ~2-5 us here; a decode step of a 30-layer target runs 61).
//
// dflash_cpu::dense_layer(x [1, N, hidden], ...) -> [1, N, hidden]: one pre-norm decoder layer
//     of a dense target (models/target.py TargetLayer with batch-invariant linears, the norm
//     kernel and paged attention whose queries are uniform: S sequences of Tq queries each, in
//     order) as one call: the same kernels and the same ATen ops on the same views, in the same
//     order, as the Python layer (so the same bits), without its ~60 Python-level calls (a
//     batch-1 fp32 decode step of the 30-layer default target: 41-48 ms before, 28-31 ms after,
//     its GEMMs alone 23-25 ms). RoPE, the
//     residuals and SwiGLU stay ATen's elementwise kernels (at::mul / roll / add / silu); the
//     linears are the batch-invariant kernel, int4_linear or torch's packed int8 GEMM that the
//     targets' modules call (quantization/packed.py), op for op.
//
// Vectors are GCC vector extensions as wide as the machine's registers (16 fp32 lanes with
// AVX-512, 8 with AVX2); every multiply-add is an explicit FMA (fmav, std::fma). Built once per
// machine by dflash_trt/kernels/cpu_ops.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/roll.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <string>
// AMX tiles for bf16 x bf16 GEMMs (tile_amx) where the compiler targets them (-march=native on such a CPU)
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define DFLASH_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define DFLASH_AMX 0
#endif
// AMX int8 tiles for the packed integer GEMMs of 8 rows and more (int_amx)
#if DFLASH_AMX && defined(__AMX_INT8__)
#define DFLASH_AMX_INT8 1
#else
#define DFLASH_AMX_INT8 0
#endif
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#ifdef __AVX512F__
constexpr int VL = 16;  // fp32 lanes of one vector register: the packed weight's panel width
#else
constexpr int VL = 8;
#endif
constexpr int MR = 6;  // rows of one integer-GEMM register tile (int_panels; the float GEMM's: FR)

typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vf loadv(const c10::BFloat16* p) {  // bf16 -> fp32 is exact: the bits move up 16 places
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  vh h;
  std::memcpy(&h, p, sizeof(h));
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#endif
}

// *p in every lane: a broadcast from memory (a load, no arithmetic and no shuffle)
inline vf bcast(const float* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(*p);
#elif defined(__AVX2__)
  return (vf)_mm256_set1_ps(*p);
#else
  vf v;
  for (int i = 0; i < VL; ++i) v[i] = *p;
  return v;
#endif
}

inline vf bcast_value(float x) { return bcast(&x); }

// a * b + c rounded once, lane by lane: written out (intrinsics), not left to the compiler's
// contraction of `a * b + c`, which it may decide differently in different instantiations
inline vf fmav(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  vf r;
  for (int i = 0; i < VL; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

// floor, lane by lane
inline vf floorv(vf x) {
#if defined(__AVX512F__)
  return (vf)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#elif defined(__AVX__)
  return (vf)_mm256_floor_ps((__m256)x);
#else
  vf r;
  for (int i = 0; i < VL; ++i) r[i] = std::floor(x[i]);
  return r;
#endif
}

// e^x lane by lane (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-5 minimax
// polynomial, times 2^n through the exponent bits; within 2 ulp of e^x, 0 below -87.3): each lane's
// result depends on that lane's input alone, so a key's weight is the same bits whichever vector,
// or which tail (padded with zeros), it is computed in
inline vf expv(vf x) {
  typedef int32_t vi __attribute__((vector_size(VL * 4)));
  const vf lo = bcast_value(-87.3365478515625f), hi = bcast_value(88.3762588500977f);
  x = x < lo ? lo : x;  // (e^-87.34 is FLT_MIN's order: the result is then flushed to 0 below)
  x = x > hi ? hi : x;
  const vf n = floorv(fmav(x, bcast_value(1.44269504088896341f), bcast_value(0.5f)));
  vf r = fmav(n, bcast_value(-0.693359375f), x);
  r = fmav(n, bcast_value(2.12194440e-4f), r);
  vf y = bcast_value(1.9875691500e-4f);
  y = fmav(y, r, bcast_value(1.3981999507e-3f));
  y = fmav(y, r, bcast_value(8.3333337680e-3f));
  y = fmav(y, r, bcast_value(4.1665795894e-2f));
  y = fmav(y, r, bcast_value(1.6666665459e-1f));
  y = fmav(y, r, bcast_value(5.0000001201e-1f));
  y = fmav(y, r * r, r + bcast_value(1.f));
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;  // 2^n, n in -126 .. 128 after the clamps
  vf p;
  std::memcpy(&p, &e, sizeof(p));
  const vf out = y * p;
  return x <= lo ? bcast_value(0.f) : out;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
inline void store(T* out, float y) {
  *out = static_cast<T>(y);  // c10::BFloat16(float) rounds to nearest even
}

// lanes summed in order 0..VL-1
inline float hsum(const vf& v) {
  float lanes[VL];
  std::memcpy(lanes, &v, sizeof(lanes));
  float s = 0.f;
  for (int i = 0; i < VL; ++i) s += lanes[i];
  return s;
}

// Packed weight: [P, K, VL] (P = ceil(N / VL) panels of VL output columns, k-major inside a
// panel, the last panel's missing columns zero), so that one vector load gives VL columns of one k
// (bf16 with AVX512-BF16: rows k and k + 1 interleaved, one load gives both, see tile_bf16).
// One register tile: R input rows x C panels, y[r][c * VL + j] = fma chain over k = 0, 1, ..., K - 1
// of x[r, k] * w[k][j] starting from 0 (one FMA per k, in increasing k): the same operations
// for every output element whatever R, C and the other rows are.
template <int R, int C, typename W>
__attribute__((noinline)) void tile(const float* x, int64_t K, const W* wp, float* out, int64_t ldo) {
  vf acc[R][C] = {};
  const int64_t ps = K * VL;  // one panel
  // with 1-2 rows the weight streams from memory (a decode step): the next tile's C panels
  // (contiguous after these) are fetched at the rate these are read
  const char* next = reinterpret_cast<const char*>(wp + C * ps);
  constexpr int64_t step = static_cast<int64_t>(C) * VL * sizeof(W);
  int64_t k = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<W, c10::BFloat16>) {  // rows k and k + 1 interleaved (bi_pack): one load, then
    // row k is each dword's low half moved up 16 places and row k + 1 its high half: bf16 -> fp32 exactly
    const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    for (; k + 1 < K; k += 2) {
      if constexpr (R <= 2) {
        for (int64_t b = 0; b < 2 * step; b += 64) __builtin_prefetch(next + k * step + b, 0, 1);
      }
      for (int c = 0; c < C; ++c) {
        const __m512i pair = _mm512_loadu_si512(wp + c * ps + k * VL);
        const vf lo = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
        const vf hi = (vf)_mm512_castsi512_ps(_mm512_and_si512(pair, high));
        for (int r = 0; r < R; ++r) acc[r][c] = fmav(bcast(x + r * K + k), lo, acc[r][c]);
        for (int r = 0; r < R; ++r) acc[r][c] = fmav(bcast(x + r * K + k + 1), hi, acc[r][c]);
      }
    }
  }
#endif
  for (; k < K; ++k) {  // (an odd K's last row is not interleaved)
    if constexpr (R <= 2) {
      for (int64_t b = 0; b < step; b += 64) __builtin_prefetch(next + k * step + b, 0, 1);
    }
    vf wv[C];
    for (int c = 0; c < C; ++c) wv[c] = loadv(wp + c * ps + k * VL);
    for (int r = 0; r < R; ++r) {
      const vf xb = bcast(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = fmav(xb, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) std::memcpy(out + r * ldo + c * VL, &acc[r][c], sizeof(vf));
}

#if defined(__AVX512BF16__)
// bf16 activations x bf16 weights with AVX512-BF16: vdpbf16ps multiplies 16 lanes of bf16 pairs
// and adds both exact products into the lane's fp32 sum, one rounding each (denormals flushed),
// twice the inputs of an FMA a lane. bi_pack lays a panel's rows k and k + 1 (k even) out
// interleaved (word 2i: row k's column i, word 2i + 1: row k + 1's), so one 512-bit load is the
// pairs of 16 columns (no vpermt2w per panel and pair of rows to interleave them here); each
// row's (x[k], x[k + 1]) is one broadcast dword. One output: the pairs of inputs (0, 1), (2, 3),
// ... in order from 0 (an odd K's last input, its row not interleaved, paired with a zero),
// whatever the other rows.
constexpr bool BF16_DOT = true;

template <int R, int C>
__attribute__((noinline)) void tile_bf16(const c10::BFloat16* x, int64_t K, const c10::BFloat16* wp, float* out,
                                         int64_t ldo) {
  static_assert(VL == 16, "a zmm of bf16 pairs covers 16 columns");
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t ps = K * VL;  // one panel
  const char* next = reinterpret_cast<const char*>(wp + C * ps);  // as in tile
  constexpr int64_t step = static_cast<int64_t>(C) * VL * 2;
  const uint16_t* xu = reinterpret_cast<const uint16_t*>(x);
  const int64_t K2 = K & ~int64_t{1};  // the whole pairs; an odd K's last input pairs with a zero after them
  for (int64_t k = 0; k < K2; k += 2) {
    if constexpr (R <= 2) {
      for (int64_t b = 0; b < 2 * step; b += 64) __builtin_prefetch(next + k * step + b, 0, 1);
    }
    __m512bh wv[C];  // rows k and k + 1 of a panel, interleaved by bi_pack
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(wp + c * ps + k * VL);
    for (int r = 0; r < R; ++r) {
      // (x[k], x[k + 1]) as one dword: a broadcast straight from memory
      int32_t xp;
      std::memcpy(&xp, xu + r * K + k, sizeof(xp));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb, wv[c]);
    }
  }
  if (K2 < K) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c)  // the last row's words widened: (w[k][i], 0) per column
      wv[c] = (__m512bh)_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + c * ps + K2 * VL)));
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(xu[r * K + K2]));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + r * ldo + c * VL, acc[r][c]);
}
#else
constexpr bool BF16_DOT = false;
#endif

// R rows x `panels` panels of `width` outputs, C panels at a time (the remainder one at a time):
// tile(R, C, p, out + p * width) for p = 0, C, 2C, ... (R and C as std::integral_constant). The
// register tiles it calls are kept out of line (noinline): inlined into these generic lambdas,
// the float GEMM's 4-row tile ran at half its speed.
// With Halve (the float GEMM's tiles, generic in C) the panels left after the C-panel tiles go
// through tiles of C / 2, C / 4, ... panels instead of one at a time: a group of 2 panels swept
// by a 1-row tile of 8 takes one 2-panel tile (two FMA chains) rather than two 1-panel ones.
template <int R, int C, bool Halve = false, typename Tile>
inline void tile_panels(int panels, int64_t width, float* out, const Tile& tile, int p = 0) {
  using RC = std::integral_constant<int, R>;
  for (; p + C <= panels; p += C) tile(RC{}, std::integral_constant<int, C>{}, p, out + p * width);
  if constexpr (Halve && C > 1) {
    tile_panels<R, C / 2, true>(panels, width, out, tile, p);
  } else {
    for (; p < panels; ++p) tile(RC{}, std::integral_constant<int, 1>{}, p, out + p * width);
  }
}

// rows (1 .. sizeof...(Cs)) x panels through register tiles of Cs... panels for 1, 2, ... rows
// (every kernel's tiles: the float GEMM's, int8's and int4's); rows past the last take its tile
template <bool Halve, int R, int C, int... Cs, typename Tile>
inline void tile_rows_from(int rows, int panels, int64_t width, float* out, const Tile& tile) {
  if constexpr (sizeof...(Cs) == 0) {
    tile_panels<R, C, Halve>(panels, width, out, tile);
  } else {
    if (rows == R) return tile_panels<R, C, Halve>(panels, width, out, tile);
    tile_rows_from<Halve, R + 1, Cs...>(rows, panels, width, out, tile);
  }
}

template <int... Cs, typename Tile>
inline void tile_rows(int rows, int panels, int64_t width, float* out, const Tile& tile) {
  tile_rows_from<false, 1, Cs...>(rows, panels, width, out, tile);
}

// the float / bf16 GEMM's tiles: up to FR rows (8: one sweep of the weight for an 8-row verify
// block; 6 then 2 read it twice), panels taken at a time by a tile of 1 .. FR rows: as many as
// the registers hold next to the rows x C accumulators, the C weight vectors and the broadcast
constexpr int FR = 8;
#ifdef __AVX512F__
#define FLOAT_PANELS 8, 8, 6, 4, 4, 4, 3, 3  // 32 registers
#else
#define FLOAT_PANELS 6, 4, 3, 2, 2, 2, 1, 1  // 16 registers
#endif
constexpr int PANELS[FR] = {FLOAT_PANELS};

// Panels per group when P panels are split over the threads in whole groups: a multiple of
// `unit` (the register tile's width for the rows that dominate, so that no group ends in
// one-panel tiles), at most max(cap, unit), and the most even split over the threads those
// allow (at::parallel_for gives each thread a contiguous run of ceil(groups / threads) groups;
// ties go to larger groups). With 2 threads, 36 panels in groups of 12 left one thread idle a
// third of the projection; in groups of 6 with 4-panel tiles, each group ended in 2 one-panel tiles.
inline int64_t balanced_panels(int64_t P, int64_t unit, int64_t cap) {
  const int64_t T = std::max(1, at::get_num_threads());
  const int64_t units = (P + unit - 1) / unit, most = std::max<int64_t>(1, cap / unit);
  int64_t best = 1, best_load = std::numeric_limits<int64_t>::max();
  for (int64_t per = 1; per <= most; ++per) {
    const int64_t groups = (units + per - 1) / per, threads = std::min(T, groups);
    const int64_t load = std::min((groups + threads - 1) / threads * per, units);  // the busiest thread's units
    if (load <= best_load) best = per, best_load = load;
  }
  return best * unit;
}

// The GEMMs' threading and output stores: threads take whole groups of `pb` panels of `width`
// output columns (never a split of K), `grain` groups a task at least; each group is swept by
// sweep(m, rows, p0, np, t, ldt) for rows m .. m + rows - 1, up to `most` at a time, which writes
// those rows' outputs of panels p0 .. p0 + np - 1 into t (ldt apart per row); stored here with the
// bias. done() ends each task.
template <typename O, typename Sweep, typename Done>
void sweep_groups(int64_t M, int64_t N, int64_t width, int64_t pb, int64_t grain, int most, const float* bias, O* out,
                  const Sweep& sweep, const Done& done) {
  const int64_t P = (N + width - 1) / width;
  const int64_t groups = (P + pb - 1) / pb;
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    const int64_t ldt = pb * width;
    std::vector<float> t(most * ldt);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * pb, np = std::min<int64_t>(pb, P - p0);
      const int64_t n0 = p0 * width, nc = std::min<int64_t>(np * width, N - n0);
      for (int64_t m = 0; m < M; m += most) {
        const int rows = static_cast<int>(std::min<int64_t>(most, M - m));
        sweep(m, rows, p0, np, t.data(), ldt);
        for (int r = 0; r < rows; ++r) {
          O* o = out + (m + r) * N + n0;
          const float* tr = t.data() + r * ldt;
          for (int64_t c = 0; c < nc; ++c) store(o + c, bias ? tr[c] + bias[n0 + c] : tr[c]);
        }
      }
    }
    done();
  });
}

// The float / bf16 GEMMs' groups (sweep_groups): a multiple of `unit` panels of VL columns, ~256
// KiB of weights of `wsize` bytes each (in L2), and >= ~64K MACs a task.
template <typename O, typename Sweep, typename Done>
void panel_groups(int64_t M, int64_t K, int64_t N, int64_t wsize, int64_t unit, int most, const float* bias, O* out,
                  const Sweep& sweep, const Done& done) {
  const int64_t P = (N + VL - 1) / VL;
  const int64_t fit = (int64_t{256} << 10) / std::max<int64_t>(1, K * VL * wsize);
  const int64_t pb = balanced_panels(P, unit, std::min<int64_t>(fit, 48));
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, M * K * VL * pb));
  sweep_groups(M, N, VL, pb, grain, most, bias, out, sweep, done);
}

#if DFLASH_AMX
// bf16 activations x bf16 weights with AMX (Sapphire Rapids and later): tdpbf16ps multiplies a
// tile of up to 16 rows x 32 inputs by 32 inputs x 16 columns of bf16 pairs into 16 x 16 fp32
// sums. bi_pack's interleaved panel is already AMX's B layout: 16 pair rows of a panel (inputs
// k .. k + 31, k a multiple of 32) are 1 KiB, 64 bytes a pair row, contiguous. One output: its
// pairs of inputs (0, 1), (2, 3), ... accumulated in order from 0 into its fp32 sum, 32 inputs
// an instruction, whatever the other rows of the tile and their number (the tile's rows are
// computed independently). Used for every bf16 x bf16 call of a process whose K is a multiple
// of 32 (a 1-row decode step and a 16-row verify block alike), so rows stay batch-invariant;
// other K take tile_bf16.
constexpr int AR = 16;  // rows of an AMX tile

// Linux hands out AMX's tile data state only on request (arch_prctl ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA); without it the first tile instruction faults. Asked once per process.
inline bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0..3: accumulators (R rows x 16 fp32); 4: activations (R rows x 32 bf16); 5, 6: weights
// (16 pair rows x 16 columns). Loaded per task and row count and released after the task: other
// AMX code in the process (oneDNN's bf16 GEMMs) releases the tiles after its kernels, so a
// configuration kept from an earlier call would be gone (a tile instruction then faults).
inline void amx_config(int R) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) cfg.rows[t] = static_cast<uint8_t>(R), cfg.colsb[t] = 64;
  for (int t = 5; t < 7; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// the 32 inputs from k on of C panels (ps elements apart) from `next` on, into L2: the weight tiles
// that tile_amx / tile_amx_pair load after these
template <int C>
inline void prefetch_panels(const c10::BFloat16* next, int64_t ps, int64_t k) {
  for (int c = 0; c < C; ++c)
    for (int l = 0; l < 16; ++l) _mm_prefetch(reinterpret_cast<const char*>(next + c * ps + k * VL + l * 32), _MM_HINT_T1);
}

// R (1 .. 16, configured by amx_config) rows x C (1 .. 4) panels, K a multiple of 32;
// out[r * ldo + c * 16 + j]
template <int C>
__attribute__((noinline)) void tile_amx(const c10::BFloat16* x, int64_t K, const c10::BFloat16* wp, float* out,
                                        int64_t ldo) {
  static_assert(C >= 1 && C <= 4, "four accumulator tiles");
  const int64_t ps = K * VL;  // one panel
  _tile_zero(0);
  if constexpr (C > 1) _tile_zero(1);
  if constexpr (C > 2) _tile_zero(2);
  if constexpr (C > 3) _tile_zero(3);
  const c10::BFloat16* next = wp + C * ps;  // the panels after these (as in tile_bf16)
  for (int64_t k = 0; k < K; k += 32) {
    // the next panels' same 32 inputs, into L2 (without it a 1-row step ran at ~0.8x tile_bf16's speed)
    prefetch_panels<C>(next, ps, k);
    _tile_loadd(4, x + k, K * 2);
    _tile_loadd(5, wp + k * VL, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (C > 1) {
      _tile_loadd(6, wp + ps + k * VL, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (C > 2) {
      _tile_loadd(5, wp + 2 * ps + k * VL, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (C > 3) {
      _tile_loadd(6, wp + 3 * ps + k * VL, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, out, ldo * 4);
  if constexpr (C > 1) _tile_stored(1, out + VL, ldo * 4);
  if constexpr (C > 2) _tile_stored(2, out + 2 * VL, ldo * 4);
  if constexpr (C > 3) _tile_stored(3, out + 3 * VL, ldo * 4);
}

// tiles 0, 1: accumulators of rows 0..15 x panels 0, 1; 2, 3: of rows 16.. (R - 16 of them); 4, 5:
// those rows' activations; 6, 7: the two panels' weights (amx_pair_config, R 17 .. 32)
inline void amx_pair_config(int R) {
  TileConfig cfg;
  for (int t : {0, 1, 4}) cfg.rows[t] = AR, cfg.colsb[t] = 64;
  for (int t : {2, 3, 5}) cfg.rows[t] = static_cast<uint8_t>(R - AR), cfg.colsb[t] = 64;
  for (int t : {6, 7}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// tile_amx for 17 .. 32 rows (amx_pair_config) x C (1, 2) panels: two row tiles share each weight
// tile, which is loaded once for both (tile_amx over 16 rows at a time loads every weight tile of a
// group once per 16 rows: a 32-row GEMM read its weights from L2 twice). Every output is the same
// tdpbf16ps chain over its 32-input chunks in order from zero as in tile_amx: the same bits.
template <int C>
__attribute__((noinline)) void tile_amx_pair(const c10::BFloat16* x, int64_t K, const c10::BFloat16* wp, float* out,
                                             int64_t ldo) {
  static_assert(C == 1 || C == 2, "two weight tiles");
  const int64_t ps = K * VL;
  const c10::BFloat16* x1 = x + AR * K;  // rows 16..
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (C > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  const c10::BFloat16* next = wp + C * ps;
  for (int64_t k = 0; k < K; k += 32) {
    prefetch_panels<C>(next, ps, k);
    _tile_loadd(4, x + k, K * 2);
    _tile_loadd(5, x1 + k, K * 2);
    _tile_loadd(6, wp + k * VL, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (C > 1) {
      _tile_loadd(7, wp + ps + k * VL, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, ldo * 4);
  _tile_stored(2, out + AR * ldo, ldo * 4);
  if constexpr (C > 1) {
    _tile_stored(1, out + VL, ldo * 4);
    _tile_stored(3, out + AR * ldo + VL, ldo * 4);
  }
}

// the whole bf16 x bf16 GEMM on AMX (see tile_amx): each group of panels swept by 32 rows at a
// time, two row tiles over 2 panels at a time (tile_amx_pair), or 16 rows and fewer by one row
// tile over 4 panels at a time (tile_amx). (bf16, 2-core AMX Xeon, the 210 GEMMs of the default
// target's 30 layers, best of 5, old and new kernels in alternating processes: 32 rows 1.28-1.33x
// the 16 rows' time with tile_amx alone, 1.08-1.13x with pairs; 64 rows 18.2-18.6 ms -> 14.4-16.0;
// the target's forward at 32 decode rows of the load bench, medians of 25: 30.4-32.5 ms -> 29.1-32.0.)
template <typename O>
void linear_amx(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* wp, const float* bias, int64_t N,
                O* out) {
  panel_groups(
      M, K, N, 2, 4, 2 * AR, bias, out,
      [&](int64_t m, int rows, int64_t p0, int64_t np, float* t, int64_t ldt) {
        const c10::BFloat16* xm = x + m * K;
        const c10::BFloat16* wg = wp + p0 * K * VL;
        int64_t p = 0;
        if (rows > AR) {
          amx_pair_config(rows);
          for (; p + 2 <= np; p += 2) tile_amx_pair<2>(xm, K, wg + p * K * VL, t + p * VL, ldt);
          if (p < np) tile_amx_pair<1>(xm, K, wg + p * K * VL, t + p * VL, ldt);
          return;
        }
        amx_config(rows);
        for (; p + 4 <= np; p += 4) tile_amx<4>(xm, K, wg + p * K * VL, t + p * VL, ldt);
        if (np - p == 3) tile_amx<3>(xm, K, wg + p * K * VL, t + p * VL, ldt);
        if (np - p == 2) tile_amx<2>(xm, K, wg + p * K * VL, t + p * VL, ldt);
        if (np - p == 1) tile_amx<1>(xm, K, wg + p * K * VL, t + p * VL, ldt);
      },
      [] { _tile_release(); });
}
#endif

// x [M, K] fp32 (any weight: the FMA tile) or bf16 (bf16 weights with BF16_DOT: tile_bf16); each
// group of panels is swept by every register tile of rows in turn (panel_groups)
template <typename X, typename W, typename O>
void linear_impl(const X* x, int64_t M, int64_t K, const W* wp, const float* bias, int64_t N, O* out) {
  // 1 or 2 rows stream the weight from memory (a decode step): the threads' shares of it, not the
  // register tile's reuse (none to speak of), set the time, so groups come in units of 2 panels
  // (split evenly: the 36 panels of a 576-output projection went 24 / 12 in units of 8), each
  // swept by tiles of 8, 4 and 2 panels
  const int64_t unit = M <= 2 ? 2 : PANELS[std::min<int64_t>(M, FR) - 1];
  panel_groups(
      M, K, N, sizeof(W), unit, FR, bias, out,
      [&](int64_t m, int rows, int64_t p0, int64_t np, float* t, int64_t ldt) {
        const W* wg = wp + p0 * K * VL;
        tile_rows_from<true, 1, FLOAT_PANELS>(rows, static_cast<int>(np), VL, t, [&](auto r, auto c, int p, float* o) {
          const W* w = wg + p * K * VL;
          if constexpr (std::is_same_v<X, float>) {
            tile<decltype(r)::value, decltype(c)::value>(x + m * K, K, w, o, ldt);
          } else {
#if defined(__AVX512BF16__)
            tile_bf16<decltype(r)::value, decltype(c)::value>(x + m * K, K, w, o, ldt);
#else
            static_assert(std::is_same_v<X, float>, "bf16 activations need AVX512-BF16");
#endif
          }
        });
      },
      [] {});
}

// [N, K] -> [ceil(N / VL), K, VL] in the weight's dtype, missing columns zero
at::Tensor bi_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "bi_pack: w [N, K] expected");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "bi_pack: w must be fp32 or bf16");
  const int64_t N = w.size(0), K = w.size(1), P = (N + VL - 1) / VL;
  at::Tensor padded = at::constant_pad_nd(w, {0, 0, 0, P * VL - N}, 0);
  at::Tensor packed = padded.view({P, VL, K}).transpose(1, 2).contiguous();
#if defined(__AVX512BF16__)
  if (w.scalar_type() == at::kBFloat16 && K >= 2) {  // rows k, k + 1 (k even) interleaved column by column
    const int64_t K2 = K & ~int64_t{1};
    at::Tensor pairs = packed.narrow(1, 0, K2).reshape({P, K2 / 2, 2, VL}).transpose(2, 3).contiguous();
    packed = K2 == K ? pairs.view({P, K, VL}) : at::cat({pairs.view({P, K2, VL}), packed.narrow(1, K2, 1)}, 1);
  }
#endif
  return packed;
}

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& wp, int64_t N, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 3 && wp.size(2) == VL, "bi_linear: x [M, K] and a packed weight [P, K, ", VL, "] expected");
  TORCH_CHECK(x.size(1) == wp.size(1), "bi_linear: x has ", x.size(1), " inputs, the weight ", wp.size(1));
  TORCH_CHECK(N > (wp.size(0) - 1) * VL && N <= wp.size(0) * VL, "bi_linear: ", N, " outputs do not fit ", wp.size(0), " panels");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "bi_linear: x must be fp32 or bf16");
  TORCH_CHECK(wp.scalar_type() == at::kFloat || wp.scalar_type() == at::kBFloat16, "bi_linear: w must be fp32 or bf16");
  TORCH_CHECK(wp.is_contiguous(), "bi_linear: the packed weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  const bool wb = wp.scalar_type() == at::kBFloat16, ob = x.scalar_type() == at::kBFloat16;
  const bool bf16_dot = BF16_DOT && wb && ob;
  const at::Tensor xf = bf16_dot ? x.contiguous() : x.to(at::kFloat).contiguous();  // exact for bf16
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bi_linear: bias has ", bias->numel(), " values for ", N, " outputs");
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* b = bf.defined() ? bf.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if constexpr (BF16_DOT) {
    if (bf16_dot) {
#if DFLASH_AMX
      if (K % 32 == 0 && amx_ready()) {
        linear_amx(xf.data_ptr<c10::BFloat16>(), M, K, wp.data_ptr<c10::BFloat16>(), b, N,
                   out.data_ptr<c10::BFloat16>());
        return out;
      }
#endif
      linear_impl(xf.data_ptr<c10::BFloat16>(), M, K, wp.data_ptr<c10::BFloat16>(), b, N,
                  out.data_ptr<c10::BFloat16>());
      return out;
    }
  }
  const float* xp = xf.data_ptr<float>();
  if (wb && ob) {
    linear_impl(xp, M, K, wp.data_ptr<c10::BFloat16>(), b, N, out.data_ptr<c10::BFloat16>());
  } else if (wb) {
    linear_impl(xp, M, K, wp.data_ptr<c10::BFloat16>(), b, N, out.data_ptr<float>());
  } else if (ob) {
    linear_impl(xp, M, K, wp.data_ptr<float>(), b, N, out.data_ptr<c10::BFloat16>());
  } else {
    linear_impl(xp, M, K, wp.data_ptr<float>(), b, N, out.data_ptr<float>());
  }
  return out;
}

// which kernel multiplies bf16 activations by bf16 weights in this process: "amx" (K a multiple
// of 32; tile_bf16 for other K), "avx512-bf16" (tile_bf16) or "fma" (widened to fp32, tile)
std::string bf16_gemm() {
#if DFLASH_AMX
  if (amx_ready()) return "amx";
#endif
  return BF16_DOT ? "avx512-bf16" : "fma";
}

at::Tensor bi_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "bi_linear: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.size(1) == w.size(1), "bi_linear: x has ", x.size(1), " inputs, the weight ", w.size(1));
  return linear_packed(x, bi_pack(w), w.size(0), bias);
}

// ---- packed integer weights: int8 (per output row, symmetric, w = q * scale) and int4
// (group-wise asymmetric, w = q * scale + zero), both against activations rounded to int8 per
// row in blocks of 32 (GGUF Q8's rule) and multiplied in integers; S = ceil(N / 64) blocks of 8
// panels of 8 output columns, scales per block as [S, 8, 8] (int4: per group, with zeros). ----
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
constexpr int IL = 8;  // columns of a panel
constexpr int IB = 8;  // panels of a block

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline v8f load8(const c10::BFloat16* p) {
  uint16_t h[IL];
  std::memcpy(h, p, sizeof(h));
  v8u u;
  for (int i = 0; i < IL; ++i) u[i] = static_cast<uint32_t>(h[i]) << 16;
  v8f v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

inline v8f bcast8(const float* p) {
#if defined(__AVX__)
  return (v8f)_mm256_broadcast_ss(p);
#else
  v8f v;
  for (int i = 0; i < IL; ++i) v[i] = *p;
  return v;
#endif
}

inline v8f fma8(v8f a, v8f b, v8f c) {
#if defined(__FMA__)
  return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  v8f r;
  for (int i = 0; i < IL; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

// the packed integer GEMMs' groups (sweep_groups): blocks of 8 panels where there are enough for
// ~4 groups a thread, else fewer; register tiles of C1 .. C6 panels for 1 .. 6 rows (tile_rows),
// tile(R, C, m, p, t, ldt) writing rows m .. m + R - 1 of panels p .. p + C - 1 into t (ldt apart per row)
template <int C1, int C2, int C3, int C4, int C5, int C6, typename O, typename Tile>
void int_panels(int64_t M, int64_t N, const float* bias, O* out, const Tile& tile) {
  const int64_t P = (N + IL - 1) / IL;  // panels with outputs (the last block's may be fewer)
  const int64_t share = (P + 4 * at::get_num_threads() - 1) / (4 * at::get_num_threads());
  const int64_t pb = share >= IB ? std::min<int64_t>(share / IB * IB, 64) : std::max<int64_t>(1, share);
  sweep_groups(
      M, N, IL, pb, 1, MR, bias, out,
      [&](int64_t m, int rows, int64_t p0, int64_t np, float* t, int64_t ldt) {
        tile_rows<C1, C2, C3, C4, C5, C6>(rows, static_cast<int>(np), IL, t,
                                          [&](auto r, auto c, int p, float* o) { tile(r, c, m, p0 + p, o, ldt); });
      },
      [] {});
}

// ---- int4 weights against int8 activations (GGUF Q4_1 x Q8_1's arithmetic, llama.cpp's
// ggml_vec_dot_q4_1_q8_1) ----
// Codes [S, K / 8, 8, 32] bytes (S = ceil(N / 64) blocks of 8 panels of 8 output columns): the
// 32 bytes (s, kc, c) hold column 64s + 8c + j's codes at inputs 8kc .. 8kc + 7, byte 4j + i
// inputs 8kc + i (low nibble) and 8kc + 4 + i (high nibble), so that one 256-bit load is, after a
// mask and a shift, two vectors of 32 unsigned bytes, 4 consecutive inputs of each of the 8
// columns, that one vpmaddubsw each multiplies by 4 activation bytes broadcast. Scales as int8's
// layout with zeros: [S, G, 2, 8, 8].
// Each row's activations are quantized once per call, per QB = 32 inputs (Q8_1's block): d =
// amax / 127, q = nearbyint(x * (1 / d)) (0 where amax is 0). One output: y = sum over groups in
// order of (scale * a_g + zero * xs_g), each term one FMA into y, where a_g = FMA chain over the
// group's 32-input blocks in increasing order of d_b * dot_b from 0, dot_b = sum of q_w * q_x
// over the block (exact: integers, |dot| <= 15 * 127 * 32), and xs_g = the same chain of d_b *
// sum(q_x) (the quantized activations' sum, as Q8_1's s: the zero then multiplies the values the
// codes do, and the rounding errors of w = q * scale + zero, centred, partly cancel; the exact
// sum of x doubled the logits' error on the default target). Every value is a function of the
// row alone.
constexpr int QB = 32;

// a row's activations (fp32 or bf16) as Q8 blocks: q int8 [K], d [K / QB]
#if defined(__AVX2__)
inline __m256 q8_load(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 q8_load(const c10::BFloat16* p) {  // bf16 -> fp32 exactly: the bits shifted up
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// the same values as the scalar loop below: max |x| is exact in any order, x * (1 / d) the same
// fp32 product, and vcvtps2dq rounds to nearest even as nearbyint does (the default mode)
template <typename T>
inline void quantize_q8(const T* x, int64_t K, int8_t* q, float* d) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / QB; ++b) {
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = q8_load(x + b * QB + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    float amax = 0.f;
    for (int i = 0; i < 8; ++i) amax = std::max(amax, lanes[i]);
    const float db = amax / 127.f, id = db > 0.f ? 1.f / db : 0.f;
    d[b] = db;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i r[4];
    for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
    // packs work within 128-bit lanes: the permute puts the 32 bytes back in order
    const __m256i p16a = _mm256_packs_epi32(r[0], r[1]), p16b = _mm256_packs_epi32(r[2], r[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QB), p8);
  }
}
#else
template <typename T>
inline void quantize_q8(const T* x, int64_t K, int8_t* q, float* d) {
  for (int64_t b = 0; b < K / QB; ++b) {
    float v[QB], amax = 0.f;
    for (int i = 0; i < QB; ++i) {
      v[i] = static_cast<float>(x[b * QB + i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float db = amax / 127.f, id = db > 0.f ? 1.f / db : 0.f;
    d[b] = db;
    for (int i = 0; i < QB; ++i) q[b * QB + i] = static_cast<int8_t>(std::nearbyint(v[i] * id));
  }
}
#endif

#if defined(__AVX2__)
struct Q4Acc {  // VNNI: the 8 columns' int32 sums; AVX2: 16 int16 partial sums (pairs of lanes per
                // column; <= 8 * 3810 in magnitude)
  __m256i v = _mm256_setzero_si256();
};
struct Q4Codes {
  __m256i lo, hi;
};
inline Q4Codes q4_load(const uint8_t* p) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(w, m), _mm256_and_si256(_mm256_srli_epi16(w, 4), m)};
}
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
// VNNI (AVX512-VNNI / AVX-VNNI): vpdpbusd multiplies the 4 unsigned code bytes of each column by
// the 4 activation bytes and adds the sum to the column's int32 in one instruction: the same
// exact integer block sums as vpmaddubsw + vpmaddwd below, in half the instructions
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
inline void q4_dot(const Q4Codes& w, const int8_t* xq, Q4Acc& acc) {
  int32_t a, b;
  std::memcpy(&a, xq, 4);
  std::memcpy(&b, xq + 4, 4);
  acc.v = dpbusd(acc.v, w.lo, _mm256_set1_epi32(a));
  acc.v = dpbusd(acc.v, w.hi, _mm256_set1_epi32(b));
}
inline v8f q4_sum(const Q4Acc& acc) { return (v8f)_mm256_cvtepi32_ps(acc.v); }
#else
inline void q4_dot(const Q4Codes& w, const int8_t* xq, Q4Acc& acc) {
  int32_t a, b;
  std::memcpy(&a, xq, 4);
  std::memcpy(&b, xq + 4, 4);
  acc.v = _mm256_add_epi16(acc.v, _mm256_maddubs_epi16(w.lo, _mm256_set1_epi32(a)));
  acc.v = _mm256_add_epi16(acc.v, _mm256_maddubs_epi16(w.hi, _mm256_set1_epi32(b)));
}
inline v8f q4_sum(const Q4Acc& acc) {
  return (v8f)_mm256_cvtepi32_ps(_mm256_madd_epi16(acc.v, _mm256_set1_epi16(1)));
}
#endif
#else
struct Q4Acc {  // the 8 columns' dot products
  int32_t v[IL] = {};
};
struct Q4Codes {
  const uint8_t* p;
};
inline Q4Codes q4_load(const uint8_t* p) { return {p}; }
inline void q4_dot(const Q4Codes& w, const int8_t* xq, Q4Acc& acc) {
  for (int j = 0; j < IL; ++j)
    for (int i = 0; i < 4; ++i)
      acc.v[j] += (w.p[4 * j + i] & 15) * xq[i] + (w.p[4 * j + i] >> 4) * xq[4 + i];
}
inline v8f q4_sum(const Q4Acc& acc) {
  v8f f;
  for (int j = 0; j < IL; ++j) f[j] = static_cast<float>(acc.v[j]);
  return f;
}
#endif

// where panels p .. p + C - 1 of the packed int4 / int8 codes and their scales start: 8 panels a
// block, `block` bytes of codes and `sblock` scales a block, a panel's 32 bytes / 8 scales in it
template <int C, typename S>
inline void panel_starts(const uint8_t* codes, int64_t block, const S* sz, int64_t sblock, int64_t p,
                         const uint8_t** wc, const S** sc) {
  for (int c = 0; c < C; ++c) {
    wc[c] = codes + (p + c) / IB * block + (p + c) % IB * 32;
    sc[c] = sz + (p + c) / IB * sblock + (p + c) % IB * IL;
  }
}

// R rows x C panels (p, p + 1, ...) over all groups; y accumulates in out (ldo apart per row),
// set here. xq [R, K], xd [R, K / QB], xs [R, G].
template <int R, int C, typename S>
__attribute__((noinline)) void int4_tile(const int8_t* xq, const float* xd, const float* xs, int64_t K, int64_t G,
                                          int64_t g, const uint8_t* codes, const S* sz, int64_t p, float* out,
                                          int64_t ldo) {
  constexpr int64_t group_scales = 2 * IB * IL;
  constexpr int64_t chunk = IB * 32;  // bytes of one block's 8 inputs
  const int64_t KC = K / 8, KB = K / QB;
  const uint8_t* wc[C];
  const S* sc[C];
  panel_starts<C>(codes, KC * chunk, sz, G * group_scales, p, wc, sc);
  for (int r = 0; r < R; ++r) std::memset(out + r * ldo, 0, sizeof(float) * C * IL);
  const int64_t blocks = g / QB;
  // the group's fp32 sums stay in memory (L1): in registers beside the R x C integer sums, the
  // codes and the broadcast activations they overflowed AVX-512's 32 and were spilled inside the
  // loop over the inputs
  alignas(32) float a[R][C][IL];
  for (int64_t gi = 0; gi < G; ++gi) {
    std::memset(a, 0, sizeof(a));
    for (int64_t b = gi * blocks; b < (gi + 1) * blocks; ++b) {
      asm volatile("" : : "r"(a) : "memory");  // (keeps a[] in memory)
      Q4Acc s[R][C];
#pragma GCC unroll 4
      for (int64_t k8 = 0; k8 < QB / 8; ++k8) {  // (a constant count: no remainder code)
        const int64_t kc = b * (QB / 8) + k8;
        // the codes stream from memory: fetch each 64-byte line 8 inputs' chunks ahead
#pragma GCC unroll 8
        for (int c = 0; c < C; c += 2) __builtin_prefetch(wc[c] + (kc + 8) * chunk, 0, 1);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          const Q4Codes w = q4_load(wc[c] + kc * chunk);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) q4_dot(w, xq + r * K + kc * 8, s[r][c]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const v8f d = bcast8(xd + r * KB + b);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          const v8f y = fma8(d, q4_sum(s[r][c]), load8(a[r][c]));
          std::memcpy(a[r][c], &y, sizeof(y));
        }
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const S* ps = sc[c] + gi * group_scales;
      const v8f s = load8(ps), z = load8(ps + IB * IL);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        float* o = out + r * ldo + c * IL;
        const v8f y = fma8(s, load8(a[r][c]), load8(o));
        const v8f yz = fma8(z, bcast8(xs + r * G + gi), y);
        std::memcpy(o, &yz, sizeof(yz));
      }
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// the int4 / int8 register tiles also come in 512-bit panel pairs (int4_tile2, int8_tile2)
#define INT_PANEL_PAIRS 1
#endif

#ifdef INT_PANEL_PAIRS
// int4_tile over pairs of adjacent panels (p even: panels 2h, 2h + 1 of a tile lie side by side
// in a block of IB, codes and scales alike) in 512-bit vectors: one load, mask, shift and one
// vpdpbusd per row for 16 columns where the 256-bit tile takes two of each. Every column's
// integers and FMAs are the same, in the same order: the same bits as int4_tile.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 -> fp32 exactly: the bits shifted up
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int R, int C, typename S>
__attribute__((noinline)) void int4_tile2(const int8_t* xq, const float* xd, const float* xs, int64_t K, int64_t G,
                                           int64_t g, const uint8_t* codes, const S* sz, int64_t p, float* out,
                                           int64_t ldo) {
  static_assert(C % 2 == 0, "int4_tile2 takes pairs of panels");
  constexpr int H = C / 2;
  constexpr int64_t group_scales = 2 * IB * IL;
  constexpr int64_t chunk = IB * 32;
  const int64_t KC = K / 8, KB = K / QB;
  const uint8_t* wc[C];
  const S* sc[C];
  panel_starts<C>(codes, KC * chunk, sz, G * group_scales, p, wc, sc);
  for (int r = 0; r < R; ++r) std::memset(out + r * ldo, 0, sizeof(float) * C * IL);
  const int64_t blocks = g / QB;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  alignas(64) float a[R][C][IL];
  for (int64_t gi = 0; gi < G; ++gi) {
    std::memset(a, 0, sizeof(a));
    for (int64_t b = gi * blocks; b < (gi + 1) * blocks; ++b) {
      asm volatile("" : : "r"(a) : "memory");
      __m512i s[R][H];
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < H; ++h) s[r][h] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int64_t k8 = 0; k8 < QB / 8; ++k8) {
        const int64_t kc = b * (QB / 8) + k8;
#pragma GCC unroll 8
        for (int h = 0; h < H; ++h) __builtin_prefetch(wc[2 * h] + (kc + 8) * chunk, 0, 1);
#pragma GCC unroll 8
        for (int h = 0; h < H; ++h) {
          const __m512i w = _mm512_loadu_si512(wc[2 * h] + kc * chunk);
          const __m512i lo = _mm512_and_si512(w, mask), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), mask);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            int32_t x0, x1;
            std::memcpy(&x0, xq + r * K + kc * 8, 4);
            std::memcpy(&x1, xq + r * K + kc * 8 + 4, 4);
            s[r][h] = _mm512_dpbusd_epi32(s[r][h], lo, _mm512_set1_epi32(x0));
            s[r][h] = _mm512_dpbusd_epi32(s[r][h], hi, _mm512_set1_epi32(x1));
          }
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 d = _mm512_set1_ps(xd[r * KB + b]);
#pragma GCC unroll 8
        for (int h = 0; h < H; ++h)
          _mm512_store_ps(a[r][2 * h],
                          _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s[r][h]), _mm512_load_ps(a[r][2 * h])));
      }
    }
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) {
      const S* ps = sc[2 * h] + gi * group_scales;
      const __m512 sv = load16(ps), zv = load16(ps + IB * IL);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        float* o = out + r * ldo + 2 * h * IL;
        const __m512 y = _mm512_fmadd_ps(sv, _mm512_load_ps(a[r][2 * h]), _mm512_loadu_ps(o));
        _mm512_storeu_ps(o, _mm512_fmadd_ps(zv, _mm512_set1_ps(xs[r * G + gi]), y));
      }
    }
  }
}
#endif

#if DFLASH_AMX_INT8
// ---- the packed integer GEMMs on AMX (int4_linear and int8_linear with 8 rows or more) ----
// tdpbsud multiplies a tile of up to 16 rows x 32 signed activation bytes (one Q8 block) by 8 pair
// rows x 16 columns of unsigned weight bytes into 16 x 16 int32 sums: each (row, column) the exact
// integer dot product of the block that vpdpbusd forms 4 inputs at a time in int4_tile2 /
// int8_tile2. Those are the only integers; the fp32 FMAs after each block and after each group are
// the register tiles' own, in their order, so every output has the same bits at any row count.
// A panel pair's 64 bytes of one chunk are a pair row of AMX's B layout: int8's codes as they are
// (input 4kq + i of column j in byte 4j + i), int4's after the mask (inputs 8kc .. 8kc + 3: pair
// row 2kc) or the shift (8kc + 4 .. 8kc + 7: pair row 2kc + 1), staged in L1 for the tile load.
// Each weight byte is unpacked once per 16 rows, where the register tiles unpack it per 1 - 6 rows
// and multiply it per row. Staging the unpacked tile in L1 costs about what the register tiles'
// multiplies of 2 - 4 rows do, so AMX takes 8 rows and more. (2-core AMX Xeon, the default target's
// 210 int4 GEMMs with distinct weights, bf16 activations, medians of 9, processes alternating,
// register tiles -> AMX: 8 rows 10.9-13.0 -> 9.0-11.7 ms, 16 rows 14.1-15.8 -> 10.4-14.0, 64 rows
// 40.2-45.8 -> 32.3-40.4; the Q8_0 LM head [49152, 576]: 8 rows 1.28-1.32 -> 1.11-1.19 ms, 16 rows
// 1.81-1.95 -> 1.45-1.49; at 2 and 4 rows AMX took 1.2-1.4x the register tiles' time.)
constexpr int64_t AMX_INT_ROWS = 8;  // the fewest rows that take AMX

// tiles 0: activations (R rows x 32 bytes), 1, 2: the weights of up to 2 units of 16 columns (8 pair
// rows x 64 bytes), 3, 4 and 5, 6: their int32 sums (R rows x 16), the even blocks' and the odd ones'
inline void amx_int_config(int R) {
  TileConfig cfg;
  cfg.rows[0] = static_cast<uint8_t>(R), cfg.colsb[0] = 32;
  for (int t = 1; t < 3; ++t) cfg.rows[t] = 8, cfg.colsb[t] = 64;
  for (int t = 3; t < 7; ++t) cfg.rows[t] = static_cast<uint8_t>(R), cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// one block's sums of U (1, 2) units into the sum tiles of set P (block parity), from the weight
// tiles at src[u] (stride bytes between pair rows) and the activations in tile 0, stored as [R, 16]
// int32 at dst[u]. Alternate blocks use alternate sum tiles, so a block's products need not wait
// for the previous block's sums to be stored.
template <int U, int P>
inline void amx_int_block(const void* const* src, int64_t stride, int32_t (*dst)[AR * 16]) {
  // (the tile intrinsics take their tile numbers as literals)
#define DFLASH_AMX_INT_BLOCK(c0, c1)                            \
  _tile_loadd(1, src[0], stride);                               \
  _tile_zero(c0);                                               \
  _tile_dpbsud(c0, 0, 1);                                       \
  if constexpr (U > 1) {                                        \
    _tile_loadd(2, src[1], stride);                             \
    _tile_zero(c1);                                             \
    _tile_dpbsud(c1, 0, 2);                                     \
  }                                                             \
  _tile_stored(c0, dst[0], 64);                                 \
  if constexpr (U > 1) _tile_stored(c1, dst[1], 64);
  if constexpr (P) {
    DFLASH_AMX_INT_BLOCK(5, 6)
  } else {
    DFLASH_AMX_INT_BLOCK(3, 4)
  }
#undef DFLASH_AMX_INT_BLOCK
}

// The integer GEMMs' AMX loop over the K / 32 blocks of R rows x U units: block b's weight tiles are
// staged (stage(b, src): int4 unpacks them, int8 points at its codes) one block ahead, and its
// int32 sums are scaled into the fp32 sums (fold(b, sums)) one block behind, while the next
// block's tile products run. (Against one block at a time on one set of sum tiles, the 210 int4
// GEMMs with distinct weights, medians of 9, processes alternating: 8 rows 11.3-11.9 ms against
// 12.4-13.4, 16 and 32 rows within the noise.)
template <int U, typename Stage, typename Fold>
inline void amx_int_blocks(int64_t KB, const int8_t* xq, int64_t K, int64_t stride, const Stage& stage,
                           const Fold& fold) {
  alignas(64) int32_t cs[2][U][AR * 16];
  const void* src[2][U];
  stage(0, src[0]);
  for (int64_t b = 0; b < KB; ++b) {
    if (b + 1 < KB) stage(b + 1, src[(b + 1) & 1]);
    _tile_loadd(0, xq + b * QB, K);
    if (b & 1)
      amx_int_block<U, 1>(src[1], stride, cs[1]);
    else
      amx_int_block<U, 0>(src[0], stride, cs[0]);
    if (b > 0) fold(b - 1, cs[(b - 1) & 1]);
  }
  fold(KB - 1, cs[(KB - 1) & 1]);
}

// int4_tile2's outputs for R (configured) rows x U (1, 2) units of 16 columns: panels p .. p + 2U - 1
// (p even); out[r * ldo + 16 u + j]
template <int U, typename S>
__attribute__((noinline)) void int4_amx(int R, const int8_t* xq, const float* xd, const float* xs, int64_t K,
                                         int64_t G, int64_t g, const uint8_t* codes, const S* sz, int64_t p,
                                         float* out, int64_t ldo) {
  constexpr int64_t group_scales = 2 * IB * IL, chunk = IB * 32;
  const int64_t KC = K / 8, KB = K / QB, blocks = g / QB;
  const uint8_t* wc[2 * U];
  const S* sc[2 * U];
  panel_starts<2 * U>(codes, KC * chunk, sz, G * group_scales, p, wc, sc);
  alignas(64) uint8_t bt[2][U][8 * 64];  // the weight tiles of two blocks, unpacked
  alignas(64) float a[AR][U][16];
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < R; ++r) std::memset(out + r * ldo, 0, sizeof(float) * U * 16);
  std::memset(a, 0, sizeof(float) * R * U * 16);
  amx_int_blocks<U>(
      KB, xq, K, 64,
      [&](int64_t b, const void** src) {
        for (int u = 0; u < U; ++u) {
          const uint8_t* w = wc[2 * u] + 4 * b * chunk;
          uint8_t* t = bt[b & 1][u];
          src[u] = t;
#pragma GCC unroll 4
          for (int q = 0; q < 4; ++q) {
            __builtin_prefetch(w + (q + 8) * chunk, 0, 1);
            const __m512i v = _mm512_loadu_si512(w + q * chunk);
            _mm512_store_si512(t + 2 * q * 64, _mm512_and_si512(v, mask));
            _mm512_store_si512(t + (2 * q + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
          }
        }
      },
      [&](int64_t b, int32_t (*cs)[AR * 16]) {
        for (int r = 0; r < R; ++r) {
          const __m512 d = _mm512_set1_ps(xd[r * KB + b]);
#pragma GCC unroll 2
          for (int u = 0; u < U; ++u)
            _mm512_store_ps(a[r][u], _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_load_si512(cs[u] + r * 16)),
                                                     _mm512_load_ps(a[r][u])));
        }
        if ((b + 1) % blocks) return;
        const int64_t gi = b / blocks;  // the group's end: its scale and zero terms
#pragma GCC unroll 2
        for (int u = 0; u < U; ++u) {
          const S* ps = sc[2 * u] + gi * group_scales;
          const __m512 sv = load16(ps), zv = load16(ps + IB * IL);
          for (int r = 0; r < R; ++r) {
            float* o = out + r * ldo + 16 * u;
            const __m512 y = _mm512_fmadd_ps(sv, _mm512_load_ps(a[r][u]), _mm512_loadu_ps(o));
            _mm512_storeu_ps(o, _mm512_fmadd_ps(zv, _mm512_set1_ps(xs[r * G + gi]), y));
          }
        }
        std::memset(a, 0, sizeof(float) * R * U * 16);
      });
}

// int8_tile2's outputs for R (configured) rows x U (1, 2) units of 16 columns (as int4_amx); the
// codes' pair rows are loaded in place, a chunk (256 bytes) apart
template <int U, typename S>
__attribute__((noinline)) void int8_amx(int R, const int8_t* xq, const float* xd, const int32_t* xsum, int64_t K,
                                         const uint8_t* codes, const S* sz, int64_t p, float* out, int64_t ldo) {
  constexpr int64_t chunk = IB * 32;
  const int64_t KQ = K / 4, KB = K / QB;
  const uint8_t* wc[2 * U];
  const S* sc[2 * U];
  panel_starts<2 * U>(codes, KQ * chunk, sz, IB * IL, p, wc, sc);
  alignas(64) float a[AR][U][16];
  std::memset(a, 0, sizeof(float) * R * U * 16);
  amx_int_blocks<U>(
      KB, xq, K, chunk,
      [&](int64_t b, const void** src) {
        for (int u = 0; u < U; ++u) {
          src[u] = wc[2 * u] + 8 * b * chunk;
          for (int q = 0; q < 8; ++q) __builtin_prefetch(wc[2 * u] + (8 * b + 16 + q) * chunk, 0, 1);
        }
      },
      [&](int64_t b, int32_t (*cs)[AR * 16]) {
        for (int r = 0; r < R; ++r) {
          const __m512 d = _mm512_set1_ps(xd[r * KB + b]);
          const __m512i off = _mm512_set1_epi32(128 * xsum[r * KB + b]);
#pragma GCC unroll 2
          for (int u = 0; u < U; ++u)
            _mm512_store_ps(
                a[r][u], _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(cs[u] + r * 16), off)),
                                         _mm512_load_ps(a[r][u])));
        }
      });
#pragma GCC unroll 2
  for (int u = 0; u < U; ++u) {
    const __m512 sv = load16(sc[2 * u]);
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(out + r * ldo + 16 * u, _mm512_fmadd_ps(sv, _mm512_load_ps(a[r][u]), _mm512_setzero_ps()));
  }
}

// an integer GEMM of M >= AMX_INT_ROWS rows on AMX: threads take groups of units of 16 columns
// (sweep_groups; balanced as the float GEMMs' panels), swept 16 rows at a time, 2 units a kernel
// call; tile(U, R, m, p, t, ldt) computes rows m .. m + R - 1 of panels p .. p + 2U - 1 into t. The
// tile configuration is loaded once per task and row count (amx_int_rows) and released after the
// task (see amx_config)
inline thread_local int amx_int_rows = 0;  // the rows the tiles are configured for (0: none)
template <typename O, typename Tile>
void int_amx(int64_t M, int64_t N, const float* bias, O* out, const Tile& tile) {
  const int64_t units = (N + 15) / 16;
  sweep_groups(
      M, N, 16, balanced_panels(units, 1, IB / 2), 1, AR, bias, out,
      [&](int64_t m, int rows, int64_t u0, int64_t nu, float* t, int64_t ldt) {
        if (amx_int_rows != rows) amx_int_config(rows), amx_int_rows = rows;
        int64_t u = 0;
        for (; u + 2 <= nu; u += 2) tile(std::integral_constant<int, 2>{}, rows, m, 2 * (u0 + u), t + 16 * u, ldt);
        if (u < nu) tile(std::integral_constant<int, 1>{}, rows, m, 2 * (u0 + u), t + 16 * u, ldt);
      },
      [] { _tile_release(); amx_int_rows = 0; });
}

inline bool use_int_amx(int64_t M) { return M >= AMX_INT_ROWS && amx_ready(); }
#endif

// the rows' activations as Q8 blocks: codes, scales and per-block code sums
template <typename T>
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum;
  Q8Rows(const T* x, int64_t M, int64_t K) : q(M * K), d(M * (K / QB)), sum(M * (K / QB)) {
    for (int64_t m = 0; m < M; ++m) {
      quantize_q8(x + m * K, K, q.data() + m * K, d.data() + m * (K / QB));
      for (int64_t b = 0; b < K / QB; ++b) {
        int32_t t = 0;
        for (int i = 0; i < QB; ++i) t += q[m * K + b * QB + i];
        sum[m * (K / QB) + b] = t;
      }
    }
  }
};

// panels of an int4 / int8 register tile for 1 .. 6 rows: R x C int32 block sums in registers
// beside the codes and the broadcast activations (the fp32 sums are in L1). With AVX-512's 32
// registers 4 rows take 4 panels: 120 int4 GEMMs of the default target's shapes, 4 rows, 2
// threads (AMD EPYC Zen 4), 1.88 ms with 2 panels, 1.61 with 4 (more loads in flight on the
// streaming weight); and 2 - 4 rows 8, a block's whole 256 bytes of each 8 inputs (2-core AMX
// Xeon, 210 int4 GEMMs with distinct weights, medians of 9, processes alternating: 2 rows
// 4.93-5.20 -> 4.30-4.43 ms, 4 rows 5.58-6.45 -> 4.95-5.24; the Q8_0 LM head [49152, 576], 2
// rows 0.80-0.87 -> 0.67-0.77, 4 rows 0.93-1.05 -> 0.79-0.91). 16 registers hold 2.
#ifdef __AVX512F__
#define INT_PANELS 8, 8, 8, 8, 4, 4
#else
#define INT_PANELS 4, 2, 2, 2, 1, 1
#endif

template <typename T, typename S, typename O>
void int4_impl(const T* x, int64_t M, int64_t K, int64_t g, const uint8_t* wp, const S* sz, const float* bias,
               int64_t N, O* out) {
  const int64_t G = K / g, KB = K / QB;
  const Q8Rows<T> xr(x, M, K);
  std::vector<float> xs(M * G);  // each row's quantized group sums: d_b * sum(q) per block, in order
  for (int64_t m = 0; m < M; ++m)
    for (int64_t gi = 0; gi < G; ++gi) {
      float s = 0.f;
      for (int64_t b = gi * (g / QB); b < (gi + 1) * (g / QB); ++b)
        s = std::fma(xr.d[m * KB + b], static_cast<float>(xr.sum[m * KB + b]), s);
      xs[m * G + gi] = s;
    }
#if DFLASH_AMX_INT8
  if (use_int_amx(M))
    return int_amx(M, N, bias, out, [&](auto u, int rows, int64_t m, int64_t p, float* t, int64_t ldt) {
      int4_amx<decltype(u)::value>(rows, xr.q.data() + m * K, xr.d.data() + m * KB, xs.data() + m * G, K, G, g, wp,
                                   sz, p, t, ldt);
    });
#endif
  int_panels<INT_PANELS>(M, N, bias, out, [&](auto r, auto c, int64_t m, int64_t p, float* t, int64_t ldt) {
    constexpr int R = decltype(r)::value, C = decltype(c)::value;
#ifdef INT_PANEL_PAIRS
    if constexpr (C % 2 == 0) {
      if (p % 2 == 0)
        return int4_tile2<R, C>(xr.q.data() + m * K, xr.d.data() + m * KB, xs.data() + m * G, K, G, g, wp, sz, p, t,
                                ldt);
    }
#endif
    int4_tile<R, C>(xr.q.data() + m * K, xr.d.data() + m * KB, xs.data() + m * G, K, G, g, wp, sz, p, t, ldt);
  });
}

// ---- int8 weights against int8 activations (GGUF Q8_0 x Q8_0's arithmetic with one scale
// per output row; llama.cpp's ggml_vec_dot_q8_0_q8_0 for the default target's Q8_0 LM head) ----
// Codes [S, K / 4, 8, 32] bytes: the 32 bytes (s, kq, c) hold column 64s + 8c + j's codes + 128
// (unsigned) at inputs 4kq + i in byte 4j + i, i = 0..3. One output: y = scale * (FMA chain over
// the 32-input blocks in increasing order of d_b * dot_b from 0), dot_b = sum of q_w * q_x over
// the block (exact: integers, |dot| <= 127 * 127 * 32), the activations rounded as int4_linear
// rounds them. With VNNI, vpdpbusd multiplies the unsigned codes by the signed activation bytes
// (4 a column, summed into its int32) and 128 * sum(q_x) is taken off per block; with AVX2 the
// codes are made signed again and multiplied as |w| * (x with w's sign) (vpmaddubsw, pairs that
// cannot saturate: <= 2 * 128 * 127), then vpmaddwd: the same integers either way.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
constexpr bool Q8_OFFSET = true;  // the dots hold sum((q_w + 128) * q_x)
inline void q8_dot(__m256i w, int32_t x4, __m256i& acc) { acc = dpbusd(acc, w, _mm256_set1_epi32(x4)); }
#elif defined(__AVX2__)
constexpr bool Q8_OFFSET = false;
inline void q8_dot(__m256i w, int32_t x4, __m256i& acc) {
  const __m256i ws = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));  // q_w as int8
  const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(_mm256_set1_epi32(x4), ws));
  acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#endif

// R rows x C panels (p, p + 1, ...) into out (ldo apart per row). xq [R, K], xd / xsum [R, K / QB]
// (each block's scale and sum of codes)
template <int R, int C, typename S>
__attribute__((noinline)) void int8_tile(const int8_t* xq, const float* xd, const int32_t* xsum, int64_t K,
                                          const uint8_t* codes, const S* sz, int64_t p, float* out, int64_t ldo) {
  constexpr int64_t chunk = IB * 32;  // bytes of one block's 4 inputs
  const int64_t KQ = K / 4, KB = K / QB;
  const uint8_t* wc[C];
  const S* sc[C];
  panel_starts<C>(codes, KQ * chunk, sz, IB * IL, p, wc, sc);
  alignas(32) float a[R][C][IL] = {};  // in memory, as int4_tile's
  for (int64_t b = 0; b < KB; ++b) {
#if defined(__AVX2__)
    asm volatile("" : : "r"(a) : "memory");
    __m256i s[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) s[r][c] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int64_t k4 = 0; k4 < QB / 4; ++k4) {
      const int64_t kq = b * (QB / 4) + k4;
#pragma GCC unroll 8
      for (int c = 0; c < C; c += 2) __builtin_prefetch(wc[c] + (kq + 16) * chunk, 0, 1);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc[c] + kq * chunk));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, xq + r * K + kq * 4, 4);
          q8_dot(w, x4, s[r][c]);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const v8f d = bcast8(xd + r * KB + b);
      const __m256i off = _mm256_set1_epi32(Q8_OFFSET ? 128 * xsum[r * KB + b] : 0);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const v8f y = fma8(d, (v8f)_mm256_cvtepi32_ps(_mm256_sub_epi32(s[r][c], off)), load8(a[r][c]));
        std::memcpy(a[r][c], &y, sizeof(y));
      }
    }
#else
    for (int r = 0; r < R; ++r) {
      const v8f d = bcast8(xd + r * KB + b);
      for (int c = 0; c < C; ++c) {
        v8f f;
        for (int j = 0; j < IL; ++j) {
          int32_t dot = 0;
          for (int64_t kq = b * (QB / 4); kq < (b + 1) * (QB / 4); ++kq)
            for (int i = 0; i < 4; ++i) dot += (wc[c][kq * chunk + 4 * j + i] - 128) * xq[r * K + kq * 4 + i];
          f[j] = static_cast<float>(dot);
        }
        const v8f y = fma8(d, f, load8(a[r][c]));
        std::memcpy(a[r][c], &y, sizeof(y));
      }
    }
#endif
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    const v8f sv = load8(sc[c]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const v8f y = fma8(sv, load8(a[r][c]), v8f{});
      std::memcpy(out + r * ldo + c * IL, &y, sizeof(y));
    }
  }
}

#ifdef INT_PANEL_PAIRS
// int8_tile over pairs of adjacent panels in 512-bit vectors (as int4_tile2): the same integers
// and FMAs per column, in the same order, so the same bits as int8_tile.
template <int R, int C, typename S>
__attribute__((noinline)) void int8_tile2(const int8_t* xq, const float* xd, const int32_t* xsum, int64_t K,
                                           const uint8_t* codes, const S* sz, int64_t p, float* out, int64_t ldo) {
  static_assert(C % 2 == 0, "int8_tile2 takes pairs of panels");
  constexpr int H = C / 2;
  constexpr int64_t chunk = IB * 32;
  const int64_t KQ = K / 4, KB = K / QB;
  const uint8_t* wc[C];
  const S* sc[C];
  panel_starts<C>(codes, KQ * chunk, sz, IB * IL, p, wc, sc);
  alignas(64) float a[R][C][IL] = {};
  for (int64_t b = 0; b < KB; ++b) {
    asm volatile("" : : "r"(a) : "memory");
    __m512i s[R][H];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) s[r][h] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int64_t k4 = 0; k4 < QB / 4; ++k4) {
      const int64_t kq = b * (QB / 4) + k4;
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h) __builtin_prefetch(wc[2 * h] + (kq + 16) * chunk, 0, 1);
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h) {
        const __m512i w = _mm512_loadu_si512(wc[2 * h] + kq * chunk);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, xq + r * K + kq * 4, 4);
          s[r][h] = _mm512_dpbusd_epi32(s[r][h], w, _mm512_set1_epi32(x4));
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(xd[r * KB + b]);
      const __m512i off = _mm512_set1_epi32(128 * xsum[r * KB + b]);
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h)
        _mm512_store_ps(a[r][2 * h], _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(s[r][h], off)),
                                                     _mm512_load_ps(a[r][2 * h])));
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < H; ++h) {
    const __m512 sv = load16(sc[2 * h]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(out + r * ldo + 2 * h * IL, _mm512_fmadd_ps(sv, _mm512_load_ps(a[r][2 * h]), _mm512_setzero_ps()));
  }
}
#endif

template <typename T, typename S, typename O>
void int8_impl(const T* x, int64_t M, int64_t K, const uint8_t* wp, const S* sz, const float* bias, int64_t N,
               O* out) {
  const Q8Rows<T> xr(x, M, K);
  const int64_t KB = K / QB;
#if DFLASH_AMX_INT8
  if (use_int_amx(M))
    return int_amx(M, N, bias, out, [&](auto u, int rows, int64_t m, int64_t p, float* t, int64_t ldt) {
      int8_amx<decltype(u)::value>(rows, xr.q.data() + m * K, xr.d.data() + m * KB, xr.sum.data() + m * KB, K, wp, sz,
                                   p, t, ldt);
    });
#endif
  int_panels<INT_PANELS>(M, N, bias, out, [&](auto r, auto c, int64_t m, int64_t p, float* t, int64_t ldt) {
    constexpr int R = decltype(r)::value, C = decltype(c)::value;
#ifdef INT_PANEL_PAIRS
    if constexpr (C % 2 == 0) {
      if (p % 2 == 0)
        return int8_tile2<R, C>(xr.q.data() + m * K, xr.d.data() + m * KB, xr.sum.data() + m * KB, K, wp, sz, p, t,
                                ldt);
    }
#endif
    int8_tile<R, C>(xr.q.data() + m * K, xr.d.data() + m * KB, xr.sum.data() + m * KB, K, wp, sz, p, t, ldt);
  });
}

// x [M, K] (fp32 or bf16) times a packed integer weight (see above) -> [M, n] in x's dtype
// (+ bias in fp32 before the one rounding); the callers have checked the shapes.
// run(x contiguous in its dtype, scales, bias, out) with the scales and out typed
template <typename Run>
at::Tensor int_linear(const char* op, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n,
                      const std::optional<at::Tensor>& bias, const Run& run) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x must be fp32 or bf16");
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kBFloat16, op,
              ": scales must be fp32 or bf16");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(), op, ": codes and scales must be contiguous");
  const int64_t NB = codes.size(0);
  TORCH_CHECK(n > (NB - 1) * IB * IL && n <= NB * IB * IL, op, ": ", n, " outputs do not fit ", NB, " blocks of 64");
  const int64_t M = x.size(0), K = x.size(1);
  const at::Tensor xc = x.contiguous();
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, op, ": bias has ", bias->numel(), " values for ", n, " outputs");
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* b = bf.defined() ? bf.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return out;
  const bool sb = scales.scalar_type() == at::kBFloat16, ob = x.scalar_type() == at::kBFloat16;
  if (sb && ob) {
    run(xc, scales.data_ptr<c10::BFloat16>(), b, out.data_ptr<c10::BFloat16>());
  } else if (sb) {
    run(xc, scales.data_ptr<c10::BFloat16>(), b, out.data_ptr<float>());
  } else if (ob) {
    run(xc, scales.data_ptr<float>(), b, out.data_ptr<c10::BFloat16>());
  } else {
    run(xc, scales.data_ptr<float>(), b, out.data_ptr<float>());
  }
  return out;
}

// codes [S, K / 8, 8, 32] uint8, scales [S, K / g, 2, 8, 8]
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n, int64_t g,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 4 && scales.dim() == 5,
              "int4_linear: x [M, K], codes [S, K / 8, 8, 32], scales [S, G, 2, 8, 8] expected");
  const int64_t K = x.size(1), NB = codes.size(0);
  TORCH_CHECK(g > 0 && g % QB == 0 && K % g == 0, "int4_linear: group size ", g,
              " must be a multiple of 32 dividing ", K);
  TORCH_CHECK(codes.size(1) == K / 8 && codes.size(2) == IB && codes.size(3) == 32 &&
                  codes.scalar_type() == at::kByte,
              "int4_linear: codes must be uint8 [S, ", K / 8, ", 8, 32]");
  TORCH_CHECK(scales.size(0) == NB && scales.size(1) == K / g && scales.size(2) == 2 && scales.size(3) == IB &&
                  scales.size(4) == IL,
              "int4_linear: scales must be [", NB, ", ", K / g, ", 2, 8, 8]");
  const uint8_t* wp = codes.data_ptr<uint8_t>();
  return int_linear("int4_linear", x, codes, scales, n, bias,
                    [&](const at::Tensor& xc, const auto* sz, const float* b, auto* out) {
                      if (xc.scalar_type() == at::kBFloat16)  // quantized from bf16 as it is (exact in fp32)
                        int4_impl(xc.data_ptr<c10::BFloat16>(), xc.size(0), K, g, wp, sz, b, n, out);
                      else
                        int4_impl(xc.data_ptr<float>(), xc.size(0), K, g, wp, sz, b, n, out);
                    });
}

// codes [S, K / 4, 8, 32] uint8, scales [S, 8, 8]
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 4 && scales.dim() == 3,
              "int8_linear: x [M, K], codes [S, K / 4, 8, 32], scales [S, 8, 8] expected");
  const int64_t K = x.size(1), NB = codes.size(0);
  TORCH_CHECK(K % QB == 0, "int8_linear: ", K, " inputs are not a multiple of ", QB);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.size(1) == K / 4 && codes.size(2) == IB && codes.size(3) == 32,
              "int8_linear: codes must be uint8 [S, ", K / 4, ", 8, 32]");
  TORCH_CHECK(scales.size(0) == NB && scales.size(1) == IB && scales.size(2) == IL, "int8_linear: scales must be [",
              NB, ", 8, 8]");
  const uint8_t* wp = codes.data_ptr<uint8_t>();
  return int_linear("int8_linear", x, codes, scales, n, bias,
                    [&](const at::Tensor& xc, const auto* sz, const float* b, auto* out) {
                      if (xc.scalar_type() == at::kBFloat16)
                        int8_impl(xc.data_ptr<c10::BFloat16>(), xc.size(0), K, wp, sz, b, n, out);
                      else
                        int8_impl(xc.data_ptr<float>(), xc.size(0), K, wp, sz, b, n, out);
                    });
}

#if defined(__AVX2__)
// the 8 x 8 transpose of r[0..7]: lane[i] holds lane i of each r[b] (b = 0..7)
inline void transpose8(const __m256* r, __m256* lane) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  lane[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  lane[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  lane[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  lane[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  lane[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  lane[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  lane[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  lane[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// out[b] = hsum(v[b]) for 8 vectors: transposed 8 lanes at a time (vector i holds lane i of each
// v[b]), then 0 + lane 0 + lane 1 + ... + lane VL-1 added in that order as hsum does, 8 keys per add
inline void hsum8(const vf* v, float* out) {
  __m256 s = _mm256_setzero_ps(), r[8], lane[8];
  for (int h = 0; h < VL / 8; ++h) {  // the lanes 8h .. 8h + 7 of every vector
    for (int i = 0; i < 8; ++i) {
#if defined(__AVX512F__)
      const __m512d d = _mm512_castps_pd((__m512)v[i]);
      r[i] = _mm256_castpd_ps(h ? _mm512_extractf64x4_pd(d, 1) : _mm512_castpd512_pd256(d));
#else
      r[i] = (__m256)v[i];
#endif
    }
    transpose8(r, lane);
    for (int i = 0; i < 8; ++i) s = _mm256_add_ps(s, lane[i]);
  }
  _mm256_storeu_ps(out, s);
}
#endif

// scores[b] = q . k_b over D for KB keys at once (rows kr[b]), per key in a fixed order: VL-lane
// FMA chunks in order from zero, lanes summed 0..VL-1, then a scalar tail; the KB chains are
// interleaved so that they overlap instead of each waiting on its own latency
template <int KB, typename T>
inline void dots(const float* q, const T* const* kr, int64_t D, float* scores) {
  vf acc[KB] = {};
  int64_t d = 0;
  for (; d + VL <= D; d += VL) {
    const vf qv = loadv(q + d);
    for (int b = 0; b < KB; ++b) acc[b] = fmav(qv, loadv(kr[b] + d), acc[b]);
  }
#if defined(__AVX2__)
  if constexpr (KB == 8) {
    if (D >= VL) {  // hsum of the 8 keys at once: lane i of every key in one vector (a transpose), the same adds
      hsum8(acc, scores);
      for (int b = 0; b < KB; ++b)
        for (int64_t e = d; e < D; ++e) scores[b] = std::fma(q[e], to_float(kr[b][e]), scores[b]);
      return;
    }
  }
#endif
  for (int b = 0; b < KB; ++b) {
    float s = D >= VL ? hsum(acc[b]) : 0.f;
    for (int64_t e = d; e < D; ++e) s = std::fma(q[e], to_float(kr[b][e]), s);
    scores[b] = s;
  }
}

// out[d0 .. d0 + NB * VL) += sum over the n keys j, in key order, of p[j] * v_j (one FMA per key
// per element onto what out holds), v_j = vr[j] + d0: NB vectors of the output held in registers
// over the n keys
template <int NB, typename T>
inline void weighted_sum(const float* p, const T* const* vr, int64_t n, int64_t d0, float* out) {
  vf acc[NB];
  std::memcpy(acc, out + d0, sizeof(acc));
  for (int64_t j = 0; j < n; ++j) {
    const vf pv = bcast(p + j);
    const T* row = vr[j] + d0;
    for (int b = 0; b < NB; ++b) acc[b] = fmav(pv, loadv(row + b * VL), acc[b]);
  }
  std::memcpy(out + d0, acc, sizeof(acc));
}

// out[D] += sum over the n keys j of p[j] * v_j, key by key in order
template <typename T>
inline void weighted_sums(const float* p, const T* const* vr, int64_t n, int64_t D, float* out) {
  int64_t d = 0;
  for (; d + 8 * VL <= D; d += 8 * VL) weighted_sum<8>(p, vr, n, d, out);
  for (; d + 4 * VL <= D; d += 4 * VL) weighted_sum<4>(p, vr, n, d, out);
  for (; d + VL <= D; d += VL) weighted_sum<1>(p, vr, n, d, out);
  for (; d < D; ++d) {
    float a = out[d];
    for (int64_t j = 0; j < n; ++j) a = std::fma(p[j], to_float(vr[j][d]), a);
    out[d] = a;
  }
}

// sums[i] = 0 + e_i[0] + e_i[1] + ... + e_i[n - 1] (key order, one chain per head) for the
// gn (1 .. 4) heads whose e_j lie ld apart from e: the chains interleaved, each the same adds
inline void exp_sums(int gn, const float* e, int64_t ld, int64_t n, float* sums) {
  float t[4] = {0.f, 0.f, 0.f, 0.f};
  switch (gn) {
    case 4:
      for (int64_t j = 0; j < n; ++j) t[0] += e[j], t[1] += e[ld + j], t[2] += e[2 * ld + j], t[3] += e[3 * ld + j];
      break;
    case 3:
      for (int64_t j = 0; j < n; ++j) t[0] += e[j], t[1] += e[ld + j], t[2] += e[2 * ld + j];
      break;
    case 2:
      for (int64_t j = 0; j < n; ++j) t[0] += e[j], t[1] += e[ld + j];
      break;
    default:
      for (int64_t j = 0; j < n; ++j) t[0] += e[j];
  }
  for (int i = 0; i < gn; ++i) sums[i] = t[i];
}

// weighted_sum for GB heads at once (their weights p + i * ld, outputs out + i * D): each value
// vector read once for all of them; per output element the same FMA chain in key order
template <int NB, int GB, typename T>
inline void weighted_sum_heads(const float* p, int64_t ld, const T* const* vr, int64_t n, int64_t d0, int64_t D,
                               float* out) {
  vf acc[GB][NB];
  for (int g = 0; g < GB; ++g) std::memcpy(acc[g], out + g * D + d0, sizeof(acc[g]));
  for (int64_t j = 0; j < n; ++j) {
    vf v[NB];
    for (int b = 0; b < NB; ++b) v[b] = loadv(vr[j] + d0 + b * VL);
    for (int g = 0; g < GB; ++g) {
      const vf pv = bcast(p + g * ld + j);
      for (int b = 0; b < NB; ++b) acc[g][b] = fmav(pv, v[b], acc[g][b]);
    }
  }
  for (int g = 0; g < GB; ++g) std::memcpy(out + g * D + d0, acc[g], sizeof(acc[g]));
}

// weighted_sums for the G heads of one KV head (weights p + g * ld, outputs out + g * D): blocks
// of 4 vectors of up to 3 heads at a time, then weighted_sum / scalar chains for the rest of
// each head's output; bit for bit weighted_sums a head at a time
template <typename T>
inline void weighted_sums_heads(const float* p, int64_t ld, int64_t G, const T* const* vr, int64_t n, int64_t D,
                                float* out) {
  const int64_t D4 = D / (4 * VL) * (4 * VL);
  for (int64_t d = 0; d < D4; d += 4 * VL) {
    int64_t g = 0;
    for (; g + 3 <= G; g += 3) weighted_sum_heads<4, 3>(p + g * ld, ld, vr, n, d, D, out + g * D);
    for (; g + 2 <= G; g += 2) weighted_sum_heads<4, 2>(p + g * ld, ld, vr, n, d, D, out + g * D);
    for (; g < G; ++g) weighted_sum_heads<4, 1>(p + g * ld, ld, vr, n, d, D, out + g * D);
  }
  for (int64_t g = 0; g < G; ++g) {  // the rest of each head's output
    int64_t d = D4;
    for (; d + VL <= D; d += VL) weighted_sum<1>(p + g * ld, vr, n, d, out + g * D);
    for (; d < D; ++d) {
      float a = out[g * D + d];
      for (int64_t j = 0; j < n; ++j) a = std::fma(p[g * ld + j], to_float(vr[j][d]), a);
      out[g * D + d] = a;
    }
  }
}

// Where key l of sequence s and KV head hk lives: `rows.key(s, hk, l)` / `rows.value(s, hk, l)`
// (a [S, Hkv, L, D] tensor of any strides, or pools [slots, Hkv, D] read through a slot table).
template <typename T>
struct StridedRows {
  const T *k, *v;
  int64_t k0, k1, k2, v0, v1, v2;
  StridedRows(const at::Tensor& kt, const at::Tensor& vt)
      : k(kt.data_ptr<T>()), v(vt.data_ptr<T>()), k0(kt.stride(0)), k1(kt.stride(1)), k2(kt.stride(2)),
        v0(vt.stride(0)), v1(vt.stride(1)), v2(vt.stride(2)) {}
  const T* key(int64_t s, int64_t hk, int64_t l) const { return k + s * k0 + hk * k1 + l * k2; }
  const T* value(int64_t s, int64_t hk, int64_t l) const { return v + s * v0 + hk * v1 + l * v2; }
};

template <typename T>
struct PagedRows {
  const T *k, *v;
  const int64_t* slots;  // [S, L]: the pool slot of each sequence's key l
  int64_t L, k0, k1, v0, v1;
  PagedRows(const at::Tensor& kp, const at::Tensor& vp, const at::Tensor& st)
      : k(kp.data_ptr<T>()), v(vp.data_ptr<T>()), slots(st.data_ptr<int64_t>()), L(st.size(1)), k0(kp.stride(0)),
        k1(kp.stride(1)), v0(vp.stride(0)), v1(vp.stride(1)) {}
  const T* key(int64_t s, int64_t hk, int64_t l) const { return k + slots[s * L + l] * k0 + hk * k1; }
  const T* value(int64_t s, int64_t hk, int64_t l) const { return v + slots[s * L + l] * v0 + hk * v1; }
};

#if DFLASH_AMX
// The scores of up to 16 query rows against 16 keys on AMX: tdpbf16ps over the keys' bf16 pairs
// (inputs 2p, 2p + 1), 32 inputs an instruction, chunks of 32 in order from input 0, into one
// fp32 sum per (row, key) (each output of a tile computed alone: the same bits whatever the other
// rows and keys of the tile). B's layout is VNNI: pair row p holds (k_n[2p], k_n[2p + 1]) of
// keys n = 0..15, i.e. the keys' 32-bit pairs transposed (16 x 16, in registers).
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + e], lane L: rows 4i .. 4i + 3 at column 4L + e
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i a = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x88), b = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x88), d = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xDD);
    t[e] = _mm512_shuffle_i32x4(a, c, 0x88);
    t[8 + e] = _mm512_shuffle_i32x4(a, c, 0xDD);
    t[4 + e] = _mm512_shuffle_i32x4(b, d, 0x88);
    t[12 + e] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// tiles: 0 the scores (R rows x 16 keys fp32), 1 the query rows (R x 32 bf16), 2 the keys (16
// pair rows x 16 keys)
inline void amx_score_config(int R) {
  TileConfig cfg;
  cfg.rows[0] = cfg.rows[1] = static_cast<uint8_t>(R);
  cfg.colsb[0] = cfg.colsb[1] = 64;
  cfg.rows[2] = 16, cfg.colsb[2] = 64;
  _tile_loadconfig(&cfg);
}

// scores[r * lds + n] = q_r . k_n (unscaled) for the R configured rows of q (bf16, ldq apart) and
// the nk (<= 16) keys kr[0 .. nk); the 16 - nk columns past them get 0 (room for 16 a row). D a
// multiple of 32; bt: D / 32 KiB, 64-byte aligned.
inline void amx_scores(const c10::BFloat16* q, int64_t ldq, const c10::BFloat16* const* kr, int nk, int64_t D,
                       uint32_t* bt, float* scores, int64_t lds) {
  for (int64_t c = 0; c < D; c += 32) {
    __m512i r[16];
    for (int n = 0; n < 16; ++n)
      r[n] = n < nk ? _mm512_loadu_si512(reinterpret_cast<const void*>(kr[n] + c)) : _mm512_setzero_si512();
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_store_si512(reinterpret_cast<void*>(bt + c / 2 * 16 + p * 16), r[p]);
  }
  _tile_zero(0);
  for (int64_t c = 0; c < D; c += 32) {
    _tile_loadd(1, q + c, ldq * 2);
    _tile_loadd(2, bt + c / 2 * 16, 64);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, scores, lds * 4);
}
#endif

// keys per tile of an attention task: 8 KiB of K (or V) rows at D = 64, fp32
constexpr int64_t ATT_TK = 32;

// The key rows of the next tile and the value rows of this one (keys [j0, min(n, j0 + ATT_TK)),
// read after the softmax) into the caches ahead of their first use: the rows of a paged cache are
// scattered blocks, and their first reads stalled the kernel (most of its time at 16 sequences)
template <typename T>
inline void prefetch_tile(const T* const* krow, const T* const* vrow, int64_t j0, int64_t n, int64_t D) {
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T)), j1 = std::min(n, j0 + ATT_TK);
  for (int64_t j = j1; j < std::min(n, j0 + 2 * ATT_TK); ++j)
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(krow[j]) + b, 0, 3);
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(vrow[j]) + b, 0, 2);
}

// The rest of an attention task once the raw scores of its R rows are in (row r at score + r * Lp,
// over the same n keys, whose values are vr[0 .. n)): each row scaled by sc, its max (with its
// sink, sink[r / every], where sink is not null), e_j = exp(s_j - max) in place, each row's sum
// in key order (plus its sink's e), and its output, acc[r * D ..]: the weighted sum of the values
// times 1 / the sum (zeros where the row sees no key and has no sink). Where hidden is not null,
// row r does not see key j where
// hidden[(r % every) * L + j] != 0 (rows r = g * every + t: head g, query position t): its score
// is taken as -inf and its e_j is exactly 0, which adds nothing to the row's chains (its sum and
// weighted sums are bit for bit those over the keys it sees alone).
template <typename T>
void softmax_values(float* score, int64_t Lp, int64_t R, int64_t n, float sc, const float* sink, int64_t every,
                    const uint8_t* hidden, int64_t L, const T* const* vr, int64_t D, float* sum, float* maxes,
                    float* acc) {
  std::vector<uint8_t> sees(R, n > 0);  // (a row sees some key)
  for (int64_t g = 0; g < R; ++g) {
    float* sg = score + g * Lp;
    const float* sk = sink ? sink + g / every : nullptr;
    const uint8_t* hid = hidden ? hidden + (g % every) * L : nullptr;
    if (hid) {
      sees[g] = std::count(hid, hid + n, 0) > 0;
      for (int64_t l = 0; l < n; ++l)
        if (hid[l]) sg[l] = -std::numeric_limits<float>::infinity();
    }
    // the scaled scores and their max (exact in any order: VL keys a step, lanes at the end)
    const vf scv = bcast_value(sc);
    vf mxv = bcast_value(-std::numeric_limits<float>::infinity());
    int64_t j = 0;
    for (; j + VL <= n; j += VL) {
      const vf x = loadv(sg + j) * scv;
      std::memcpy(sg + j, &x, sizeof(x));
      mxv = x > mxv ? x : mxv;
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < VL; ++i) mx = std::max(mx, mxv[i]);
    for (; j < n; ++j) mx = std::max(mx, sg[j] *= sc);
    if (sk) mx = std::max(mx, *sk);
    // sg[] now holds e_j = exp(s_j - max), VL keys at a time (the last few through a zero-padded
    // vector)
    const vf mv = bcast_value(mx);
    for (j = 0; j + VL <= n; j += VL) {
      const vf e = expv(loadv(sg + j) - mv);
      std::memcpy(sg + j, &e, sizeof(e));
    }
    if (j < n) {
      float part[VL] = {};
      std::memcpy(part, sg + j, (n - j) * sizeof(float));
      const vf e = expv(loadv(part) - mv);
      std::memcpy(sg + j, &e, (n - j) * sizeof(float));
    }
    if (hid)  // (exp clamps -inf to 0, but a row that sees no key has max -inf: NaN there)
      for (int64_t l = 0; l < n; ++l)
        if (hid[l]) sg[l] = 0.f;
    maxes[g] = mx;
  }
  // each head's sum of its e_j in key order (the heads' chains interleaved, 4 at a time)
  for (int64_t g0 = 0; g0 < R; g0 += 4) {
    const int gn = static_cast<int>(std::min<int64_t>(4, R - g0));
    exp_sums(gn, score + g0 * Lp, Lp, n, sum + g0);
    for (int64_t g = g0; g < g0 + gn; ++g)
      if (sink) sum[g] += std::exp(sink[g / every] - maxes[g]);
  }
  std::fill(acc, acc + R * D, 0.f);
  for (int64_t j0 = 0; j0 < n; j0 += ATT_TK) {
    const int64_t m = std::min(n, j0 + ATT_TK) - j0;
    weighted_sums_heads(score + j0, Lp, R, vr + j0, m, D, acc);
  }
  for (int64_t g = 0; g < R; ++g) {
    const float inv = (sees[g] || sink) ? 1.f / sum[g] : 0.f;
    for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= inv;
  }
}

#if DFLASH_AMX
// attention_impl's AMX path with one task per (sequence, KV head) for all T_ > 1 query positions
// at once (G * T_ <= 16 rows: a verify block's queries, 2 .. 5 positions of 3 heads a KV head):
// the keys any of them sees are gathered, prefetched and laid out as B tiles once, the scores of
// all G * T_ rows come from one tile product per 16 keys, and each value row is read once for
// every row's weighted sums (a task per position did all of that T_ times). A row's keys it does
// not see weigh exactly 0 (softmax_values), and each score of a tile is computed alone: the same
// bits as a task per position. (bf16, 9 heads over 3 KV heads, D 64, 150 keys a sequence, 2
// threads, 2-core AMX Xeon, the two paths alternated 41 times: 4 sequences x 2 / 3 / 4 positions
// 0.98 / 0.89 / 0.85x the per-position time, 16 x 2 / 3 0.95 / 0.83x, 32 x 2 0.91x; most of the
// rest is each row's own softmax and weighted sums.)
template <typename Rows>
void attention_amx_queries(const at::Tensor& q, const Rows& rows, int64_t Hkv, int64_t L, const at::Tensor& mask,
                           float sc, const float* sinks, int64_t Lp, at::Tensor& out) {
  using T = c10::BFloat16;
  const int64_t S = q.size(0), H = q.size(1), T_ = q.size(2), D = q.size(3);
  const int64_t G = H / Hkv, R = G * T_;
  const T* qp = q.data_ptr<T>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const auto qs = q.strides(), ms = mask.strides();
  at::parallel_for(0, S * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> score(R * Lp), acc(R * D), sum(R), maxes(R);
    std::vector<T> qrows(R * D);  // row g * T_ + t: head g's query at position t, contiguous
    std::vector<uint8_t> hidden(T_ * L);  // per position: 1 where it does not see the gathered key
    std::vector<const T*> krow(L), vrow(L);
    std::vector<uint32_t> btv(D * 8 + 16);
    uint32_t* bt = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(btv.data()) + 63) & ~uintptr_t{63});
    amx_score_config(static_cast<int>(R));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / Hkv, hk = i % Hkv;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < T_; ++t)
          std::memcpy(qrows.data() + (g * T_ + t) * D, qp + s * qs[0] + (hk * G + g) * qs[1] + t * qs[2], D * sizeof(T));
      const bool* mrow = mp + s * ms[0];
      int64_t n = 0;
      for (int64_t l = 0; l < L; ++l) {
        bool any = false;
        for (int64_t t = 0; t < T_; ++t) {
          const bool sees = mrow[t * ms[2] + l * ms[3]];
          hidden[t * L + n] = !sees;
          any = any || sees;
        }
        if (!any) continue;  // a key no position sees is never read (its flags are overwritten)
        krow[n] = rows.key(s, hk, l);
        vrow[n++] = rows.value(s, hk, l);
      }
      for (int64_t j0 = 0; j0 < n; j0 += ATT_TK) {
        const int64_t j1 = std::min(n, j0 + ATT_TK);
        prefetch_tile(krow.data(), vrow.data(), j0, n, D);
        for (int64_t j = j0; j < j1; j += 16)
          amx_scores(qrows.data(), D, krow.data() + j, static_cast<int>(std::min<int64_t>(16, j1 - j)), D, bt,
                     score.data() + j, Lp);
      }
      softmax_values(score.data(), Lp, R, n, sc, sinks ? sinks + hk * G : nullptr, T_, hidden.data(), L, vrow.data(),
                     D, sum.data(), maxes.data(), acc.data());
      for (int64_t r = 0; r < R; ++r)  // (row r = g * T_ + t is output (s, hk * G + g, t))
        std::memcpy(op + ((s * H + hk * G + r / T_) * T_ + r % T_) * D, acc.data() + r * D, D * sizeof(float));
    }
    _tile_release();
  });
}
#endif

// One task per (sequence, KV head, query position): the `group` query heads that share the KV
// head see the same keys (one mask row), so each tile of ATT_TK keys is read into L1 once and used by
// all of them, first for the scores (4 keys at a time per head; with AMX, every head against 16
// keys in one tile product: bf16, 9 heads over 3 KV heads, D 64, 300 keys a sequence in blocks of
// 16 slots, 2 threads, the call took 42 / 95 / 247 / 496 / 872 us at 1 / 4 / 4x3 / 16 / 32
// sequences x queries, against 76 / 146 / 376 / 583 / 1101 with dots), then, after each head's max, exp
// and sum in key order, for the weighted sums of the values (blocks of up to 8 vectors of a
// head's output held in registers across the tile). Every output element is the same arithmetic
// as one head and one key at a time: score = (q . k) * scale; acc[d] = fma(e_j, v_j[d], acc[d])
// in key order from 0; out = acc * (1 / sum). On AMX with several query positions (a verify
// block) and enough sequences, one task per (sequence, KV head) instead: attention_amx_queries.
template <typename T, typename Rows>
void attention_impl(const at::Tensor& q, const Rows& rows, int64_t Hkv, int64_t L, const at::Tensor& mask,
                    double scale, const float* sinks, at::Tensor& out) {
  const int64_t S = q.size(0), H = q.size(1), T_ = q.size(2), D = q.size(3);
  const int64_t G = H / Hkv;
  const T* qp = q.data_ptr<T>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const auto qs = q.strides(), ms = mask.strides();
  const float sc = static_cast<float>(scale);
  constexpr int KB = 8;
  // the scores on AMX (bf16, D a multiple of 32, at most 16 heads a KV head; amx_scores) for
  // every call of a process where it runs, else dots
  bool amx = false;
#if DFLASH_AMX
  if constexpr (std::is_same_v<T, c10::BFloat16>) amx = D % 32 == 0 && G <= 16 && qs[1] > 0 && amx_ready();
#endif
  const int64_t Lp = (L + 15) / 16 * 16 + 16;  // a score row (room for a last tile of 16 keys)
#if DFLASH_AMX
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // (with fewer (sequence, KV head) tasks than two a thread, the threads' loads are too uneven:
    // a batch-1 verify's 3 tasks took 1.07x its 12 per-position ones on 2 threads)
    if (amx && T_ > 1 && G * T_ <= 16 && S * Hkv >= 2 * at::get_num_threads())
      return attention_amx_queries(q, rows, Hkv, L, mask, sc, sinks, Lp, out);
  }
#endif
  at::parallel_for(0, S * Hkv * T_, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> score(G * Lp), qf(G * D), acc(G * D), sum(G), maxes(G);
    std::vector<const T*> krow(L), vrow(L);
#if DFLASH_AMX
    std::vector<uint32_t> btv(amx ? D * 8 + 16 : 0);  // the keys' tile: D / 32 KiB, 64-byte aligned
    uint32_t* bt = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(btv.data()) + 63) & ~uintptr_t{63});
    if (amx) amx_score_config(static_cast<int>(G));
#endif
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / (Hkv * T_), hk = (i / T_) % Hkv, t = i % T_;
      for (int64_t g = 0; g < G; ++g) {
        const T* qrow = qp + s * qs[0] + (hk * G + g) * qs[1] + t * qs[2];
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(qrow[d]);
      }
      const bool* mrow = mp + s * ms[0] + t * ms[2];
      int64_t n = 0;
      for (int64_t l = 0; l < L; ++l) {
        if (!mrow[l * ms[3]]) continue;  // a masked key is never read (a paged table's padding slots included)
        krow[n] = rows.key(s, hk, l);
        vrow[n++] = rows.value(s, hk, l);
      }
      for (int64_t j0 = 0; j0 < n; j0 += ATT_TK) {
        const int64_t j1 = std::min(n, j0 + ATT_TK);
        prefetch_tile(krow.data(), vrow.data(), j0, n, D);
#if DFLASH_AMX
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (amx) {
            const T* q0 = qp + s * qs[0] + hk * G * qs[1] + t * qs[2];
            for (int64_t j = j0; j < j1; j += 16)
              amx_scores(q0, qs[1], krow.data() + j, static_cast<int>(std::min<int64_t>(16, j1 - j)), D, bt,
                         score.data() + j, Lp);
            continue;
          }
        }
#endif
        for (int64_t g = 0; g < G; ++g) {
          float* sg = score.data() + g * Lp;
          int64_t j = j0;
          for (; j + KB <= j1; j += KB) dots<KB>(qf.data() + g * D, krow.data() + j, D, sg + j);
          for (; j < j1; ++j) dots<1>(qf.data() + g * D, krow.data() + j, D, sg + j);
        }
      }
      softmax_values(score.data(), Lp, G, n, sc, sinks ? sinks + hk * G : nullptr, 1, nullptr, L, vrow.data(), D,
                     sum.data(), maxes.data(), acc.data());
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(op + ((s * H + hk * G + g) * T_ + t) * D, acc.data() + g * D, D * sizeof(float));
    }
#if DFLASH_AMX
    if (amx) _tile_release();
#endif
  });
}

// The tail both attention ops share: sinks read as fp32, the fp32 output, the dispatch on the
// dtype to attention_impl over Rows<T>(rows...) (the key / value locator)
template <template <typename> class Rows, typename... A>
at::Tensor attend(const char* op, const at::Tensor& q, int64_t Hkv, int64_t L, const at::Tensor& mask, double scale,
                  const std::optional<at::Tensor>& sinks, const A&... rows) {
  TORCH_CHECK(mask.scalar_type() == at::kBool, op, ": mask must be bool");
  const at::Tensor m = mask.expand({q.size(0), 1, q.size(2), L});
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  at::Tensor sk;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == q.size(1), op, ": sinks must be [H] (", q.size(1), ")");
    sk = sinks->to(at::kFloat).contiguous();
  }
  const float* sp = sinks.has_value() ? sk.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), q.size(3)}, q.options().dtype(at::kFloat));
  if (q.scalar_type() == at::kBFloat16) {
    attention_impl<c10::BFloat16>(qc, Rows<c10::BFloat16>(rows...), Hkv, L, m, scale, sp, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, op, ": fp32 or bf16 expected");
    attention_impl<float>(qc, Rows<float>(rows...), Hkv, L, m, scale, sp, out);
  }
  return out;
}

at::Tensor bi_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                        double scale, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4, "bi_attention: 4-d tensors expected");
  TORCH_CHECK(k.sizes() == v.sizes(), "bi_attention: k and v shapes differ");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), "bi_attention: q [S, H, T, D] vs k [S, Hkv, L, D]");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "bi_attention: ", q.size(1), " query heads over ", k.size(1), " KV heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "bi_attention: mixed dtypes");
  auto last = [](const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); };
  const at::Tensor kc = last(k), vc = last(v);
  return attend<StridedRows>("bi_attention", q, k.size(1), k.size(2), mask, scale, sinks, kc, vc);
}

// bi_attention with each sequence's keys read from the KV pools through its slot table instead
// of a gathered copy: the same rows, hence the same arithmetic and the same bits
at::Tensor bi_paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                              const at::Tensor& slots, const at::Tensor& mask, double scale,
                              const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 4 && k_pool.dim() == 3 && v_pool.dim() == 3 && slots.dim() == 2 && mask.dim() == 4,
              "bi_paged_attention: q [S, H, T, D], pools [slots, Hkv, D], slots [S, L], mask [S|1, 1, T, L] expected");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes(), "bi_paged_attention: k and v pools differ");
  TORCH_CHECK(q.size(0) == slots.size(0) && q.size(3) == k_pool.size(2), "bi_paged_attention: q vs pools / slots");
  TORCH_CHECK(q.size(1) % k_pool.size(1) == 0, "bi_paged_attention: ", q.size(1), " query heads over ", k_pool.size(1),
              " KV heads");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && k_pool.scalar_type() == v_pool.scalar_type(),
              "bi_paged_attention: mixed dtypes");
  TORCH_CHECK(slots.scalar_type() == at::kLong, "bi_paged_attention: slots must be int64");
  TORCH_CHECK(k_pool.stride(2) == 1 && v_pool.stride(2) == 1, "bi_paged_attention: pools must be contiguous in D");
  const at::Tensor st = slots.contiguous();
  return attend<PagedRows>("bi_paged_attention", q, k_pool.size(1), slots.size(1), mask, scale, sinks, k_pool, v_pool,
                           st);
}

template <typename T>
void rms_norm_impl(const T* x, const T* w, int64_t M, int64_t D, float eps, T* out) {
  // rows are independent: threads take whole rows (>= ~64K elements a task, so a decode step's
  // few rows run on the calling thread)
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, D));
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const T* xr = x + m * D;
      vf acc = {};
      int64_t d = 0;
      for (; d + VL <= D; d += VL) {
        const vf v = loadv(xr + d);
        acc = fmav(v, v, acc);
      }
      float ss = D >= VL ? hsum(acc) : 0.f;
      for (; d < D; ++d) ss = std::fma(to_float(xr[d]), to_float(xr[d]), ss);
      const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
      T* o = out + m * D;
      for (int64_t e = 0; e < D; ++e) {
        const T y = static_cast<T>(to_float(xr[e]) * r);
        store(o + e, to_float(w[e]) * to_float(y));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0), "rms_norm: x [M, D] and w [D] expected");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: x and w dtypes differ");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    rms_norm_impl(xc.data_ptr<c10::BFloat16>(), wc.data_ptr<c10::BFloat16>(), x.size(0), x.size(1),
                  static_cast<float>(eps), out.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rms_norm: fp32 or bf16 expected");
    rms_norm_impl(xc.data_ptr<float>(), wc.data_ptr<float>(), x.size(0), x.size(1), static_cast<float>(eps),
                  out.data_ptr<float>());
  }
  return out;
}

// one value rounded to T as an ATen op on T tensors rounds its fp32 result (nearest even)
template <typename T>
inline float as_t(float v) {
  return static_cast<float>(static_cast<T>(v));
}

#if defined(__AVX512F__)
// as_t for VL values: bf16's round to nearest even (c10::BFloat16's: a NaN becomes 0x7FC0) back
// in fp32; fp32 as it is
template <typename T>
inline vf rope_round(vf v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const vu bits = (vu)v;
    vu r = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) & 0xFFFF0000u;
    r = v != v ? vu{} + 0x7FC00000u : r;
    return (vf)r;
  }
}

// VL values stored as fp32 or rounded to bf16 (rope_round's rule)
inline void rope_store(float* o, vf v) { std::memcpy(o, &v, sizeof(v)); }
inline void rope_store(c10::BFloat16* o, vf v) {
  const vh h = __builtin_convertvector((vu)rope_round<c10::BFloat16>(v) >> 16, vh);
  std::memcpy(o, &h, sizeof(h));
}
#endif

template <typename T>
void rope_impl(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), D = x.size(3), half = D / 2;
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xb = x.stride(0), xh = x.stride(1), xl = x.stride(2);
  const int64_t cb = cos.stride(0), cl = cos.stride(2), sb = sin.stride(0), sl = sin.stride(2);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t l = 0; l < L; ++l) {
        const T* xr = xp + b * xb + h * xh + l * xl;
        const T* cr = cp + b * cb + l * cl;
        const T* sr = sp + b * sb + l * sl;
        T* o = op + ((b * H + h) * L + l) * D;
        int64_t i = 0;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>) {
          if (half % VL == 0) {  // VL lanes at a time, the same roundings (rope_round)
            for (; i < D; i += VL) {
              const vf a = rope_round<T>(loadv(xr + i) * loadv(cr + i));
              const vf r = rope_round<T>(loadv(xr + (i + half) % D) * loadv(sr + i));
              rope_store(o + i, a + r);
            }
          }
        }
#endif
        for (; i < D; ++i) {
          const float a = as_t<T>(static_cast<float>(xr[i]) * static_cast<float>(cr[i]));
          const float r = as_t<T>(static_cast<float>(xr[(i + half) % D]) * static_cast<float>(sr[i]));
          o[i] = static_cast<T>(a + r);
        }
      }
}

// x [B, H, T, D] (any strides; the last one 1) rotated by cos / sin [B, 1, T, D] of x's dtype:
// x * cos + roll(x, D / 2) * sin (models/layers.apply_rope) with each op's fp32 result rounded
// to the dtype as ATen's mul and add round it, so the same values as those three ops and the
// roll, in one pass (they cost ~30 us a layer in calls); [B, H, T, D] contiguous. Another
// dtype mix: the ATen ops.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto dt = x.scalar_type();
  const bool own = x.dim() == 4 && cos.dim() == 4 && sin.dim() == 4 && cos.scalar_type() == dt &&
                   sin.scalar_type() == dt && x.stride(3) == 1 && cos.stride(3) == 1 && sin.stride(3) == 1 &&
                   x.size(3) % 2 == 0 && cos.size(0) == x.size(0) && cos.size(1) == 1 && cos.size(2) == x.size(2) &&
                   cos.size(3) == x.size(3) && sin.sizes() == cos.sizes() &&
                   (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf);
  if (!own) return at::add(at::mul(x, cos), at::mul(at::roll(x, {x.size(-1) / 2}, {-1}), sin));
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (dt == at::kFloat) rope_impl<float>(x, cos, sin, out);
  else if (dt == at::kBFloat16) rope_impl<c10::BFloat16>(x, cos, sin, out);
  else rope_impl<c10::Half>(x, cos, sin, out);
  return out;
}

// pool[slots[i]] = rows[i] (the paged KV cache's write, as index_put_ writes it): rows [N, ...]
// (any strides) in the pool's dtype, pool [slots, ...] contiguous; a row copy each instead of
// index_put_'s ~9 us a call. Another dtype or layout: index_put_.
void write_rows(at::Tensor& pool, const at::Tensor& slots, const at::Tensor& rows) {
  if (rows.scalar_type() != pool.scalar_type() || !pool.is_contiguous() || slots.scalar_type() != at::kLong ||
      rows.dim() != 3 || pool.dim() != 3 || rows.size(1) != pool.size(1) || rows.size(2) != pool.size(2) ||
      rows.stride(2) != 1) {
    pool.index_put_({slots}, rows);
    return;
  }
  const at::Tensor sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t n = rows.size(0), heads = rows.size(1), d = rows.size(2), es = pool.element_size();
  const int64_t slots_n = pool.size(0);
  auto* pp = static_cast<char*>(pool.data_ptr());
  const auto* rp = static_cast<const char*>(rows.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < slots_n, "dense_layer: KV slot ", sp[i], " outside the pool of ", slots_n);
    for (int64_t j = 0; j < heads; ++j)
      std::memcpy(pp + ((sp[i] * heads + j) * d) * es, rp + (i * rows.stride(0) + j * rows.stride(1)) * es, d * es);
  }
}

// RMSNorm.forward with the kernel: over the last dimension, the input's shape kept
at::Tensor norm_last(const at::Tensor& x, const at::Tensor& w, double eps) {
  return rms_norm(x.reshape({-1, x.size(-1)}), w, eps).view(x.sizes());
}

// One of dense_layer's linears [..., K] -> [..., n], as its module computes it: kind 0
// BatchInvariantLinear (w its packed panels), kind > 0 Int4Linear of that group size (int4_linear), kind -1
// Int8Linear (int8_linear) (quantization/packed.PackedLinear.forward: x in the scales' dtype, the GEMM, + bias
// in the GEMM's dtype, back to x's dtype)
at::Tensor layer_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scales,
                        const std::optional<at::Tensor>& bias, int64_t kind, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor x2 = x.reshape({-1, x.size(-1)});
  if (kind == 0) return linear_packed(x2, w, n, bias).view(shape);
  TORCH_CHECK(scales.has_value(), "dense_layer: a packed int linear without scales");
  if (x2.scalar_type() != scales->scalar_type()) x2 = x2.to(scales->scalar_type());
  at::Tensor y = kind > 0 ? int4_linear(x2, w, *scales, n, kind, std::nullopt) : int8_linear(x2, w, *scales, n, std::nullopt);
  if (bias.has_value()) y = at::add(y, bias->scalar_type() == y.scalar_type() ? *bias : bias->to(y.scalar_type()));
  if (y.scalar_type() != x.scalar_type()) y = y.to(x.scalar_type());
  return y.view(shape);
}

// TargetLayer.forward (attention, then the gated MLP, each with a residual) over the paged KV
// pools: see the header. The linears qkv, o, gate_up, down as lists of four (weights, scales,
// biases, kinds: see layer_linear); dims = (heads, KV heads, head dim, hidden, intermediate);
// q_norm / k_norm for Qwen3-style layers; sinks for gpt-oss-style attention. Uniform queries (S
// sequences of Tq each, in order) are attended as views; ragged ones (a decode step beside a
// verify block) through query_index [S, Tq] (padding: N, a zero row) and query_rows [N] (each
// packed query's row of the padded [S * Tq] output), the gathers of models/layers._attend.
at::Tensor dense_layer(const at::Tensor& x, const at::Tensor& attn_norm, const at::Tensor& mlp_norm, double eps,
                       at::TensorList weights, const c10::List<std::optional<at::Tensor>>& scales,
                       const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef kinds,
                       const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                       const std::optional<at::Tensor>& sinks, at::IntArrayRef dims, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& write_slots,
                       const at::Tensor& read_slots, const at::Tensor& mask, double scale,
                       const std::optional<at::Tensor>& query_index, const std::optional<at::Tensor>& query_rows,
                       at::TensorList group_read_slots, at::TensorList group_masks, at::TensorList group_index,
                       at::TensorList group_rows, at::TensorList group_out) {
  TORCH_CHECK(dims.size() == 5, "dense_layer: dims = (heads, KV heads, head dim, hidden, intermediate)");
  TORCH_CHECK(weights.size() == 4 && scales.size() == 4 && biases.size() == 4 && kinds.size() == 4,
              "dense_layer: four linears (qkv, o, gate_up, down) expected");
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "dense_layer: x [1, N, hidden] expected");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "dense_layer: q_norm and k_norm go together");
  const int64_t h = dims[0], hkv = dims[1], d = dims[2], hidden = dims[3], inter = dims[4];
  const int64_t b = x.size(0), t = x.size(1);
  const int64_t s = mask.size(0), tq = mask.size(2);
  const size_t groups = group_read_slots.size();
  TORCH_CHECK(group_masks.size() == groups && group_index.size() == groups && group_rows.size() == groups &&
                  group_out.size() == groups,
              "dense_layer: per group its read slots, mask, query index, query rows and output rows");
  TORCH_CHECK(query_index.has_value() == query_rows.has_value(), "dense_layer: query_index and query_rows go together");
  const bool ragged = query_index.has_value();
  TORCH_CHECK(groups || (ragged ? query_rows->size(0) == t && query_index->size(0) == s && query_index->size(1) == tq
                                : s * tq == t),
              "dense_layer: ", s, " sequences of ", tq, " queries for ", t, " tokens");
  auto linear = [&](const at::Tensor& v, int i, int64_t n) {
    return layer_linear(v, weights[i], scales.get(i), biases.get(i), kinds[i], n);
  };
  // attention
  const at::Tensor qkv = linear(norm_last(x, attn_norm, eps), 0, (h + 2 * hkv) * d);
  const at::Tensor v = qkv.slice(-1, (h + hkv) * d).view({b, t, hkv, d});
  at::Tensor q, k;
  if (!q_norm.has_value()) {  // q and k rotated together
    const at::Tensor qk = rope(qkv.slice(-1, 0, (h + hkv) * d).view({b, t, h + hkv, d}).transpose(1, 2), cos, sin);
    q = qk.slice(1, 0, h);
    k = qk.slice(1, h).transpose(1, 2);
  } else {
    const std::vector<at::Tensor> parts = qkv.slice(-1, 0, (h + hkv) * d).split_with_sizes({h * d, hkv * d}, -1);
    q = rope(norm_last(parts[0].view({b, t, h, d}), *q_norm, eps).transpose(1, 2), cos, sin);
    k = rope(norm_last(parts[1].view({b, t, hkv, d}), *k_norm, eps).transpose(1, 2), cos, sin).transpose(1, 2);
  }
  const at::Tensor slots = write_slots.reshape({-1});
  write_rows(k_pool, slots, k.select(0, 0));
  write_rows(v_pool, slots, v.select(0, 0));
  // the queries gathered by `index` [S_g, Tq_g] (padding: t) over `read` and `m`, their outputs
  // [n, H, D] in the order of `rows` (flat indices into S_g * Tq_g); padding queries see no key
  // here (the kernel writes them zeros, at no cost), not every key
  at::Tensor qpad;  // [N + 1, H, D], made on first use
  auto gathered = [&](const at::Tensor& index, const at::Tensor& rows, const at::Tensor& read, const at::Tensor& m) {
    if (!qpad.defined()) qpad = at::cat({q.select(0, 0).transpose(0, 1), at::zeros({1, h, d}, q.options())});
    const int64_t sg = index.size(0), tg = index.size(1);
    const at::Tensor qs = qpad.index_select(0, index.reshape({-1})).view({sg, tg, h, d}).transpose(1, 2);
    const at::Tensor valid_mask = m.logical_and(index.lt(t).view({sg, 1, tg, 1}));
    const at::Tensor att = bi_paged_attention(qs, k_pool, v_pool, read, valid_mask, scale, sinks).to(x.scalar_type());
    return att.transpose(1, 2).reshape({sg * tg, h, d}).index_select(0, rows);
  };
  at::Tensor att_rows;  // [1, N, H * D]
  if (groups) {  // attention groups (a prompt chunk beside verify blocks): each gathered, into its rows
    at::Tensor out = at::empty({t, h, d}, x.options());
    for (size_t g = 0; g < groups; ++g)
      out.index_copy_(0, group_out[g], gathered(group_index[g], group_rows[g], group_read_slots[g], group_masks[g]));
    att_rows = out.view({1, t, h * d});
  } else if (!ragged) {
    const at::Tensor qs = q.select(0, 0).view({h, s, tq, d}).transpose(0, 1);
    const at::Tensor att = bi_paged_attention(qs, k_pool, v_pool, read_slots, mask, scale, sinks).to(x.scalar_type());
    att_rows = att.transpose(1, 2).reshape({1, t, h * d});
  } else {
    att_rows = gathered(*query_index, *query_rows, read_slots, mask).reshape({1, t, h * d});
  }
  const at::Tensor x1 = at::add(x, linear(att_rows, 1, hidden));
  // the gated MLP
  const std::vector<at::Tensor> gu = linear(norm_last(x1, mlp_norm, eps), 2, 2 * inter).split(inter, -1);
  return at::add(x1, linear(at::mul(at::silu(gu[0]), gu[1]), 3, hidden));
}

}  // namespace

TORCH_LIBRARY(dflash_cpu, m) {
  m.def("bi_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("bi_pack(Tensor w) -> Tensor");
  m.def("bf16_gemm() -> str", &bf16_gemm);
  m.def("bi_linear_packed(Tensor x, Tensor wp, int n, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, int n, int group_size, Tensor? bias) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales, int n, Tensor? bias) -> Tensor");
  m.def("bi_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, Tensor? sinks=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def(
      "bi_paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor mask, float scale, "
      "Tensor? sinks=None) -> Tensor");
  m.def(
      "dense_layer(Tensor x, Tensor attn_norm, Tensor mlp_norm, float eps, Tensor[] weights, Tensor?[] scales, "
      "Tensor?[] biases, int[] kinds, Tensor? q_norm, Tensor? k_norm, Tensor? sinks, int[] dims, Tensor cos, "
      "Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor write_slots, Tensor read_slots, Tensor mask, "
      "float scale, Tensor? query_index, Tensor? query_rows, Tensor[] group_read_slots, Tensor[] group_masks, "
      "Tensor[] group_index, Tensor[] group_rows, Tensor[] group_out) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash_cpu, CPU, m) {
  m.impl("bi_linear", &bi_linear);
  m.impl("bi_pack", &bi_pack);
  m.impl("bi_linear_packed", &linear_packed);
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("bi_attention", &bi_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("bi_paged_attention", &bi_paged_attention);
  m.impl("dense_layer", &dense_layer);
}
