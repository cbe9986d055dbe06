// Paged attention on the CPU, as an XLA FFI custom call (paged_jax/cpu_kernel.py builds, loads
// and registers it; the Python docstrings there are the contract).
//
// Ragged causal rows: row r's q_len = cu_q_lens[r + 1] - cu_q_lens[r] queries are its last
// q_len positions, seq_len - q_len, ..., seq_len - 1, and each attends to keys 0..its position
// (a decode row is q_len 1; a prefill chunk after a cached prefix, or a fresh prompt, is more).
// A work unit is (row, tile of up to 16 of its queries, kv head): the tile's query vectors
// (tokens x the query heads that share the kv head) are scored against each chunk of up to 32
// consecutive keys (read through the block table), so every K / V byte is read once per unit,
// and the softmax is merged online chunk by chunk with the seeds' section 11 rule (m, z, u: max
// score, sum of exp(s - m), exp-weighted sum of values), in f32. Work units are spread over
// XLA's intra-op thread pool when there is enough of it.
//
// Shapes (ragged like `attention.paged_attention_xla`):
//   q           T[num_tokens, num_q_heads, head_dim]
//   k_pages     T[num_pages, page_size, num_kv_heads, head_dim], v_pages the same
//   block_tables i32[num_seqs, max_pages_per_seq]
//   seq_lens    i32[num_seqs]       keys per row including this step's
//   cu_q_lens   i32[num_seqs + 1]   row r's queries are tokens cu_q_lens[r] .. cu_q_lens[r + 1] - 1
//   out         T[num_tokens, num_q_heads, head_dim], lse f32[num_tokens, num_q_heads]
// T is f32 or bf16. This step's keys must already be in the pages. Tokens of no row and queries
// without a visible key give zeros (lse -inf). Page ids are clamped into [0, num_pages) and
// lengths to the table's keys, as the XLA path's gathers do, and tokens past num_tokens are
// skipped, so no input reads or writes outside the buffers.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" {   // glibc's libmvec, the x86-64 vector function ABI (cpu_kernel.py links -lmvec)
#if defined(__AVX512F__)
__m512 _ZGVeN16v_expf(__m512);
#elif defined(__AVX2__)
__m256 _ZGVdN8v_expf(__m256);
#endif
}

namespace {

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline void FromFloat(float x, float* out) { *out = x; }
inline void FromFloat(float x, uint16_t* out) {   // round to nearest even, NaN kept a NaN
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *out = static_cast<uint16_t>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *out = static_cast<uint16_t>(bits >> 16);
}

struct Problem {
  int64_t num_tokens, num_q_heads, head_dim, num_pages, page_size, num_kv_heads, num_seqs, width;
  float scale;
  int64_t sliding_window;   // 0: none
  float soft_cap;           // 0: none
};

constexpr int kMaxGroup = 16;      // query heads per kv head
constexpr int kTileTokens = 16;    // a row's query tokens per work unit, at most (TileTokens)
constexpr int kKeys = 32;          // keys per chunk (consecutive positions, across pages)
// Keys x kv heads a call reads per thread before a second thread helps, however few its units
// (one decode row's 3 units on SmolLM2): 512 KB of f32 K/V at head_dim 64. One row ran 1.4-1.5x
// faster on two threads at 1,024-4,096 keys, no faster at 224 (f32, pages from memory; a
// scratch A/B of 2026-12-07).
constexpr int64_t kMinKeyRowsPerThread = 1024;
constexpr int kKeyMajorMin = 8;    // query vectors in a unit from which scores are computed
                                   // key-major, 16 query lanes a vector (below: query-major,
                                   // one dot product per key and query, as decode rows have)

// A row's query tokens per work unit: 8, or 16 where the group is odd, so that the unit's query
// vectors (tokens x group) fill whole 16-lane vectors (SmolLM2's group of 3: 48 lanes).
inline int64_t TileTokens(int64_t group) { return group % 2 ? 16 : 8; }

// 16 floats in one register where the target has 512-bit vectors (two or four where not):
// GCC's generic vectors, so blocks of accumulators stay in registers on any x86-64.
typedef float V16 __attribute__((vector_size(64)));
inline V16 Load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store16(float* p, V16 v) { std::memcpy(p, &v, sizeof(v)); }

// exp of 16 floats in place, by glibc's vector math library (libmvec) where the CPU has the
// vector units; exp(-inf) is 0.
inline void Exp16(float* x) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(x, _ZGVeN16v_expf(_mm512_loadu_ps(x)));
#elif defined(__AVX2__)
  for (int i = 0; i < 16; i += 8) _mm256_storeu_ps(x + i, _ZGVdN8v_expf(_mm256_loadu_ps(x + i)));
#else
  for (int i = 0; i < 16; ++i) x[i] = std::exp(x[i]);
#endif
}

