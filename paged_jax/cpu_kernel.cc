// Paged decode attention on the CPU, as an XLA FFI custom call (paged_jax/cpu_kernel.py builds,
// loads and registers it; the Python docstrings there are the contract).
//
// One query per row (decode). A work unit is (row, kv head): the group of query heads that share
// the kv head is scored against each visible key of the row once, so every K / V byte is read
// once per unit, and the softmax is merged online page by page with the seeds' section 11 rule
// (m, z, u: max score, sum of exp(s - m), exp-weighted sum of values), in f32. Work units are
// spread over XLA's intra-op thread pool when there is enough of it.
//
// Shapes (ragged like `attention.decode_attention_xla`):
//   q           T[num_tokens, num_q_heads, head_dim]
//   k_pages     T[num_pages, page_size, num_kv_heads, head_dim], v_pages the same
//   block_tables i32[num_seqs, max_pages_per_seq]
//   seq_lens    i32[num_seqs]       keys per row including this step's
//   cu_q_lens   i32[num_seqs + 1]   row r's query is token cu_q_lens[r] when its q_len is 1
//   out         T[num_tokens, num_q_heads, head_dim], lse f32[num_tokens, num_q_heads]
// T is f32 or bf16. Tokens of no row and rows without a visible key (seq_len 0, the padding rows
// of `decode_attention_xla`'s contract) give zeros (lse -inf). Page ids are clamped into [0, num_pages) and lengths to the table's keys, as the
// XLA path's gathers do, so no input reads outside the buffers.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

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

constexpr int kMaxGroup = 16;   // query heads per kv head handled in one unit's registers / stack

// One (row, kv head) unit. D is the head dim when known at compile time (0: p.head_dim).
template <typename T, int D>
void Unit(const Problem& p, const T* q, const T* k, const T* v, const int32_t* tables,
          const int32_t* seq_lens, const int32_t* cu, T* out, float* lse, int64_t row,
          int64_t kvh) {
  const int64_t d_len = D ? D : p.head_dim;
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  if (cu[row + 1] - cu[row] != 1) return;                  // no query in this row: zeros stay
  const int64_t tok = cu[row];
  if (tok < 0 || tok >= p.num_tokens) return;
  const int64_t len = std::min<int64_t>(std::max<int64_t>(seq_lens[row], 0),
                                        p.width * p.page_size);
  const int64_t first = p.sliding_window > 0 ? std::max<int64_t>(len - p.sliding_window, 0) : 0;
  if (len <= first) return;

  // q rows of the group, scaled; running summaries.
  std::vector<float> qs(group * d_len), acc(group * d_len, 0.0f);
  std::vector<float> s(group * p.page_size);
  float m[kMaxGroup], z[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    const T* qg = q + (tok * p.num_q_heads + kvh * group + g) * d_len;
    for (int64_t d = 0; d < d_len; ++d) qs[g * d_len + d] = ToFloat(qg[d]) * p.scale;
    m[g] = -std::numeric_limits<float>::infinity();
    z[g] = 0.0f;
  }
  const int64_t token_stride = p.num_kv_heads * d_len;
  for (int64_t start = first - first % p.page_size; start < len; start += p.page_size) {
    int64_t page = tables[row * p.width + start / p.page_size];
    page = std::min<int64_t>(std::max<int64_t>(page, 0), p.num_pages - 1);
    const int64_t t0 = std::max<int64_t>(first - start, 0);
    const int64_t t1 = std::min<int64_t>(len - start, p.page_size);
    const T* kp = k + (page * p.page_size * p.num_kv_heads + kvh) * d_len;
    const T* vp = v + (page * p.page_size * p.num_kv_heads + kvh) * d_len;
    // Scores of the page's visible keys.
    for (int64_t t = t0; t < t1; ++t) {
      const T* kt = kp + t * token_stride;
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qs.data() + g * d_len;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < d_len; ++d) dot += qg[d] * ToFloat(kt[d]);
        if (p.soft_cap > 0.0f) dot = p.soft_cap * std::tanh(dot / p.soft_cap);
        s[g * p.page_size + t] = dot;
      }
    }
    // Merge the page into each query's summary.
    for (int64_t g = 0; g < group; ++g) {
      float* sg = s.data() + g * p.page_size;
      float m_page = -std::numeric_limits<float>::infinity();
      for (int64_t t = t0; t < t1; ++t) m_page = std::max(m_page, sg[t]);
      const float m_new = std::max(m[g], m_page);
      if (!std::isfinite(m_new)) continue;   // nothing finite yet (soft cap keeps scores finite)
      const float w_old = std::exp(m[g] - m_new);   // exp(-inf) = 0 for an empty summary
      float zp = 0.0f;
      for (int64_t t = t0; t < t1; ++t) {
        sg[t] = std::exp(sg[t] - m_new);
        zp += sg[t];
      }
      float* ag = acc.data() + g * d_len;
      if (w_old != 1.0f)
#pragma omp simd
        for (int64_t d = 0; d < d_len; ++d) ag[d] *= w_old;
      for (int64_t t = t0; t < t1; ++t) {
        const T* vt = vp + t * token_stride;
        const float pt = sg[t];
#pragma omp simd
        for (int64_t d = 0; d < d_len; ++d) ag[d] += pt * ToFloat(vt[d]);
      }
      z[g] = z[g] * w_old + zp;
      m[g] = m_new;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const int64_t head = kvh * group + g;
    T* og = out + (tok * p.num_q_heads + head) * d_len;
    if (z[g] > 0.0f) {
      const float inv = 1.0f / z[g];
      for (int64_t d = 0; d < d_len; ++d) FromFloat(acc[g * d_len + d] * inv, og + d);
      lse[tok * p.num_q_heads + head] = m[g] + std::log(z[g]);
    }
  }
}

