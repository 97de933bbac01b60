// Fused CPU decode kernel of tinyattn: Quest page scoring + top-k selection + paged attention in one call.
//
// Why a compiled kernel: on a CPU every PyTorch call costs 1-5 us whatever its size, and a sparse decode layer
// written with PyTorch ops is ~29 calls (docs/benchmarks.md, "Per-call overhead"); this kernel is one call per
// layer. It also reads each selected page in place (no gather into a copy) and reads every K/V row once for all
// query heads of its group.
//
// Work item: one (row b, KV head h). For it:
//   1. the pages to attend: the listed `page_indices` (sorted, de-duplicated, -1 / past-the-end dropped), or the
//      Quest selection (score every valid page by ub = q+ . k_max + q- . k_min, max over the group's query heads
//      and the Tq queries; forced recent pages, then sink pages, then the highest bounds, ties to the lower page;
//      NaN counts as -inf), or every valid page (dense);
//   2. attention over those pages with an online softmax per page (Milakov & Gimelshein 2018; FlashAttention's
//      recurrence): causal bottom-right for Tq > 1, sliding window `window_left` (FlashInfer's convention).
// A query that sees no key gets out = 0 and lse = -inf (never NaN).
//
// Speed (docs/benchmarks.md, "The compiled CPU kernel"): the kernel is bound by memory reads, so it reads boxes
// and pages in memory order and prefetches the next page (software: each page sits at a random place of the
// pool, where the hardware prefetcher does not follow); on AVX-512 CPUs the dot products, the exp and the value
// sums run in the micro-kernels of paged_decode_avx512.h (16 dots per reduction tree, accumulators in
// registers), elsewhere in the portable `omp simd` loops below.
//
// Layouts (DESIGN.md §2): q [B, Tq, Hq, D] (or [B, Hq, D]: Tq = 1) contiguous; k_cache / v_cache [num_pages,
// page_size, Hkv, D] with unit stride in D (other strides free); k_min / k_max [num_pages, Hkv, D] (unit stride in
// D); block_table [B, M] int32, seq_lens [B] int32, page_indices [B, Hkv, K] int32 (all contiguous); out like q;
// lse [B, (Tq,) Hq] fp32.
// Offsets are int64 throughout. The Python side (tinyattn/kernels_cpu/__init__.py) checks what this file assumes.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "paged_decode_avx512.h"

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();
constexpr float kSinkKey = std::numeric_limits<float>::max();   // recent (+inf) > sink (FLT_MAX) > any bound
constexpr float kScoreCap = 3.0e38f;                            // +inf bounds rank below the sink key

// exp(x) for x <= 0 (logit - running max), 0 for x < -87 (and -inf): Cephes' expf polynomial, branch-free so the
// page loop vectorises (std::exp does not), ~2 ulp.
inline float exp_nonpos(float x) {
  const float masked = x < -87.0f ? 0.0f : 1.0f;
  x = std::max(x, -87.0f);
  const float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  x = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  // 2^fx, fx in [-126, 0], through a union: gcc vectorises it (a __builtin_bit_cast became a memset that kept
  // the page loop scalar)
  union { int32_t i; float f; } two_fx;
  two_fx.i = (static_cast<int32_t>(fx) + 127) << 23;
  return y * two_fx.f * masked;
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// D values of a row as fp32: the row itself for fp32 storage, else converted into `buf`.
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) { return src; }

struct Problem {
  int64_t B, Tq, Hq, Hkv, G, D, S, M, Mp, Ms;  // M = Tq * G queries per (row, KV head); Mp, Ms: M padded for
                                              // the attention's and the bound's query blocks
  int64_t max_pages;                          // columns of block_table
  int64_t k_sP, k_sS, k_sH, v_sP, v_sS, v_sH; // pool strides (elements)
  int64_t b_sP, b_sH;                         // box strides
  int64_t budget, num_sink, num_recent, K_listed;
  int64_t window_left;
  float scale;
  const int32_t* block_table;
  const int32_t* seq_lens;
  const int32_t* page_indices;               // nullptr unless listed
  int32_t* selected;                         // nullptr, or [B, Hkv, budget] output of the Quest selection
  bool select;
  int64_t n_pages(int64_t b) const { return (std::max<int32_t>(seq_lens[b], 0) + S - 1) / S; }
  // first page a query's window can reach: dense runs and the selection skip the pages wholly before it
  int64_t first_page(int64_t b) const {
    return window_left < 0 ? 0 : std::max<int64_t>(seq_lens[b] - Tq - window_left, 0) / S;
  }
  bool selects(int64_t b) const { return select && n_pages(b) > budget; }
};

// ------------------------------------------------------------------------------------------------ selection
constexpr int64_t kBoxPrefetchPages = 4;   // boxes prefetched this many pages ahead (one group of 4)

