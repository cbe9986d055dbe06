// A matrix product on the CPU through oneDNN (Intel's oneAPI Deep Neural Network Library, the
// library vLLM's CPU build multiplies with), as an XLA FFI custom call (paged_jax/matmul.py
// builds, loads and registers it through cpu_kernel.build; its docstrings are the contract).
//
//   x    T[m, k]
//   w    T[k, n], or T[n, k] with transpose_rhs (the tied LM head: the embedding [vocab, hidden])
//   out  f32[m, n]  (accumulated in f32; the caller casts to T)
// T is f32 or bf16. oneDNN picks its kernels by the CPU's instruction sets, not its maker
// (AVX-512 brgemm on an AMD EPYC too, where MKL runs its generic code). The columns of w are
// split into one block per thread of XLA's intra-op pool, and each block is one oneDNN matmul
// run on that pool thread with a single OpenMP thread (the wheel's oneDNN is built on GNU
// OpenMP; no second team of threads beside XLA's pool). A block is a strided view of w and out:
// nothing is copied or repacked.

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Work {   // column blocks claimed by the caller and pool tasks (see cpu_kernel.cc's Work)
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
};

// Columns per block are a multiple of this (oneDNN's f32 brgemm works on 16-column vectors).
constexpr int64_t kColumnAlign = 16;

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// One primitive per (dtype, m, k, columns, n, transpose): created once (oneDNN JIT-compiles its
// kernel), then shared by every thread (a primitive's execute is thread-safe).
using Key = std::tuple<bool, int64_t, int64_t, int64_t, int64_t, bool>;

struct Product {
  dnnl::matmul prim;
  dnnl::memory::desc a, b, c;
};

std::shared_ptr<const Product> Primitive(const Key& key) {
  static std::mutex mu;
  static std::map<Key, std::shared_ptr<const Product>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const auto [bf16, m, k, cols, n, transpose] = key;
  using dt = dnnl::memory::data_type;
  const dt t = bf16 ? dt::bf16 : dt::f32;
  dnnl::memory::desc a({m, k}, t, dnnl::memory::dims{k, 1});
  // w's column block: [k, cols] with rows n apart, or (transposed) columns k apart.
  dnnl::memory::desc b({k, cols}, t, transpose ? dnnl::memory::dims{1, k}
                                               : dnnl::memory::dims{n, 1});
  dnnl::memory::desc c({m, cols}, dt::f32, dnnl::memory::dims{n, 1});
  auto product = std::make_shared<const Product>(
      Product{dnnl::matmul(dnnl::matmul::primitive_desc(Engine(), a, b, c)), a, b, c});
  cache.emplace(key, product);
  return product;
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, bool transpose_rhs,
                  int64_t min_columns_per_thread, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || od.size() != 2)
    return ffi::Error::InvalidArgument("paged_jax oneDNN matmul: x, w and out must be 2-d");
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = transpose_rhs ? wd[0] : wd[1];
  if ((transpose_rhs ? wd[1] : wd[0]) != k || od[0] != m || od[1] != n)
    return ffi::Error::InvalidArgument("paged_jax oneDNN matmul: shapes do not match");
  const auto dt = x.element_type();
  if (w.element_type() != dt || (dt != ffi::DataType::F32 && dt != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("paged_jax oneDNN matmul: x and w must both be f32 or bf16");
  float* o = out->typed_data();
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::fill(o, o + m * n, 0.0f);
    return ffi::Error::Success();
  }
  const bool bf16 = dt == ffi::DataType::BF16;
  const int64_t size = bf16 ? 2 : 4;
  char* xp = static_cast<char*>(x.untyped_data());
  char* wp = static_cast<char*>(w.untyped_data());

  int64_t threads = 1;
  if (min_columns_per_thread > 0)
    threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), n / min_columns_per_thread));
  const int64_t block = (n + threads - 1) / threads;
  const int64_t cols = std::min(n, (block + kColumnAlign - 1) / kColumnAlign * kColumnAlign);
  std::shared_ptr<const Product> full, tail;
  try {
    full = Primitive({bf16, m, k, cols, n, transpose_rhs});
    if (n % cols) tail = Primitive({bf16, m, k, n % cols, n, transpose_rhs});
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("paged_jax oneDNN matmul: ") + e.what());
  }
  auto work = std::make_shared<Work>();
  work->total = (n + cols - 1) / cols;
  auto failed = std::make_shared<std::atomic<bool>>(false);
  auto drain = [=]() {
    thread_local dnnl::stream stream(Engine());
    omp_set_num_threads(1);   // this pool thread's own setting: oneDNN runs on it alone
    for (int64_t i; (i = work->next.fetch_add(1)) < work->total;) {
      const int64_t n0 = i * cols;
      const bool last = n0 + cols > n;
      const Product& p = last ? *tail : *full;
      try {
        // Row-major: w's column block starts n0 columns in ([k, n]) or n0 rows in ([n, k]).
        dnnl::memory a(p.a, Engine(), xp);
        dnnl::memory b(p.b, Engine(), wp + (transpose_rhs ? n0 * k : n0) * size);
        dnnl::memory c(p.c, Engine(), o + n0);
        p.prim.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
      } catch (const dnnl::error&) {
        failed->store(true);
      }
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 1; h < std::min(threads, work->total); ++h) pool.Schedule(decltype(drain)(drain));
  drain();
  while (work->done.load(std::memory_order_acquire) < work->total) std::this_thread::yield();
  if (failed->load()) return ffi::Error::Internal("paged_jax oneDNN matmul: a block failed");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedJaxOnednnMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_rhs")
                                  .Attr<int64_t>("min_columns_per_thread")
                                  .Ret<ffi::Buffer<ffi::F32>>());