typedef int32_t I16 __attribute__((vector_size(64)));   // a two-source shuffle's lane picks

// One level of SumLanes16's tree: x and y hold 8 / w keys each in 2w lanes per key; the result
// holds all 16 / w keys in w lanes per key (x's first), each the sum of its two halves' lanes.
inline V16 AddHalves(V16 x, V16 y, int w) {
  I16 lo, hi;
  for (int i = 0; i < 16; ++i) {
    const int key = i / w, per = 8 / w;
    lo[i] = (key < per ? 0 : 16) + key % per * 2 * w + i % w;   // lanes 16-31 are y's
    hi[i] = lo[i] + w;
  }
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

// The lane sums of 16 vectors, in order: out[t] = sum of p[t]'s 16 lanes. A tree of pairwise
// two-source shuffles (one permute instruction each on AVX-512): 30 shuffles and 15 adds for 16
// sums, where 16 separate horizontal sums take about 8 instructions each.
inline V16 SumLanes16(const V16* p) {
  V16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = AddHalves(p[2 * i], p[2 * i + 1], 8);
  for (int i = 0; i < 4; ++i) b[i] = AddHalves(a[2 * i], a[2 * i + 1], 4);
  for (int i = 0; i < 2; ++i) c[i] = AddHalves(b[2 * i], b[2 * i + 1], 2);
  return AddHalves(c[0], c[1], 1);
}

// sT[t][x] = q[x] . key[t] for the chunk's keys t < nk and query lanes x < lanes (a multiple
// of 16), the queries given transposed [d][lanes]: each key element is broadcast against 16
// query lanes, 8 keys at a time, so no sum runs across a vector.
inline void KeyMajorScores(const float* q_t, const float* const* krow, int64_t nk, int64_t d_len,
                           int64_t lanes, float* s_t) {
  for (int64_t x0 = 0; x0 < lanes; x0 += 16) {
    for (int64_t t0 = 0; t0 < nk; t0 += 8) {
      const int64_t n = std::min<int64_t>(8, nk - t0);
      const float* kr[8];
      for (int u = 0; u < 8; ++u) kr[u] = krow[t0 + std::min<int64_t>(u, n - 1)];
      V16 a[8] = {};
      for (int64_t d = 0; d < d_len; ++d) {
        const V16 qd = Load16(q_t + d * lanes + x0);
        for (int u = 0; u < 8; ++u) a[u] += kr[u][d] * qd;
      }
      for (int64_t u = 0; u < n; ++u) Store16(s_t + (t0 + u) * lanes + x0, a[u]);
    }
  }
}

// acc[b][:] += sum over t in [t0, t1) of w[b * wb + t * wt] * v[t][:] for B query vectors (acc
// rows of D), the block's accumulators held in registers across the keys.
template <int D, int B>
inline void AccumulateBlock(float* acc, const float* w, int64_t wb, int64_t wt,
                            const float* const* v, int64_t t0, int64_t t1) {
  constexpr int R = D / 16;
  V16 a[B][R];
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) a[b][r] = Load16(acc + b * D + r * 16);
  for (int64_t t = t0; t < t1; ++t) {
    V16 vt[R];
    for (int r = 0; r < R; ++r) vt[r] = Load16(v[t] + r * 16);
    for (int b = 0; b < B; ++b) {
      const float pt = w[b * wb + t * wt];
      for (int r = 0; r < R; ++r) a[b][r] += pt * vt[r];
    }
  }
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) Store16(acc + b * D + r * 16, a[b][r]);
}