// ub[m * 4 + t] = q-_m . k_min_t + q+_m . k_max_t: four queries (rows of n0 / p0, D apart) on the boxes of four
// pages of one head (pages past n_pages repeat page 0; their bounds are ignored).
inline void bounds_block(const float* const* lo, const float* const* hi, int64_t n_pages, const float* n0,
                         const float* p0, int64_t D, float* ub) {
#if TINYATTN_AVX512
  if (D % 16 == 0) {
    _mm512_storeu_ps(ub, avx512::block_bounds(lo, hi, n0, p0, D));
    return;
  }
#endif
  for (int64_t t = 0; t < n_pages; ++t) {
    const float* __restrict l = lo[t];
    const float* __restrict u = hi[t];
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t d = 0; d < D; ++d) {
      a0 += n0[d] * l[d];               // two statements: two FMAs (one expression became mul + fma + add)
      a0 += p0[d] * u[d];
      a1 += n0[D + d] * l[d];
      a1 += p0[D + d] * u[d];
      a2 += n0[2 * D + d] * l[d];
      a2 += p0[2 * D + d] * u[d];
      a3 += n0[3 * D + d] * l[d];
      a3 += p0[3 * D + d] * u[d];
    }
    ub[t] = a0, ub[4 + t] = a1, ub[8 + t] = a2, ub[12 + t] = a3;
  }
}

// Quest bound of pages [j0, j1) of row b, into scores [B, Hkv, max_pages]: groups of four pages, heads inner,
// so that the boxes are read in their memory order ([num_pages, Hkv, D]: the heads of a page are adjacent).
template <typename BT>
void score_pages(const Problem& p, int64_t b, int64_t j0, int64_t j1, const float* q_neg, const float* q_pos,
                 const BT* k_min, const BT* k_max, float* scores) {
  const int64_t D = p.D, Ms = p.Ms;
  const int32_t* table = p.block_table + b * p.max_pages;
  std::vector<float> box(8 * D);
  auto row = [&](const BT* pool, int64_t phys, int64_t h) { return pool + phys * p.b_sP + h * p.b_sH; };
  for (int64_t j = j0; j < j1; j += 4) {
    const int64_t nj = std::min<int64_t>(4, j1 - j);
    for (int64_t h = 0; h < p.Hkv; ++h) {
      // each page's boxes are a block of the pool at a random place, where the hardware prefetcher does not
      // follow: prefetch those of the next group, a head at a time
      for (int64_t a = j + kBoxPrefetchPages; a < std::min(j + kBoxPrefetchPages + 4, j1); ++a)
        for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(BT)); off += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(row(k_min, table[a], h)) + off, 0, 3);
          __builtin_prefetch(reinterpret_cast<const char*>(row(k_max, table[a], h)) + off, 0, 3);
        }
      const float* lo[4];
      const float* hi[4];
      for (int64_t t = 0; t < 4; ++t) {
        lo[t] = t < nj ? as_float(row(k_min, table[j + t], h), box.data() + 2 * t * D, D) : lo[0];
        hi[t] = t < nj ? as_float(row(k_max, table[j + t], h), box.data() + (2 * t + 1) * D, D) : hi[0];
      }
      float key[4] = {kNegInf, kNegInf, kNegInf, kNegInf};
      // padding queries (m >= M) are 0 and skipped
      for (int64_t m0 = 0; m0 < Ms; m0 += 4) {
        const int64_t o = ((b * p.Hkv + h) * Ms + m0) * D;
        alignas(64) float ub[16];
        bounds_block(lo, hi, nj, q_neg + o, q_pos + o, D, ub);
        for (int64_t m = 0; m < 4 && m0 + m < p.M; ++m)
          for (int64_t t = 0; t < nj; ++t)
            if (ub[m * 4 + t] > key[t]) key[t] = ub[m * 4 + t];    // NaN never wins: stays -inf
      }
      for (int64_t t = 0; t < nj; ++t) scores[(b * p.Hkv + h) * p.max_pages + j + t] = std::min(key[t], kScoreCap);
    }
  }
}

// The pages (row b, KV head h) attends to, marked in flags[b, j, h]: the listed pages, the Quest selection
// (forced recent pages, then sinks, then the highest bounds, ties to the lower page), or every page (dense).
void choose_pages(const Problem& p, int64_t b, int64_t h, const float* scores, uint8_t* flags) {
  const int64_t np = p.n_pages(b), n = p.seq_lens[b];
  uint8_t* f = flags + b * p.max_pages * p.Hkv + h;
  auto mark = [&](int64_t j) { f[j * p.Hkv] = 1; };
  if (p.page_indices != nullptr) {
    const int32_t* list = p.page_indices + (b * p.Hkv + h) * p.K_listed;
    for (int64_t k = 0; k < p.K_listed; ++k)
      if (list[k] >= 0 && list[k] < np) mark(list[k]);          // a duplicate marks the same page: counts once
    return;
  }
  const int64_t first = p.first_page(b);
  if (!p.selects(b)) {
    for (int64_t j = first; j < np; ++j) mark(j);
    if (p.selected != nullptr) {                       // a row that fits its budget keeps all its pages
      int32_t* sel = p.selected + (b * p.Hkv + h) * p.budget;
      for (int64_t k = 0; k < p.budget; ++k) sel[k] = k < np ? static_cast<int32_t>(k) : -1;
    }
    return;
  }
  const int64_t recent = std::max<int64_t>(np - std::max<int64_t>(n - p.Tq, 0) / p.S,
                                           std::max<int64_t>(p.num_recent, 1));
  const float* sc = scores + (b * p.Hkv + h) * p.max_pages;
  std::vector<std::pair<float, int64_t>> keyed(np);
  for (int64_t j = 0; j < np; ++j) {
    float key = sc[j];
    if (j >= np - recent) key = kPosInf;
    else if (j < p.num_sink) key = kSinkKey;
    else if (j < first) key = kNegInf;                // wholly before the earliest query's window
    keyed[j] = {key, j};
  }
  auto better = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& c) {
    return a.first > c.first || (a.first == c.first && a.second < c.second);
  };
  std::nth_element(keyed.begin(), keyed.begin() + (p.budget - 1), keyed.end(), better);
  std::vector<int64_t> chosen(p.budget);
  for (int64_t k = 0; k < p.budget; ++k) chosen[k] = keyed[k].second;
  std::sort(chosen.begin(), chosen.end());
  for (int64_t j : chosen) mark(j);
  if (p.selected != nullptr) {
    int32_t* sel = p.selected + (b * p.Hkv + h) * p.budget;
    for (int64_t k = 0; k < p.budget; ++k) sel[k] = static_cast<int32_t>(chosen[k]);
  }
}

