// The paged attention metadata of one packed forward, built on the host in one call
// (runtime/attention_meta.py: MetaPlan.build computes the same tensors with ~25 vectorized torch
// ops, ~10 us of dispatch each on the CPU, where the plan's sizes are a few hundred integers).
//
// dflash_cpu::paged_meta_positions(starts [S], lengths [S], tables [S, W], pre_positions [P],
//     pre_slots [P], tpb, tokens) -> [positions [1, P + tokens], write_slots [1, P + tokens]]
//     (int64): the pre rows, then sequence i's positions starts[i] .. starts[i] + lengths[i] - 1
//     and their slots tables[i, p / tpb] * tpb + p % tpb, in sequence order.
// dflash_cpu::paged_meta_group(starts, lengths, query_from, qlen, lo, tables, idx [S_g], kv_len,
//     tq, queries, tpb, spare_slot, window, causal, target_window, gathers) -> [read_slots
//     [S_g, kv_len] int64, mask [S_g, 1, tq, kv_len] bool, sliding_mask (bool like mask, or empty),
//     query_rows, query_out ([valid queries] int64), query_index [S_g, tq] int64, query_valid
//     [S_g, tq] bool (the last four empty without gathers)]: for group row r (sequence i =
//     idx[r], end e = starts[i] + lengths[i]), key column j is position lo[i] + j, read from its
//     slot while j < e - lo[i], else from spare_slot; query t (valid while t < qlen[i]) sits at
//     e - qlen[i] + t (0 when not valid); a causal query sees keys at or before its position, a
//     non-causal one every key before e; window > 0 also hides keys with q - k >= window
//     (z-lab's sliding rule); target_window > 0 (causal only) gives the sliding mask, q - k <
//     target_window on top of the causal rule; invalid (padding) queries see every key.
//     Gathers: the valid queries in packed order, row r * tq + u at packed index query_from[i] + u;
//     query_index of a padding query is `queries`.
// All int64 inputs are contiguous CPU tensors (the planner's); nothing here is floating point.

// (ATen and the op registry only: no Python headers, which a runtime image does not have)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

const int64_t* i64(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(), "paged_meta: ", name,
              " must be a contiguous int64 CPU tensor");
  return t.data_ptr<int64_t>();
}

std::vector<at::Tensor> paged_meta_positions(const at::Tensor& starts, const at::Tensor& lengths,
                                             const at::Tensor& tables, const at::Tensor& pre_positions,
                                             const at::Tensor& pre_slots, int64_t tpb, int64_t tokens) {
  const int64_t S = starts.size(0), W = tables.size(1), P = pre_positions.size(0);
  const int64_t *st = i64(starts, "starts"), *ln = i64(lengths, "lengths"), *tb = i64(tables, "tables");
  const int64_t *pp = i64(pre_positions, "pre_positions"), *ps = i64(pre_slots, "pre_slots");
  at::Tensor pos = at::empty({1, P + tokens}, at::kLong), slots = at::empty({1, P + tokens}, at::kLong);
  int64_t *po = pos.data_ptr<int64_t>(), *so = slots.data_ptr<int64_t>();
  for (int64_t n = 0; n < P; ++n) po[n] = pp[n], so[n] = ps[n];
  int64_t n = P;
  for (int64_t i = 0; i < S; ++i)
    for (int64_t u = 0; u < ln[i]; ++u, ++n) {
      TORCH_CHECK(n < P + tokens, "paged_meta_positions: more written tokens than ", tokens);
      const int64_t p = st[i] + u;
      po[n] = p;
      so[n] = tb[i * W + p / tpb] * tpb + p % tpb;
    }
  TORCH_CHECK(n == P + tokens, "paged_meta_positions: ", n - P, " written tokens, expected ", tokens);
  return {pos, slots};
}