// One (row, tile of queries i0 .. i0 + TileTokens - 1, kv head) unit. D is the head dim when
// known at compile time (0: p.head_dim).
template <typename T, int D>
void Unit(const Problem& p, const T* q, const T* k, const T* v, const int32_t* tables,
          const int32_t* seq_lens, const int32_t* cu, T* out, float* lse, int64_t row,
          int64_t i0, int64_t kvh) {
  const int64_t d_len = D ? D : p.head_dim;
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  const int64_t q_len = static_cast<int64_t>(cu[row + 1]) - cu[row];
  const int64_t tok0 = static_cast<int64_t>(cu[row]) + i0;
  const int64_t ntok = std::min<int64_t>(std::min<int64_t>(TileTokens(group), q_len - i0),
                                         p.num_tokens - tok0);
  if (ntok <= 0 || tok0 < 0) return;
  // Query j of the tile sits at position seq_len - q_len + i0 + j and sees keys [lo, hi).
  const int64_t cap = p.width * p.page_size;
  int64_t lo[kTileTokens], hi[kTileTokens];
  for (int64_t j = 0; j < ntok; ++j) {
    hi[j] = std::min<int64_t>(std::max<int64_t>(seq_lens[row] - q_len + i0 + j + 1, 0), cap);
    lo[j] = p.sliding_window > 0 ? std::max<int64_t>(hi[j] - p.sliding_window, 0) : 0;
  }
  const int64_t first = lo[0], last = hi[ntok - 1];   // both grow with j
  if (last <= first) return;

  // Scratch: scaled query vectors (x = j * group + g; rows padded with zeros to `lanes`, a
  // multiple of 16), transposed [d][lanes] for the key-major scores; the summaries' value sums;
  // a chunk's scores and then weights; (bf16) its keys and values as f32 rows.
  const int64_t nq = ntok * group;
  const int64_t lanes = (nq + 15) / 16 * 16;
  const bool key_major = nq >= kKeyMajorMin;
  thread_local std::vector<float> scratch;
  scratch.resize(2 * lanes * d_len + lanes * kKeys + 2 * kKeys * d_len);
  float* qs = scratch.data();
  float* acc = qs + lanes * d_len;
  float* s = acc + lanes * d_len;
  float* kf = s + lanes * kKeys;
  float* vf = kf + kKeys * d_len;
  // Zeros where they are read before written: the value sums of the query vectors the value
  // blocks cover (up to a multiple of 4), the transposed queries' padding lanes (key-major), the
  // weights of the rows past nq in the last block (query-major).
  const int64_t rows = (nq + 3) / 4 * 4;
  std::fill(acc, acc + rows * d_len, 0.0f);
  if (key_major) std::fill(qs, qs + lanes * d_len, 0.0f);
  else std::fill(s, s + rows * kKeys, 0.0f);
  constexpr int kMaxLanes = kTileTokens * kMaxGroup;   // a multiple of 16
  alignas(64) float m[kMaxLanes], z[kMaxLanes], m_new[kMaxLanes], w_old[kMaxLanes];
  alignas(64) int32_t lo_x[kMaxLanes], hi_x[kMaxLanes];   // each lane's visible keys
  for (int64_t x = 0; x < lanes; ++x) {
    m[x] = -std::numeric_limits<float>::infinity();
    z[x] = 0.0f;
    lo_x[x] = x < nq ? static_cast<int32_t>(lo[x / group]) : 0;
    hi_x[x] = x < nq ? static_cast<int32_t>(hi[x / group]) : 0;
  }
  for (int64_t x = 0; x < nq; ++x) {
    const T* qx = q + ((tok0 + x / group) * p.num_q_heads + kvh * group + x % group) * d_len;
    for (int64_t d = 0; d < d_len; ++d) {
      const float val = ToFloat(qx[d]) * p.scale;
      if (key_major) qs[d * lanes + x] = val; else qs[x * d_len + d] = val;
    }
  }
  const float kNegInf = -std::numeric_limits<float>::infinity();
  const float* krow[kKeys];
  const float* vrow[kKeys];
  // Where position pos's key (and value) row of this kv head starts, through the block table
  // (page ids clamped).
  auto row_at = [&](int64_t pos) {
    int64_t page = tables[row * p.width + pos / p.page_size];
    page = std::min<int64_t>(std::max<int64_t>(page, 0), p.num_pages - 1);
    return ((page * p.page_size + pos % p.page_size) * p.num_kv_heads + kvh) * d_len;
  };
  const int64_t row_bytes = d_len * static_cast<int64_t>(sizeof(T));
  for (int64_t c0 = first; c0 < last; c0 += kKeys) {
    const int64_t nk = std::min<int64_t>(kKeys, last - c0);
    // The next chunk's rows (the first's too, at the start) are asked for now, into L2: the
    // hardware's prefetch does not follow rows kv heads apart on pages anywhere in the pool.
    // With the helper thread below, one row of 1,024-4,096 keys ran 1.7-2.7x faster, 32 rows
    // 1.3-1.75x (pages from memory; results page, "decode attention asks for its next keys").
    const int64_t ahead = std::min<int64_t>(c0 + 2 * kKeys, last);
    for (int64_t pos = c0 == first ? c0 : c0 + kKeys; pos < ahead; ++pos) {
      const int64_t at = row_at(pos);   // the same offset in k and v
      const char* kb = reinterpret_cast<const char*>(k + at);
      const char* vb = reinterpret_cast<const char*>(v + at);
      for (int64_t b = 0; b < row_bytes; b += 64) {
        __builtin_prefetch(kb + b, 0, 1);
        __builtin_prefetch(vb + b, 0, 1);
      }
    }
    // The chunk's key and value rows.
    for (int64_t t = 0; t < nk; ++t) {
      const int64_t at = row_at(c0 + t);
      if constexpr (std::is_same_v<T, float>) {
        krow[t] = k + at;
        vrow[t] = v + at;
      } else {
        for (int64_t d = 0; d < d_len; ++d) {
          kf[t * d_len + d] = ToFloat(k[at + d]);
          vf[t * d_len + d] = ToFloat(v[at + d]);
        }
        krow[t] = kf + t * d_len;
        vrow[t] = vf + t * d_len;
      }
    }
    // Scores, then each query's weights exp(s - m_new) in their place (0 for keys it may not
    // see), its summary rescaled to the new max: w[x * wb + t * wt].
    int64_t wb, wt, t_min = 0, t_max = nk;
    if (key_major) {   // s[t][x], vectors across the query lanes
      wb = 1;
      wt = lanes;
      KeyMajorScores(qs, krow, nk, d_len, lanes, s);
      for (int64_t x = 0; x < lanes; ++x) m_new[x] = m[x];
      for (int64_t t = 0; t < nk; ++t) {
        float* st = s + t * lanes;
        const int32_t pos = static_cast<int32_t>(c0 + t);
        if (p.soft_cap > 0.0f)
          for (int64_t x = 0; x < lanes; ++x) st[x] = p.soft_cap * std::tanh(st[x] / p.soft_cap);
#pragma omp simd
        for (int64_t x = 0; x < lanes; ++x) {
          st[x] = lo_x[x] <= pos && pos < hi_x[x] ? st[x] : kNegInf;
          m_new[x] = std::max(m_new[x], st[x]);
        }
      }
      for (int64_t x = 0; x < lanes; ++x) {   // no finite max yet: weights exp(-inf) = 0
        const bool none = !std::isfinite(m_new[x]);
        if (none) m[x] = kNegInf;
        m_new[x] = none ? 0.0f : m_new[x];   // the shift: what scores are taken from
        w_old[x] = m[x] - m_new[x];
      }
      for (int64_t x = 0; x < lanes; x += 16) Exp16(w_old + x);
      for (int64_t t = 0; t < nk; ++t) {
        float* st = s + t * lanes;
#pragma omp simd
        for (int64_t x = 0; x < lanes; ++x) st[x] -= m_new[x];
        for (int64_t x = 0; x < lanes; x += 16) Exp16(st + x);
      }
      alignas(64) float zc[kMaxLanes] = {};
      for (int64_t t = 0; t < nk; ++t) {
        const float* st = s + t * lanes;
#pragma omp simd
        for (int64_t x = 0; x < lanes; ++x) zc[x] += st[x];
      }
      for (int64_t x = 0; x < nq; ++x) {
        if (zc[x] == 0.0f && z[x] == 0.0f) continue;   // nothing seen yet
        if (w_old[x] != 1.0f) {
          float* ax = acc + x * d_len;
#pragma omp simd
          for (int64_t d = 0; d < d_len; ++d) ax[d] *= w_old[x];
        }
        z[x] = z[x] * w_old[x] + zc[x];
        m[x] = m_new[x];
      }
    } else {   // s[x][t], one dot product per key and query
      wb = kKeys;
      wt = 1;
      t_min = kKeys;
      t_max = 0;
      if (d_len % 16 == 0) {   // each 16 keys' products summed across lanes together
        V16 part[kKeyMajorMin][16];
        for (int64_t t0 = 0; t0 < nk; t0 += 16) {
          for (int u = 0; u < 16; ++u) {
            const float* kr = krow[std::min<int64_t>(t0 + u, nk - 1)];   // past nk: masked below
            for (int64_t x = 0; x < nq; ++x) {
              const float* qx = qs + x * d_len;
              V16 a = Load16(qx) * Load16(kr);
              for (int64_t d = 16; d < d_len; d += 16) a += Load16(qx + d) * Load16(kr + d);
              part[x][u] = a;
            }
          }
          for (int64_t x = 0; x < nq; ++x) Store16(s + x * kKeys + t0, SumLanes16(part[x]));
        }
      } else {
        for (int64_t x = 0; x < nq; ++x) {
          const float* qx = qs + x * d_len;
          for (int64_t t = 0; t < nk; ++t) {
            const float* kx = krow[t];
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < d_len; ++d) dot += qx[d] * kx[d];
            s[x * kKeys + t] = dot;
          }
        }
      }
      for (int64_t x = 0; x < nq; ++x) {
        float* sx = s + x * kKeys;
        const int64_t t_lo = std::max<int64_t>(lo_x[x] - c0, 0);
        const int64_t t_hi = std::min<int64_t>(hi_x[x] - c0, nk);
        float m_chunk = kNegInf;
        for (int64_t t = t_lo; t < t_hi; ++t) {
          if (p.soft_cap > 0.0f) sx[t] = p.soft_cap * std::tanh(sx[t] / p.soft_cap);
          m_chunk = std::max(m_chunk, sx[t]);
        }
        const float mx = std::max(m[x], m_chunk);
        if (t_hi <= t_lo || !std::isfinite(mx)) {   // nothing (finite) to merge
          std::fill(sx, sx + kKeys, 0.0f);
          continue;
        }
        for (int t = 0; t < kKeys; ++t) sx[t] = t >= t_lo && t < t_hi ? sx[t] - mx : kNegInf;
        Exp16(sx);
        Exp16(sx + 16);
        float zc = 0.0f;
        for (int t = 0; t < kKeys; ++t) zc += sx[t];
        const float w = std::exp(m[x] - mx);   // exp(-inf) = 0 for an empty summary
        if (w != 1.0f) {
          float* ax = acc + x * d_len;
#pragma omp simd
          for (int64_t d = 0; d < d_len; ++d) ax[d] *= w;
        }
        z[x] = z[x] * w + zc;
        m[x] = mx;
        t_min = std::min(t_min, t_lo);
        t_max = std::max(t_max, t_hi);
      }
    }
    // Values: acc[x] += sum_t w[x][t] * v[t].
    if (t_max <= t_min) continue;
    if constexpr (D == 64 || D == 128) {
      constexpr int B = D == 64 ? 4 : 2;   // B x D / 16 accumulators: 16 registers
      for (int64_t b0 = 0; b0 < nq; b0 += B)   // lanes past nq hold zero weights and sums
        AccumulateBlock<D, B>(acc + b0 * D, s + b0 * wb, wb, wt, vrow, t_min, t_max);
    } else {
      for (int64_t x = 0; x < nq; ++x) {
        float* ax = acc + x * d_len;
        for (int64_t t = t_min; t < t_max; ++t) {
          const float pt = s[x * wb + t * wt];
          const float* vt = vrow[t];
#pragma omp simd
          for (int64_t d = 0; d < d_len; ++d) ax[d] += pt * vt[d];
        }
      }
    }
  }
  for (int64_t x = 0; x < nq; ++x) {
    const int64_t tok = tok0 + x / group, head = kvh * group + x % group;
    T* ox = out + (tok * p.num_q_heads + head) * d_len;
    if (z[x] > 0.0f) {
      const float inv = 1.0f / z[x];
      for (int64_t d = 0; d < d_len; ++d) FromFloat(acc[x * d_len + d] * inv, ox + d);
      lse[tok * p.num_q_heads + head] = m[x] + std::log(z[x]);
    }
  }
}