// ------------------------------------------------------------------------------------------------ attention
// Running softmax state of every (KV head, query) of one row over a span of its pages.
struct State {
  std::vector<float> m, l, acc;                // [Hkv * Mp], [Hkv * Mp], [Hkv * Mp * D]
  State(int64_t Hkv, int64_t Mp, int64_t D) : m(Hkv * Mp, kNegInf), l(Hkv * Mp, 0.0f), acc(Hkv * Mp * D, 0.0f) {}
};

// The next page a task reads, for prefetching while it works on the current one: the hardware prefetcher stops
// at every 4 KiB page of memory, and one token of a KV page is 4 KiB at 8 heads x 128 fp32 (a page of the pool
// at 16 tokens is 16 such pages), so without help every token starts with a stall.
template <typename T>
struct NextPage {
  const T* k = nullptr;          // first element of the page in the pool (nullptr: no next page)
  const T* v = nullptr;
  const uint8_t* f = nullptr;    // which heads read it
  int64_t n_tok = 0;
};

// Prefetch (into L2: a page is larger than L1) the rows of tokens [s0, s1) of head h of the next page.
template <typename T>
inline void prefetch_rows(const Problem& p, const T* base, int64_t sS, int64_t sH, const NextPage<T>& nx, int64_t h,
                          int64_t s0, int64_t s1) {
  if (base == nullptr || !nx.f[h]) return;
  const int64_t row_bytes = p.D * static_cast<int64_t>(sizeof(T));
  for (int64_t s = s0; s < std::min(s1, nx.n_tok); ++s) {
    const char* r = reinterpret_cast<const char*>(base + s * sS + h * sH);
    for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(r + off, 0, 2);
  }
}

// logits[h, m, s] = (scale * q_m) . k_s of one page for every head that reads it.
template <typename T, int kD, int QB>
void page_logits(const Problem& p, int64_t b, const T* kp, int64_t n_tok, const uint8_t* f, const float* qs,
                 float* logits, float* k_buf, const NextPage<T>& nx) {
  const int64_t D = kD > 0 ? kD : p.D;
  const int64_t S = p.S, Mp = p.Mp, Hkv = p.Hkv;
#if TINYATTN_AVX512
  if constexpr (kD > 0 && kD % 16 == 0) {
    // 16 / QB tokens of one head at a time (16 dots per sum tree); tokens past the page's end repeat row 0 and
    // their dots are dropped (the slots past n_tok may hold anything, NaN included)
    constexpr int TG = 16 / QB;
    for (int64_t s0 = 0; s0 < n_tok; s0 += TG) {
      const int64_t valid = std::min<int64_t>(TG, n_tok - s0);
      for (int64_t h = 0; h < Hkv; ++h) {
        if (!f[h]) continue;
        const float* rows[TG];
        for (int t = 0; t < TG; ++t)
          rows[t] = t < valid ? as_float(kp + (s0 + t) * p.k_sS + h * p.k_sH, k_buf + t * D, D) : rows[0];
        for (int64_t m0 = 0; m0 < Mp; m0 += QB) {
          alignas(64) float dots[16];
          _mm512_store_ps(dots, avx512::block_dots<kD, QB>(rows, qs + ((b * Hkv + h) * Mp + m0) * D));
          for (int m = 0; m < QB; ++m)
            for (int64_t t = 0; t < valid; ++t) logits[(h * Mp + m0 + m) * S + s0 + t] = dots[m * TG + t];
        }
        prefetch_rows(p, nx.k, p.k_sS, p.k_sH, nx, h, s0, s0 + TG);
      }
    }
    return;
  }
#endif
  for (int64_t s = 0; s < n_tok; ++s)
    for (int64_t h = 0; h < Hkv; ++h) {
      if (!f[h]) continue;
      const float* __restrict krow = as_float(kp + s * p.k_sS + h * p.k_sH, k_buf, D);
      float* lg = logits + h * Mp * S + s;
      for (int64_t m0 = 0; m0 < Mp; m0 += QB) {
        const float* __restrict q0 = qs + ((b * Hkv + h) * Mp + m0) * D;
        // named accumulators: gcc keeps them in vector registers (an array reduction it reduces every step)
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
        if constexpr (QB == 4) {
#pragma omp simd reduction(+ : a0, a1, a2, a3)
          for (int64_t d = 0; d < D; ++d) {
            const float kd = krow[d];
            a0 += q0[d] * kd;
            a1 += q0[D + d] * kd;
            a2 += q0[2 * D + d] * kd;
            a3 += q0[3 * D + d] * kd;
          }
        } else if constexpr (QB == 2) {
#pragma omp simd reduction(+ : a0, a1)
          for (int64_t d = 0; d < D; ++d) {
            const float kd = krow[d];
            a0 += q0[d] * kd;
            a1 += q0[D + d] * kd;
          }
        } else {
#pragma omp simd reduction(+ : a0)
          for (int64_t d = 0; d < D; ++d) a0 += q0[d] * krow[d];
        }
        const float a[4] = {a0, a1, a2, a3};
        for (int k = 0; k < QB; ++k) lg[(m0 + k) * S] = a[k];
      }
      prefetch_rows(p, nx.k, p.k_sS, p.k_sH, nx, h, s, s + 1);
    }
}

