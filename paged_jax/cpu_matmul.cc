// A matrix product on the CPU through Intel MKL, as an XLA FFI custom call (paged_jax/matmul.py
// builds, loads and registers it through cpu_kernel.build; its docstrings are the contract).
//
//   x    T[m, k]
//   w    T[k, n], or T[n, k] with transpose_rhs (the tied LM head: the embedding [vocab, hidden])
//   out  f32[m, n]  (accumulated in f32; the caller casts to T)
// T is f32 (cblas_sgemm) or bf16 (cblas_gemm_bf16bf16f32). MKL is linked sequential, and the
// columns of w are split into one block per thread of XLA's intra-op pool, so the product runs
// on the threads XLA already owns (no OpenMP runtime beside XLA's pool).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "mkl_cblas.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Work {   // column blocks claimed by the caller and pool tasks (see cpu_kernel.cc's Work)
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
};

// Columns per block are a multiple of this (a cache line of f32).
constexpr int64_t kColumnAlign = 16;

ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, bool transpose_rhs,
                  int64_t min_columns_per_thread, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || od.size() != 2)
    return ffi::Error::InvalidArgument("paged_jax cpu matmul: x, w and out must be 2-d");
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = transpose_rhs ? wd[0] : wd[1];
  if ((transpose_rhs ? wd[1] : wd[0]) != k || od[0] != m || od[1] != n)
    return ffi::Error::InvalidArgument("paged_jax cpu matmul: shapes do not match");
  const auto dt = x.element_type();
  if (w.element_type() != dt || (dt != ffi::DataType::F32 && dt != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("paged_jax cpu matmul: x and w must both be f32 or bf16");
  float* o = out->typed_data();
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::fill(o, o + m * n, 0.0f);
    return ffi::Error::Success();
  }
  const bool bf16 = dt == ffi::DataType::BF16;
  const void* xp = x.untyped_data();
  const void* wp = w.untyped_data();

  int64_t threads = 1;
  if (min_columns_per_thread > 0)
    threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), n / min_columns_per_thread));
  const int64_t block = (n + threads - 1) / threads;
  const int64_t cols = std::min(n, (block + kColumnAlign - 1) / kColumnAlign * kColumnAlign);
  auto work = std::make_shared<Work>();
  work->total = (n + cols - 1) / cols;
  auto drain = [=]() {
    for (int64_t i; (i = work->next.fetch_add(1)) < work->total;) {
      const int64_t n0 = i * cols, nn = std::min(cols, n - n0);
      // Row-major: w's column block starts n0 columns in ([k, n]) or n0 rows in ([n, k]).
      const int64_t w_off = transpose_rhs ? n0 * k : n0;
      const int64_t ldw = transpose_rhs ? k : n;
      const auto tw = transpose_rhs ? CblasTrans : CblasNoTrans;
      if (bf16) {
        cblas_gemm_bf16bf16f32(CblasRowMajor, CblasNoTrans, tw, m, nn, k, 1.0f,
                               static_cast<const MKL_BF16*>(xp), k,
                               static_cast<const MKL_BF16*>(wp) + w_off, ldw, 0.0f, o + n0, n);
      } else {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, tw, m, nn, k, 1.0f,
                    static_cast<const float*>(xp), k, static_cast<const float*>(wp) + w_off, ldw,
                    0.0f, o + n0, n);
      }
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 1; h < std::min(threads, work->total); ++h) pool.Schedule(decltype(drain)(drain));
  drain();
  while (work->done.load(std::memory_order_acquire) < work->total) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedJaxCpuMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_rhs")
                                  .Attr<int64_t>("min_columns_per_thread")
                                  .Ret<ffi::Buffer<ffi::F32>>());
