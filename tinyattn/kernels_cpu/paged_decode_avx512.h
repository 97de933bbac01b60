// AVX-512 micro-kernels of the CPU decode kernel (paged_decode.cpp): the dot products of a group of key rows
// with a block of queries, the per-page softmax, and the weighted sum of value rows with register accumulators.
//
// Why: written with `omp simd`, gcc turns each q . k into a vector FMA chain plus a scalar horizontal sum of 16
// lanes (~15 shuffles and adds per dot: a third of the dense time at head_dim 128), keeps the page's exp scalar,
// and loads and stores the output accumulator for every value row. Here 16 dots share one transpose-and-add tree
// (45 instructions), the exp runs 16 lanes at a time, and the accumulators of a value block stay in registers
// across the page's rows. Used for head_dim a multiple of 16 (the kernel's 32 / 64 / 128 specialisations);
// other sizes and other CPUs keep the portable loops of paged_decode.cpp.
#pragma once

#if defined(__AVX512F__)
#define TINYATTN_AVX512 1
#include <immintrin.h>

#include <cstdint>

namespace avx512 {

// lane i = the sum of the 16 lanes of v[i]: pairs, then quads within 128-bit lanes, then across 128-bit lanes
inline __m512 sum16(const __m512 v[16]) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// q . k for QB queries (q: QB rows of kD, contiguous) and 16 / QB key rows: lane m * (16 / QB) + t holds query m
// with key row t. 16 accumulators + QB query vectors + 1 key vector stay in the 32 registers.
template <int kD, int QB>
inline __m512 block_dots(const float* const* krows, const float* __restrict q) {
  constexpr int TG = 16 / QB;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int d = 0; d < kD; d += 16) {
    __m512 qv[QB];
    for (int m = 0; m < QB; ++m) qv[m] = _mm512_loadu_ps(q + m * kD + d);
    for (int t = 0; t < TG; ++t) {
      const __m512 kv = _mm512_loadu_ps(krows[t] + d);
      for (int m = 0; m < QB; ++m) acc[m * TG + t] = _mm512_fmadd_ps(qv[m], kv, acc[m * TG + t]);
    }
  }
  return sum16(acc);
}

// Quest bounds (Quest, Tang et al. 2024, eq. 1: sum_d max(q_d k_min_d, q_d k_max_d) = q- . k_min + q+ . k_max)
// of 4 queries (rows of qn / qp, D apart) on the boxes of 4 pages: lane m * 4 + t holds query m on page t.
inline __m512 block_bounds(const float* const* lo, const float* const* hi, const float* __restrict qn,
                           const float* __restrict qp, int64_t D) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    __m512 n[4], p[4];
    for (int m = 0; m < 4; ++m) n[m] = _mm512_loadu_ps(qn + m * D + d), p[m] = _mm512_loadu_ps(qp + m * D + d);
    for (int t = 0; t < 4; ++t) {
      const __m512 l = _mm512_loadu_ps(lo[t] + d), u = _mm512_loadu_ps(hi[t] + d);
      for (int m = 0; m < 4; ++m) acc[m * 4 + t] = _mm512_fmadd_ps(p[m], u, _mm512_fmadd_ps(n[m], l, acc[m * 4 + t]));
    }
  }
  return sum16(acc);
}

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u); }

// exp(x) for x <= 0 (0 below -87 and at -inf): the scalar exp_nonpos polynomial of paged_decode.cpp, 16 lanes;
// 2^n through scalef
inline __m512 exp_nonpos(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f),
                                                         _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fmadd_ps(fx, _mm512_set1_ps(2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, x), x, _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(y, fx));
}

// the largest of n logits (-inf for none)
inline float max_n(const float* lm, int64_t n) {
  __m512 mx = _mm512_set1_ps(-__builtin_inff());
  for (int64_t s = 0; s < n; s += 16)
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-__builtin_inff()), tail_mask(n - s), lm + s));
  return _mm512_reduce_max_ps(mx);
}

// lm[s] = exp(lm[s] - mx) in place; returns their sum
inline float exp_sum_n(float* lm, int64_t n, float mx) {
  __m512 sum = _mm512_setzero_ps();
  const __m512 m = _mm512_set1_ps(mx);
  for (int64_t s = 0; s < n; s += 16) {
    const __mmask16 k = tail_mask(n - s);
    const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, lm + s), m));
    _mm512_mask_storeu_ps(lm + s, k, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(sum);
}

// acc[m, :] += sum_s w[m * w_stride + s] * vrows[s][:] for QB queries over n value rows of kD: blocks of CH x 16
// columns whose QB x CH accumulators stay in registers across the rows.
template <int kD, int QB>
inline void accumulate_values(float* __restrict acc, const float* __restrict w, int64_t w_stride,
                              const float* const* vrows, int64_t n) {
  constexpr int CH = (16 / QB) < (kD / 16) ? (16 / QB) : (kD / 16);
  static_assert(kD % (16 * CH) == 0, "head_dim must be a whole number of value blocks");
  for (int d0 = 0; d0 < kD; d0 += 16 * CH) {
    __m512 a[QB][CH];
    for (int m = 0; m < QB; ++m)
      for (int c = 0; c < CH; ++c) a[m][c] = _mm512_loadu_ps(acc + m * kD + d0 + 16 * c);
    for (int64_t s = 0; s < n; ++s) {
      __m512 ws[QB];
      for (int m = 0; m < QB; ++m) ws[m] = _mm512_set1_ps(w[m * w_stride + s]);
      for (int c = 0; c < CH; ++c) {
        const __m512 v = _mm512_loadu_ps(vrows[s] + d0 + 16 * c);
        for (int m = 0; m < QB; ++m) a[m][c] = _mm512_fmadd_ps(ws[m], v, a[m][c]);
      }
    }
    for (int m = 0; m < QB; ++m)
      for (int c = 0; c < CH; ++c) _mm512_storeu_ps(acc + m * kD + d0 + 16 * c, a[m][c]);
  }
}

}  // namespace avx512
#else
#define TINYATTN_AVX512 0
#endif