// The page's max and exp-sum of n logits (in place: lm[s] becomes exp(lm[s] - new_max)).
inline float page_max(const float* lm, int64_t n) {
#if TINYATTN_AVX512
  return avx512::max_n(lm, n);
#else
  float mx = kNegInf;
#pragma omp simd reduction(max : mx)
  for (int64_t s = 0; s < n; ++s) mx = std::max(mx, lm[s]);
  return mx;
#endif
}

inline float exp_sum(float* lm, int64_t n, float mx) {
#if TINYATTN_AVX512
  return avx512::exp_sum_n(lm, n, mx);
#else
  float l = 0.0f;
#pragma omp simd reduction(+ : l)
  for (int64_t s = 0; s < n; ++s) {
    lm[s] = exp_nonpos(lm[s] - mx);
    l += lm[s];
  }
  return l;
#endif
}

// Online softmax per (head, query) over one page (Milakov & Gimelshein 2018): mask, rescale the running sum and
// accumulator to the new max, turn the logits into weights.
template <int kD>
void page_softmax(const Problem& p, int64_t b, int64_t j, int64_t n_tok, const uint8_t* f, float* logits,
                  State& st) {
  const int64_t D = kD > 0 ? kD : p.D;
  const int64_t S = p.S, Mp = p.Mp, M = p.M, G = p.G, n = p.seq_lens[b];
  const bool simple = p.Tq == 1 && p.window_left < 0;   // decode: every key before n is visible
  for (int64_t h = 0; h < p.Hkv; ++h) {
    if (!f[h]) continue;
    for (int64_t m = 0; m < Mp; ++m) {
      float* lm = logits + (h * Mp + m) * S;
      if (m < M && !simple) {                       // causal (Tq > 1) and sliding-window masks
        const int64_t qpos = n - p.Tq + m / G;
        for (int64_t s = 0; s < n_tok; ++s) {
          const int64_t kpos = j * S + s;
          if (kpos > qpos || (p.window_left >= 0 && kpos < qpos - p.window_left)) lm[s] = kNegInf;
        }
      }
      const float mx = m < M ? page_max(lm, n_tok) : kNegInf;
      if (mx == kNegInf) {                          // padding, or nothing visible on this page: weights 0
        std::fill(lm, lm + n_tok, 0.0f);
        continue;
      }
      const int64_t i = h * Mp + m;
      const float new_max = std::max(st.m[i], mx);
      const float alpha = exp_nonpos(st.m[i] - new_max);   // 0 on the first visible page
      st.l[i] = st.l[i] * alpha + exp_sum(lm, n_tok, new_max);
      st.m[i] = new_max;
      if (alpha != 1.0f) {
        float* __restrict am = st.acc.data() + i * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) am[d] *= alpha;
      }
    }
  }
}

// acc[h, m] += w[h, m, s] * v[s, h] over one page.
template <typename T, int kD, int QB>
void page_values(const Problem& p, const T* vp, int64_t n_tok, const uint8_t* f, const float* logits, float* v_buf,
                 State& st, const NextPage<T>& nx) {
  const int64_t D = kD > 0 ? kD : p.D;
  const int64_t S = p.S, Mp = p.Mp, Hkv = p.Hkv;
#if TINYATTN_AVX512
  if constexpr (kD > 0 && kD % 16 == 0) {
    std::vector<const float*> rows(n_tok);
    for (int64_t h = 0; h < Hkv; ++h) {
      if (!f[h]) continue;
      for (int64_t s = 0; s < n_tok; ++s) rows[s] = as_float(vp + s * p.v_sS + h * p.v_sH, v_buf + s * D, D);
      for (int64_t m0 = 0; m0 < Mp; m0 += QB)
        avx512::accumulate_values<kD, QB>(st.acc.data() + (h * Mp + m0) * D, logits + (h * Mp + m0) * S, S,
                                          rows.data(), n_tok);
      prefetch_rows(p, nx.v, p.v_sS, p.v_sH, nx, h, 0, S);
    }
    return;
  }
#endif
  // four queries per pass over a value row
  for (int64_t s = 0; s < n_tok; ++s)
    for (int64_t h = 0; h < Hkv; ++h) {
      if (!f[h]) continue;
      const float* __restrict vrow = as_float(vp + s * p.v_sS + h * p.v_sH, v_buf, D);
      const float* lg = logits + h * Mp * S + s;
      for (int64_t m0 = 0; m0 < Mp; m0 += QB) {
        float w[QB];
        for (int k = 0; k < QB; ++k) w[k] = lg[(m0 + k) * S];
        float* __restrict c0 = st.acc.data() + (h * Mp + m0) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          const float vd = vrow[d];
          for (int k = 0; k < QB; ++k) c0[k * D + d] += w[k] * vd;
        }
      }
      prefetch_rows(p, nx.v, p.v_sS, p.v_sH, nx, h, s, s + 1);
    }
}