std::vector<at::Tensor> paged_meta_group(const at::Tensor& starts, const at::Tensor& lengths,
                                         const at::Tensor& query_from, const at::Tensor& qlen, const at::Tensor& lo,
                                         const at::Tensor& tables, const at::Tensor& idx, int64_t kv_len, int64_t tq,
                                         int64_t queries, int64_t tpb, int64_t spare_slot, int64_t window, bool causal,
                                         int64_t target_window, bool gathers) {
  const int64_t G = idx.size(0), W = tables.size(1);
  const int64_t *st = i64(starts, "starts"), *ln = i64(lengths, "lengths"), *qf = i64(query_from, "query_from");
  const int64_t *ql = i64(qlen, "qlen"), *lw = i64(lo, "lo"), *tb = i64(tables, "tables"), *ix = i64(idx, "idx");
  const bool sliding = causal && target_window > 0;
  at::Tensor read = at::empty({G, kv_len}, at::kLong), mask = at::empty({G, 1, tq, kv_len}, at::kBool);
  at::Tensor slide = sliding ? at::empty({G, 1, tq, kv_len}, at::kBool) : at::empty({0}, at::kBool);
  at::Tensor qindex = gathers ? at::empty({G, tq}, at::kLong) : at::empty({0}, at::kLong);
  at::Tensor qvalid = gathers ? at::empty({G, tq}, at::kBool) : at::empty({0}, at::kBool);
  int64_t nq = 0;
  for (int64_t r = 0; r < G; ++r) nq += ql[ix[r]];
  at::Tensor qrows = at::empty({gathers ? nq : 0}, at::kLong), qout = at::empty({gathers ? nq : 0}, at::kLong);
  int64_t *rd = read.data_ptr<int64_t>(), *qi = qindex.data_ptr<int64_t>();
  int64_t *qr = qrows.data_ptr<int64_t>(), *qo = qout.data_ptr<int64_t>();
  bool *mk = mask.data_ptr<bool>(), *sl = sliding ? slide.data_ptr<bool>() : nullptr, *qv = qvalid.data_ptr<bool>();
  int64_t q = 0;
  for (int64_t r = 0; r < G; ++r) {
    const int64_t i = ix[r], e = st[i] + ln[i], l0 = lw[i], n = ql[i];
    for (int64_t j = 0; j < kv_len; ++j) {
      const int64_t key = l0 + j, block = std::min(key / tpb, W - 1);
      rd[r * kv_len + j] = j < e - l0 ? tb[i * W + block] * tpb + key % tpb : spare_slot;
    }
    for (int64_t t = 0; t < tq; ++t) {
      const bool valid = t < n;
      const int64_t qp = valid ? e - n + t : 0;
      bool* m = mk + (r * tq + t) * kv_len;
      bool* s = sliding ? sl + (r * tq + t) * kv_len : nullptr;
      for (int64_t j = 0; j < kv_len; ++j) {
        const int64_t key = l0 + j;
        bool v = causal ? key <= qp : key < e;
        if (window > 0) v = v && qp - key < window;
        if (s) s[j] = (v && qp - key < target_window) || !valid;
        m[j] = v || !valid;
      }
      if (gathers) {
        qi[r * tq + t] = valid ? qf[i] + t : queries;
        qv[r * tq + t] = valid;
      }
    }
    if (gathers)
      for (int64_t u = 0; u < n; ++u, ++q) {
        qr[q] = r * tq + u;
        qo[q] = qf[i] + u;
      }
  }
  return {read, mask, slide, qrows, qout, qindex, qvalid};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash_cpu, m) {
  m.def(
      "paged_meta_positions(Tensor starts, Tensor lengths, Tensor tables, Tensor pre_positions, Tensor pre_slots, "
      "int tpb, int tokens) -> Tensor[]");
  m.def(
      "paged_meta_group(Tensor starts, Tensor lengths, Tensor query_from, Tensor qlen, Tensor lo, Tensor tables, "
      "Tensor idx, int kv_len, int tq, int queries, int tpb, int spare_slot, int window, bool causal, "
      "int target_window, bool gathers) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(dflash_cpu, CPU, m) {
  m.impl("paged_meta_positions", &paged_meta_positions);
  m.impl("paged_meta_group", &paged_meta_group);
}