template <typename T>
using UnitFn = void (*)(const Problem&, const T*, const T*, const T*, const int32_t*,
                        const int32_t*, const int32_t*, T*, float*, int64_t, int64_t, int64_t);

template <typename T>
UnitFn<T> PickUnit(int64_t head_dim) {
  if (head_dim == 64) return &Unit<T, 64>;
  if (head_dim == 128) return &Unit<T, 128>;
  return &Unit<T, 0>;
}

// Work units shared by the caller and pool tasks: each takes the next unit until none is left.
// Tasks hold the state by shared_ptr, so one that starts after the call has returned finds no
// unit and touches no buffer.
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
  std::vector<std::pair<int64_t, int64_t>> tiles;   // (row, first query of the tile)
};

template <typename T>
ffi::Error Run(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
               ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> block_tables,
               ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> cu_q_lens, float scale,
               int64_t sliding_window, float soft_cap, int64_t min_units_per_thread,
               ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse) {
  auto qd = q.dimensions(), kd = k_pages.dimensions(), vd = v_pages.dimensions(),
       td = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 ||
      !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()))
    return ffi::Error::InvalidArgument("paged_jax CPU attention: bad ranks, or v's shape differs");
  Problem p{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], td[0], td[1], scale, sliding_window,
            soft_cap};
  if (kd[3] != p.head_dim || p.num_kv_heads < 1 || p.num_q_heads % p.num_kv_heads ||
      p.num_q_heads / p.num_kv_heads > kMaxGroup || p.num_pages < 1 || p.width < 1)
    return ffi::Error::InvalidArgument("paged_jax CPU attention: bad shapes");
  if (seq_lens.element_count() != p.num_seqs || cu_q_lens.element_count() != p.num_seqs + 1)
    return ffi::Error::InvalidArgument("paged_jax CPU attention: bad row counts");
  T* o = reinterpret_cast<T*>(out->untyped_data());
  float* l = lse->typed_data();
  std::fill(o, o + p.num_tokens * p.num_q_heads * p.head_dim, T(0));   // T(0) is +0.0 in both
  std::fill(l, l + p.num_tokens * p.num_q_heads, -std::numeric_limits<float>::infinity());
  const T* qp = reinterpret_cast<const T*>(q.untyped_data());
  const T* kp = reinterpret_cast<const T*>(k_pages.untyped_data());
  const T* vp = reinterpret_cast<const T*>(v_pages.untyped_data());
  const int32_t* tp = block_tables.typed_data();
  const int32_t* sp = seq_lens.typed_data();
  const int32_t* cp = cu_q_lens.typed_data();
  UnitFn<T> unit = PickUnit<T>(p.head_dim);

  // Units: each row's tiles (its last, longest-reaching tile first), times the kv heads. Rows
  // are clipped to the tokens there are, so bad cu_q_lens cannot make more units than tokens.
  auto work = std::make_shared<Work>();
  int64_t queries = 0;
  int64_t key_rows = 0;   // keys x kv heads the rows see (at most), for the helpers below
  for (int64_t r = 0; r < p.num_seqs; ++r) {
    const int64_t begin = std::max<int64_t>(cp[r], 0);
    const int64_t n = std::min<int64_t>(cp[r + 1], p.num_tokens) - begin;
    if (n <= 0) continue;
    const int64_t tile = TileTokens(p.num_q_heads / p.num_kv_heads);
    for (int64_t i0 = (n - 1) / tile * tile; i0 >= 0; i0 -= tile)
      work->tiles.emplace_back(r, i0 + begin - cp[r]);
    queries += n;
    key_rows += std::min<int64_t>(std::max<int64_t>(sp[r], 0), p.width * p.page_size) *
                p.num_kv_heads;
  }
  work->total = static_cast<int64_t>(work->tiles.size()) * p.num_kv_heads;
  // The copies below (Problem, pointers) are what a late task would read; it reads them only
  // after claiming a unit, which it cannot once all are claimed.
  auto drain = [=]() {
    for (int64_t i; (i = work->next.fetch_add(1)) < work->total;) {
      const auto& tile = work->tiles[i / p.num_kv_heads];
      unit(p, qp, kp, vp, tp, sp, cp, o, l, tile.first, tile.second, i % p.num_kv_heads);
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  // Query tokens x kv heads (decode: (row, kv head) units) per thread before another helps,
  // or kMinKeyRowsPerThread keys x kv heads read (one user's long context).
  int64_t helpers = 0;
  if (min_units_per_thread > 0) {
    const int64_t want = std::max(queries * p.num_kv_heads / min_units_per_thread,
                                  key_rows / kMinKeyRowsPerThread);
    helpers = std::min<int64_t>({pool.num_threads(), want, work->total}) - 1;
  }
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(drain)(drain));   // a copy each
  drain();
  while (work->done.load(std::memory_order_acquire) < work->total) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error Dispatch(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                    ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> block_tables,
                    ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> cu_q_lens, float scale,
                    int64_t sliding_window, float soft_cap, int64_t min_units_per_thread,
                    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse) {
  const auto dt = q.element_type();
  if (k_pages.element_type() != dt || v_pages.element_type() != dt || out->element_type() != dt)
    return ffi::Error::InvalidArgument("paged_jax CPU attention: q, pages and out differ in dtype");
  if (dt == ffi::DataType::F32)
    return Run<float>(pool, q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, scale,
                      sliding_window, soft_cap, min_units_per_thread, out, lse);
  if (dt == ffi::DataType::BF16)
    return Run<uint16_t>(pool, q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, scale,
                         sliding_window, soft_cap, min_units_per_thread, out, lse);
  return ffi::Error::InvalidArgument("paged_jax CPU attention: dtype must be f32 or bf16");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedJaxAttention, Dispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("min_units_per_thread")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