// Attention of row b over `pages` (ascending; flags say which heads read each), all heads per page: a page's
// rows are read in memory order ([page_size, Hkv, D]) while the next page is prefetched.
// kD: the head dim as a compile-time constant for the common sizes (0: read it from the problem): with a
// constant bound the short loops of small heads unroll into whole vectors instead of a scalar tail, and
// multiples of 16 take the AVX-512 micro-kernels where the CPU has them.
// QB: queries per pass over a K / V row (4, or 2 / 1 when the group holds fewer: no work on padding).
template <typename T, int kD, int QB>
void attend_pages(const Problem& p, int64_t b, const int64_t* pages, int64_t n_list, const uint8_t* flags,
                  const float* qs, const T* k_cache, const T* v_cache, State& st) {
  const int64_t D = kD > 0 ? kD : p.D;
  const int64_t S = p.S, Hkv = p.Hkv, n = p.seq_lens[b];
  std::vector<float> logits(Hkv * p.Mp * S), k_buf(16 * D), v_buf(S * D);
  auto page_start = [&](int64_t j, const T* pool, int64_t sP) {
    return pool + static_cast<int64_t>(p.block_table[b * p.max_pages + j]) * sP;
  };
  for (int64_t pi = 0; pi < n_list; ++pi) {
    const int64_t j = pages[pi];
    const uint8_t* f = flags + (b * p.max_pages + j) * Hkv;
    const int64_t n_tok = std::min<int64_t>(S, n - j * S);
    NextPage<T> nx;
    if (pi + 1 < n_list) {
      const int64_t jn = pages[pi + 1];
      nx = {page_start(jn, k_cache, p.k_sP), page_start(jn, v_cache, p.v_sP), flags + (b * p.max_pages + jn) * Hkv,
            std::min<int64_t>(S, n - jn * S)};
    }
    page_logits<T, kD, QB>(p, b, page_start(j, k_cache, p.k_sP), n_tok, f, qs, logits.data(), k_buf.data(), nx);
    page_softmax<kD>(p, b, j, n_tok, f, logits.data(), st);
    page_values<T, kD, QB>(p, page_start(j, v_cache, p.v_sP), n_tok, f, logits.data(), v_buf.data(), st, nx);
  }
}

// out = acc / l and lse = m + log(l) of row b from its chunks' states (merged by their maxima); 0 / -inf where
// a query saw no key.
template <typename T>
void finish_row(const Problem& p, int64_t b, const State* states, int64_t n_states, T* out, float* lse) {
  const int64_t D = p.D, Mp = p.Mp, G = p.G;
  std::vector<float> acc(D);
  for (int64_t h = 0; h < p.Hkv; ++h)
    for (int64_t m = 0; m < p.M; ++m) {
      const int64_t i = h * Mp + m;
      float mx = kNegInf;
      for (int64_t c = 0; c < n_states; ++c) mx = std::max(mx, states[c].m[i]);
      float l = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      if (mx != kNegInf)
        for (int64_t c = 0; c < n_states; ++c) {
          if (states[c].m[i] == kNegInf) continue;
          const float w = std::exp(states[c].m[i] - mx);
          l += w * states[c].l[i];
          const float* a = states[c].acc.data() + i * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += w * a[d];
        }
      const int64_t t = m / G, g = m % G;
      const int64_t o = (b * p.Tq + t) * p.Hq + h * G + g;
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      for (int64_t d = 0; d < D; ++d) out[o * D + d] = static_cast<T>(acc[d] * inv);
      if (lse != nullptr) lse[o] = l > 0.0f ? mx + std::log(l) : kNegInf;
    }
}

template <typename T, int QB>
auto pick_attend_qb(int64_t D) {
  switch (D) {
    case 8: return &attend_pages<T, 8, QB>;
    case 32: return &attend_pages<T, 32, QB>;
    case 64: return &attend_pages<T, 64, QB>;
    case 128: return &attend_pages<T, 128, QB>;
    default: return &attend_pages<T, 0, QB>;
  }
}

template <typename T>
auto pick_attend(int64_t D, int QB) {
  return QB == 4 ? pick_attend_qb<T, 4>(D) : QB == 2 ? pick_attend_qb<T, 2>(D) : pick_attend_qb<T, 1>(D);
}