template <typename T>
using UnitFn = void (*)(const Problem&, const T*, const T*, const T*, const int32_t*,
                        const int32_t*, const int32_t*, T*, float*, int64_t, int64_t);

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
    return ffi::Error::InvalidArgument("paged_jax decode attention: bad ranks, or v's shape differs");
  Problem p{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], td[0], td[1], scale, sliding_window,
            soft_cap};
  if (kd[3] != p.head_dim || p.num_kv_heads < 1 || p.num_q_heads % p.num_kv_heads ||
      p.num_q_heads / p.num_kv_heads > kMaxGroup || p.num_pages < 1 || p.width < 1)
    return ffi::Error::InvalidArgument("paged_jax decode attention: bad shapes");
  if (seq_lens.element_count() != p.num_seqs || cu_q_lens.element_count() != p.num_seqs + 1)
    return ffi::Error::InvalidArgument("paged_jax decode attention: bad row counts");
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

  auto work = std::make_shared<Work>();
  work->total = p.num_seqs * p.num_kv_heads;
  // The copies below (Problem, pointers) are what a late task would read; it reads them only
  // after claiming a unit, which it cannot once all are claimed.
  auto drain = [=]() {
    for (int64_t i; (i = work->next.fetch_add(1)) < work->total;) {
      unit(p, qp, kp, vp, tp, sp, cp, o, l, i / p.num_kv_heads, i % p.num_kv_heads);
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t helpers = 0;
  if (min_units_per_thread > 0) {
    helpers = std::min<int64_t>(pool.num_threads(), work->total / min_units_per_thread) - 1;
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
    return ffi::Error::InvalidArgument("paged_jax decode attention: q, pages and out differ in dtype");
  if (dt == ffi::DataType::F32)
    return Run<float>(pool, q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, scale,
                      sliding_window, soft_cap, min_units_per_thread, out, lse);
  if (dt == ffi::DataType::BF16)
    return Run<uint16_t>(pool, q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, scale,
                         sliding_window, soft_cap, min_units_per_thread, out, lse);
  return ffi::Error::InvalidArgument("paged_jax decode attention: dtype must be f32 or bf16");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedJaxDecodeAttention, Dispatch,
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