template <typename T, typename BT>
void run_all(const Problem& p, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const c10::optional<at::Tensor>& k_min, const c10::optional<at::Tensor>& k_max, at::Tensor& out,
             const c10::optional<at::Tensor>& lse) {
  const int64_t B = p.B, Hkv = p.Hkv, M = p.M, Mp = p.Mp, D = p.D, G = p.G;
  const T* qp = q.data_ptr<T>();
  // the queries of each (row, KV head), m = t * G + g, padded to 4-query blocks: split by sign for the bound,
  // scaled for the logits
  const int64_t Ms = p.Ms;
  std::vector<float> q_neg(B * Hkv * Ms * D, 0.0f), q_pos(B * Hkv * Ms * D, 0.0f), qs(B * Hkv * Mp * D, 0.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < p.Tq; ++t)
      for (int64_t hq = 0; hq < p.Hq; ++hq) {
        const int64_t h = hq / G, m = t * G + hq % G;
        const T* src = qp + ((b * p.Tq + t) * p.Hq + hq) * D;
        for (int64_t d = 0; d < D; ++d) {
          const float x = static_cast<float>(src[d]);
          const int64_t i = ((b * Hkv + h) * Ms + m) * D + d;
          q_neg[i] = std::min(x, 0.0f);
          q_pos[i] = std::max(x, 0.0f);
          qs[((b * Hkv + h) * Mp + m) * D + d] = x * p.scale;
        }
      }
  // 1. the Quest bound of every page of the rows that select, in tasks of page chunks
  constexpr int64_t kScoreChunk = 64;
  std::vector<int64_t> score_tasks;                    // (row, first page) pairs
  for (int64_t b = 0; b < B; ++b)
    if (p.selects(b))
      for (int64_t j = 0; j < p.n_pages(b); j += kScoreChunk) score_tasks.insert(score_tasks.end(), {b, j});
  std::vector<float> scores;
  if (!score_tasks.empty()) {
    scores.assign(B * Hkv * p.max_pages, kNegInf);
    const BT* lo = k_min->data_ptr<BT>();
    const BT* hi = k_max->data_ptr<BT>();
    at::parallel_for(0, static_cast<int64_t>(score_tasks.size() / 2), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = score_tasks[2 * i], j0 = score_tasks[2 * i + 1];
        score_pages(p, b, j0, std::min(j0 + kScoreChunk, p.n_pages(b)), q_neg.data(), q_pos.data(), lo, hi,
                    scores.data());
      }
    });
  }
  // 2. the pages of each (row, KV head)
  std::vector<uint8_t> flags(B * p.max_pages * Hkv, 0);
  at::parallel_for(0, B * Hkv, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) choose_pages(p, i / Hkv, i % Hkv, scores.data(), flags.data());
  });
  // 3. attention over the pages some head of the row reads, split into chunks when rows are fewer than threads
  //    (split-K: each chunk keeps its own softmax state, merged by finish_row)
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> pages, tasks;                   // tasks: (row, first index, end index) into `pages`
  std::vector<int64_t> row_task(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = static_cast<int64_t>(pages.size());
    for (int64_t j = 0; j < p.n_pages(b); ++j) {
      const uint8_t* f = flags.data() + (b * p.max_pages + j) * Hkv;
      if (std::any_of(f, f + Hkv, [](uint8_t x) { return x != 0; })) pages.push_back(j);
    }
    const int64_t len = static_cast<int64_t>(pages.size()) - start;
    int64_t chunks = B >= threads ? 1 : (threads + B - 1) / B;
    chunks = std::max<int64_t>(1, std::min(chunks, len / 8));    // at least 8 pages per chunk
    for (int64_t c = 0; c < chunks; ++c)
      tasks.insert(tasks.end(), {b, start + len * c / chunks, start + len * (c + 1) / chunks});
    row_task[b + 1] = row_task[b] + chunks;
  }
  const int64_t n_tasks = static_cast<int64_t>(tasks.size() / 3);
  std::vector<State> states(n_tasks, State(Hkv, Mp, D));
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const auto attend = pick_attend<T>(D, p.Mp == M ? (M % 4 == 0 ? 4 : M % 2 == 0 ? 2 : 1) : 4);
  at::parallel_for(0, n_tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      attend(p, tasks[3 * i], pages.data() + tasks[3 * i + 1], tasks[3 * i + 2] - tasks[3 * i + 1], flags.data(),
             qs.data(), kp, vp, states[i]);
  });
  T* op = out.data_ptr<T>();
  float* lp = lse ? lse->data_ptr<float>() : nullptr;
  at::parallel_for(0, B, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      finish_row<T>(p, b, states.data() + row_task[b], row_task[b + 1] - row_task[b], op, lp);
  });
}

template <typename T>
void dispatch_boxes(const Problem& p, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const c10::optional<at::Tensor>& k_min, const c10::optional<at::Tensor>& k_max,
                    at::Tensor& out, const c10::optional<at::Tensor>& lse) {
  const auto bt = k_min ? k_min->scalar_type() : at::kFloat;
  switch (bt) {
    case at::kFloat: return run_all<T, float>(p, q, k_cache, v_cache, k_min, k_max, out, lse);
    case at::kBFloat16: return run_all<T, at::BFloat16>(p, q, k_cache, v_cache, k_min, k_max, out, lse);
    case at::kHalf: return run_all<T, at::Half>(p, q, k_cache, v_cache, k_min, k_max, out, lse);
    default: TORCH_CHECK(false, "k_min: expected fp32, bf16 or fp16 boxes, got ", bt);
  }
}

// The last line of defence against out-of-bounds reads (the ops validate first, but a caller may turn value
// checks off or trust tables that are wrong): shapes agree, and every page id a row reads lies in the pool.
// O(valid pages), a few microseconds at 32K tokens.
void check_bounds(const Problem& p, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens, const c10::optional<at::Tensor>& k_min,
                  const c10::optional<at::Tensor>& k_max, const c10::optional<at::Tensor>& page_indices) {
  const int64_t num_pages = k_cache.size(0);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache: expected the shape of k_cache, got ", v_cache.sizes());
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == p.B && seq_lens.numel() == p.B,
              "block_table, seq_lens: expected [B=", p.B, ", max_pages] and [B], got ", block_table.sizes(), " and ",
              seq_lens.sizes());
  TORCH_CHECK(p.Hkv > 0 && p.Hq % p.Hkv == 0 && k_cache.size(3) == p.D,
              "q, k_cache: expected Hq a multiple of Hkv and one head_dim, got ", q.sizes(), " and ", k_cache.sizes());
  for (const auto* box : {&k_min, &k_max})
    if (box->has_value())
      TORCH_CHECK((*box)->dim() == 3 && (*box)->size(0) == num_pages && (*box)->size(1) == p.Hkv &&
                      (*box)->size(2) == p.D,
                  "k_min, k_max: expected [num_pages=", num_pages, ", Hkv=", p.Hkv, ", D=", p.D, "], got ",
                  (*box)->sizes());
  if (page_indices)
    TORCH_CHECK(page_indices->dim() == 3 && page_indices->size(0) == p.B && page_indices->size(1) == p.Hkv,
                "page_indices: expected [B=", p.B, ", Hkv=", p.Hkv, ", K], got ", page_indices->sizes());
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t np = p.n_pages(b);
    TORCH_CHECK(np <= p.max_pages, "seq_lens: row ", b, " holds ", p.seq_lens[b], " tokens, more than its ",
                p.max_pages, " pages of ", p.S);
    for (int64_t j = 0; j < np; ++j) {
      const int64_t phys = p.block_table[b * p.max_pages + j];
      TORCH_CHECK(phys >= 0 && phys < num_pages, "block_table: row ", b, " page ", j, " holds page id ", phys,
                  ", expected [0, ", num_pages, ")");
    }
  }
}

// The one entry point (see the file header). `selected` ([B, Hkv, page_budget] int32) receives the Quest
// selection when given; page_budget <= 0 or no boxes means dense (or the listed pages).
void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens, const c10::optional<at::Tensor>& k_min,
                  const c10::optional<at::Tensor>& k_max, const c10::optional<at::Tensor>& page_indices,
                  const c10::optional<at::Tensor>& selected, int64_t page_budget, int64_t num_sink_pages,
                  int64_t num_recent_pages, double scale, int64_t window_left, at::Tensor out,
                  const c10::optional<at::Tensor>& lse) {
  TORCH_CHECK((q.dim() == 4 || q.dim() == 3) && q.is_contiguous(),
              "q: expected a contiguous [B, Tq, Hq, D] or [B, Hq, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "k_cache, v_cache: expected [num_pages, page_size, Hkv, D] with unit stride in D");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() &&
                  seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "block_table, seq_lens: expected contiguous int32");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "out: expected a contiguous tensor like q");
  Problem p{};
  p.B = q.size(0); p.Tq = q.dim() == 4 ? q.size(1) : 1; p.Hq = q.size(-2); p.D = q.size(-1);
  p.S = k_cache.size(1); p.Hkv = k_cache.size(2); p.G = p.Hq / p.Hkv; p.M = p.Tq * p.G;
  // queries padded to whole 4-query blocks, except groups of 1 or 2 (or any even count): blocks of 1 or 2
  p.Mp = p.M % 4 == 0 || p.M % 2 == 0 || p.M == 1 ? p.M : (p.M + 3) / 4 * 4;
  p.Ms = (p.M + 3) / 4 * 4;
  p.max_pages = block_table.size(1);
  p.k_sP = k_cache.stride(0); p.k_sS = k_cache.stride(1); p.k_sH = k_cache.stride(2);
  p.v_sP = v_cache.stride(0); p.v_sS = v_cache.stride(1); p.v_sH = v_cache.stride(2);
  p.window_left = window_left;
  p.scale = static_cast<float>(scale);
  p.block_table = block_table.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.select = k_min.has_value() && page_budget > 0;
  p.budget = page_budget; p.num_sink = num_sink_pages; p.num_recent = num_recent_pages;
  TORCH_CHECK(k_min.has_value() == k_max.has_value(), "k_min, k_max: expected both or neither");
  if (lse)
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->is_contiguous() && lse->numel() == p.B * p.Tq * p.Hq,
                "lse: expected a contiguous fp32 tensor of B * Tq * Hq elements");
  if (k_min) {
    TORCH_CHECK(k_min->stride(2) == 1 && k_max->stride(2) == 1 && k_min->strides() == k_max->strides() &&
                    k_min->scalar_type() == k_max->scalar_type(),
                "k_min, k_max: expected [num_pages, Hkv, D] of one dtype and layout, unit stride in D");
    p.b_sP = k_min->stride(0); p.b_sH = k_min->stride(1);
  }
  if (page_indices) {
    TORCH_CHECK(page_indices->scalar_type() == at::kInt && page_indices->is_contiguous(),
                "page_indices: expected contiguous int32");
    p.page_indices = page_indices->data_ptr<int32_t>();
    p.K_listed = page_indices->size(2);
  }
  if (selected && p.select) {
    TORCH_CHECK(selected->scalar_type() == at::kInt && selected->is_contiguous() &&
                    selected->numel() == p.B * p.Hkv * page_budget,
                "selected: expected a contiguous int32 [B, Hkv, page_budget] tensor");
    p.selected = selected->data_ptr<int32_t>();
  }
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "k_cache, v_cache: expected the dtype of q");
  check_bounds(p, q, k_cache, v_cache, block_table, seq_lens, k_min, k_max, page_indices);
  switch (q.scalar_type()) {
    case at::kFloat: return dispatch_boxes<float>(p, q, k_cache, v_cache, k_min, k_max, out, lse);
    case at::kBFloat16: return dispatch_boxes<at::BFloat16>(p, q, k_cache, v_cache, k_min, k_max, out, lse);
    case at::kHalf: return dispatch_boxes<at::Half>(p, q, k_cache, v_cache, k_min, k_max, out, lse);
    default: TORCH_CHECK(false, "q: expected fp32, bf16 or fp16, got ", q.scalar_type());
  }
}

// ------------------------------------------------------------------------------------------------ cache write
// k, v [N, Hkv, D] stored at token rows `slots` [N] (int64) of the pools [num_pages, page_size, Hkv, D]
// (contiguous), and the boxes [num_pages, Hkv, D] of their pages grown to hold the new keys (min / max, NaN
// propagating like torch's amin / amax). One call instead of two index_copy_ and two index_reduce_ per layer.
template <typename T>
void write_rows(at::Tensor& k_cache, at::Tensor& v_cache, const c10::optional<at::Tensor>& k_min,
                const c10::optional<at::Tensor>& k_max, const int64_t* slots, const at::Tensor& k,
                const at::Tensor& v) {
  const int64_t N = k.size(0), HD = k.size(1) * k.size(2), S = k_cache.size(1);
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* lo = k_min ? k_min->data_ptr<T>() : nullptr;
  T* hi = k_max ? k_max->data_ptr<T>() : nullptr;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t slot = slots[n];
    std::copy(kp + n * HD, kp + (n + 1) * HD, kc + slot * HD);
    std::copy(vp + n * HD, vp + (n + 1) * HD, vc + slot * HD);
    if (lo == nullptr) continue;
    T* l = lo + (slot / S) * HD;
    T* h = hi + (slot / S) * HD;
    for (int64_t i = 0; i < HD; ++i) {
      const float x = static_cast<float>(kp[n * HD + i]);
      if (x != x || x < static_cast<float>(l[i])) l[i] = kp[n * HD + i];
      if (x != x || x > static_cast<float>(h[i])) h[i] = kp[n * HD + i];
    }
  }
}

void write_kv(at::Tensor k_cache, at::Tensor v_cache, const c10::optional<at::Tensor>& k_min,
              const c10::optional<at::Tensor>& k_max, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache, v_cache: expected two contiguous [num_pages, page_size, Hkv, D] pools of one dtype");
  TORCH_CHECK(k.dim() == 3 && k.is_contiguous() && v.is_contiguous() && v.sizes() == k.sizes() &&
                  k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3) &&
                  k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type(),
              "k, v: expected contiguous [N, Hkv, D] rows in the pool's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "slots: expected N contiguous int64 token rows");
  TORCH_CHECK(k_min.has_value() == k_max.has_value(), "k_min, k_max: expected both or neither");
  for (const auto* box : {&k_min, &k_max})
    if (box->has_value())
      TORCH_CHECK((*box)->is_contiguous() && (*box)->scalar_type() == k_cache.scalar_type() &&
                      (*box)->dim() == 3 && (*box)->size(0) == k_cache.size(0) && (*box)->size(1) == k.size(1) &&
                      (*box)->size(2) == k.size(2),
                  "k_min, k_max: expected contiguous [num_pages, Hkv, D] boxes in the pool's dtype");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t rows = k_cache.size(0) * k_cache.size(1);
  for (int64_t n = 0; n < slots.numel(); ++n)
    TORCH_CHECK(sp[n] >= 0 && sp[n] < rows, "slots: expected token rows in [0, ", rows, "), got ", sp[n]);
  switch (k_cache.scalar_type()) {
    case at::kFloat: return write_rows<float>(k_cache, v_cache, k_min, k_max, sp, k, v);
    case at::kBFloat16: return write_rows<at::BFloat16>(k_cache, v_cache, k_min, k_max, sp, k, v);
    case at::kHalf: return write_rows<at::Half>(k_cache, v_cache, k_min, k_max, sp, k, v);
    default: TORCH_CHECK(false, "k_cache: expected fp32, bf16 or fp16, got ", k_cache.scalar_type());
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Quest selection + paged attention, one (row, KV head) per task");
  m.def("write_kv", &write_kv, "store K/V rows at token slots and grow their pages' boxes");
  m.def("simd", [] { return TINYATTN_AVX512 ? "AVX-512 micro-kernels" : "portable loops"; },
        "which inner loops this build runs");
}
