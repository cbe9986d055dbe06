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
//
// Packed weights (PagedJaxOnednnPackedMatmul): w in the layout oneDNN's own kernel (brgemm)
// asks for, made once on the host by PagedJaxOnednnPack (matmul.onednn_pack). oneDNN 3.2's
// brgemm takes neither a strided w nor a strided out (a strided block runs its older jit
// gemm), so a packed product is split either by rows (many rows: each thread a dense run of
// rows of x and out, all of w) or by columns (few rows: each thread whole column blocks of the
// packed w, which are contiguous in it, into a dense scratch copied into out). The packed w may be
// a stack of one weight per layer with an i32 layer index beside it (a scanned model's layers:
// read in place, where XLA would copy a slice of the stack before the call).

#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

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
  dnnl::memory::desc a, b, c, scratch;
};

// A product's primitive, made for one OpenMP thread (the calling thread's setting when it is
// made fixes how many threads oneDNN's kernel divides its work between) and a scratchpad the
// caller passes: oneDNN's own ("library" mode) is shared between threads in this build, and two
// pool threads running one primitive at once gave wrong products (bf16, a K tail).
std::shared_ptr<const Product> MakeProduct(const dnnl::memory::desc& a,
                                           const dnnl::memory::desc& b,
                                           const dnnl::memory::desc& c) {
  omp_set_num_threads(1);
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::matmul::primitive_desc pd(Engine(), a, b, c, attr);
  return std::make_shared<const Product>(Product{dnnl::matmul(pd), a, b, c, pd.scratchpad_desc()});
}

// Runs p on this thread: x, w (its block) and out at the given addresses, with this thread's
// own scratchpad.
void Execute(const Product& p, dnnl::stream& stream, const void* x, const void* w, float* out) {
  thread_local std::vector<char> scratch;
  if (scratch.size() < p.scratch.get_size()) scratch.resize(p.scratch.get_size());
  dnnl::memory a(p.a, Engine(), const_cast<void*>(x)), b(p.b, Engine(), const_cast<void*>(w)),
      c(p.c, Engine(), out), pad(p.scratch, Engine(), scratch.data());
  p.prim.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c},
                          {DNNL_ARG_SCRATCHPAD, pad}});
}

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
  auto product = MakeProduct(a, b, c);
  cache.emplace(key, product);
  return product;
}

// Runs task(stream, i) for i in [0, total) on the caller and up to threads - 1 pool threads, each
// with its own oneDNN stream and one OpenMP thread (that thread's own setting: oneDNN runs on it
// alone); false if a task threw. Returns once every block is done; a pool task that starts later
// finds no block left and does not call task.
template <typename Task>
bool RunBlocks(ffi::ThreadPool& pool, int64_t threads, int64_t total, Task task) {
  auto work = std::make_shared<Work>();
  work->total = total;
  auto failed = std::make_shared<std::atomic<bool>>(false);
  auto drain = [=]() {
    thread_local dnnl::stream stream(Engine());
    omp_set_num_threads(1);
    for (int64_t i; (i = work->next.fetch_add(1)) < work->total;) {
      try {
        task(stream, i);
      } catch (const dnnl::error&) {
        failed->store(true);
      }
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 1; h < std::min(threads, total); ++h) pool.Schedule(decltype(drain)(drain));
  drain();
  while (work->done.load(std::memory_order_acquire) < work->total) std::this_thread::yield();
  return !failed->load();
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
  const bool ok = RunBlocks(pool, threads, (n + cols - 1) / cols,
                            [&](dnnl::stream& stream, int64_t i) {
    const int64_t n0 = i * cols;
    const Product& p = n0 + cols > n ? *tail : *full;
    // Row-major: w's column block starts n0 columns in ([k, n]) or n0 rows in ([n, k]).
    Execute(p, stream, xp, wp + (transpose_rhs ? n0 * k : n0) * size, o + n0);
  });
  return ok ? ffi::Error::Success()
            : ffi::Error::Internal("paged_jax oneDNN matmul: a block failed");
}

// ----------------------------------------------------------------------------- packed weights

using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

// The packed layouts taken: column blocks outermost ("BA": for each block of `block` columns,
// all of k), so a run of whole column blocks is a contiguous run of bytes, and a block of
// columns packed alone is that run. oneDNN chose BA16a64b (f32) and BA16a64b2a (bf16) on an
// AVX-512 CPU at every row count from 1 to 4,560.
constexpr std::pair<tag, int64_t> kPackedTags[] = {
    {tag::BA16a64b, 64},   {tag::BA16a48b, 48},   {tag::BA16a32b, 32},   {tag::BA16a16b, 16},
    {tag::BA16a64b2a, 64}, {tag::BA16a48b2a, 48}, {tag::BA16a32b2a, 32}, {tag::BA16a16b2a, 16}};

struct Layout {
  tag t = tag::undef;
  int64_t block = 0;   // columns per block; 0: oneDNN asked for a layout not in kPackedTags
  int64_t bytes = 0;   // of the whole packed [k, n]
  int64_t block_bytes = 0;
};

// The layout oneDNN's matmul asks for w [k, n] in (asked at 32 rows), cached.
Layout PackedLayout(bool bf16, int64_t k, int64_t n) {
  static std::mutex mu;
  static std::map<std::tuple<bool, int64_t, int64_t>, Layout> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_tuple(bf16, k, n);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const dt t = bf16 ? dt::bf16 : dt::f32;
  dnnl::memory::desc a({32, k}, t, tag::ab), b({k, n}, t, tag::any), c({32, n}, dt::f32, tag::ab);
  const dnnl::memory::desc chosen = dnnl::matmul::primitive_desc(Engine(), a, b, c).weights_desc();
  Layout layout;
  for (const auto& [candidate, block] : kPackedTags) {
    if (dnnl::memory::desc({k, n}, t, candidate) == chosen) {
      layout = {candidate, block, static_cast<int64_t>(chosen.get_size()),
                static_cast<int64_t>(dnnl::memory::desc({k, block}, t, candidate).get_size())};
      break;
    }
  }
  cache.emplace(key, layout);
  return layout;
}

// One primitive per (dtype, rows, k, columns, layout) on the packed w: x, w's column block and
// out dense.
using PackedKey = std::tuple<bool, int64_t, int64_t, int64_t, int>;

std::shared_ptr<const Product> PackedPrimitive(bool bf16, int64_t m, int64_t k, int64_t cols,
                                               tag layout) {
  static std::mutex mu;
  static std::map<PackedKey, std::shared_ptr<const Product>> cache;
  std::lock_guard<std::mutex> lock(mu);
  const PackedKey key{bf16, m, k, cols, static_cast<int>(layout)};
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const dt t = bf16 ? dt::bf16 : dt::f32;
  dnnl::memory::desc a({m, k}, t, tag::ab), b({k, cols}, t, layout), c({m, cols}, dt::f32, tag::ab);
  auto product = MakeProduct(a, b, c);
  cache.emplace(key, product);
  return product;
}

// The rows a product of `valid` real rows computes: exactly `valid` up to 16, then `valid`
// rounded up to a multiple of 8 (to 512), 16 (to 1,024) or 32, so that the primitives made for
// the row counts a server meets stay ~130 (each new count JIT-compiles ~1-1.5 ms of oneDNN
// kernel per shape on first use) while a prompt's step multiplies at most 7 rows it need not.
int64_t ComputedRows(int64_t valid) {
  if (valid <= 16) return valid;
  const int64_t granule = valid <= 512 ? 8 : valid <= 1024 ? 16 : 32;
  return (valid + granule - 1) / granule * granule;
}

// w is one packed weight (1-d) or a stack of them, one per layer ([layers, elements]), of which
// the product reads layer `layer` (a scanned model's layer index: the stack is read in place,
// where a slice of it would be copied before the call). `valid` (a scalar; < 0: every row): the
// rows of x that are real, the rest padding; rows of out at and past it are zero, and only
// `ComputedRows(valid)` rows are multiplied.
ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> valid, int64_t n,
                        int64_t min_columns_per_thread, int64_t min_rows_per_thread,
                        ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto xd = x.dimensions(), od = out->dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || od.size() != 2 || (wd.size() != 1 && wd.size() != 2) ||
      layer.element_count() != 1 || valid.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "paged_jax oneDNN packed matmul: x and out must be 2-d, the packed w 1-d or [layers, "
        "elements], layer and valid scalars");
  const int64_t layers = wd.size() == 2 ? wd[0] : 1;
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= layers)
    return ffi::Error::InvalidArgument("paged_jax oneDNN packed matmul: layer " +
                                       std::to_string(index) + " is not in [0, " +
                                       std::to_string(layers) + ")");
  const int64_t rows_in = xd[0], k = xd[1];
  if (od[0] != rows_in || od[1] != n)
    return ffi::Error::InvalidArgument("paged_jax oneDNN packed matmul: out is not [m, n]");
  int64_t real = valid.typed_data()[0];
  if (real < 0 || real > rows_in) real = rows_in;
  const int64_t m = std::min(rows_in, ComputedRows(real));   // the rows multiplied
  const auto type = x.element_type();
  if (w.element_type() != type || (type != ffi::DataType::F32 && type != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument(
        "paged_jax oneDNN packed matmul: x and w must both be f32 or bf16");
  const bool bf16 = type == ffi::DataType::BF16;
  const int64_t size = bf16 ? 2 : 4;
  Layout layout;
  try {
    layout = PackedLayout(bf16, k, n);
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("paged_jax oneDNN packed matmul: ") + e.what());
  }
  const int64_t layer_bytes = static_cast<int64_t>(w.size_bytes()) / layers;
  if (layout.block == 0 || layer_bytes != layout.bytes)
    return ffi::Error::InvalidArgument(
        "paged_jax oneDNN packed matmul: w is not oneDNN's packed [" + std::to_string(k) + ", " +
        std::to_string(n) + "] (" + std::to_string(layer_bytes) + " bytes a layer, want " +
        std::to_string(layout.bytes) + ")");
  float* o = out->typed_data();
  if (n == 0) return ffi::Error::Success();
  std::fill(o + m * n, o + rows_in * n, 0.0f);   // the padding rows not multiplied
  if (m == 0) return ffi::Error::Success();
  const char* xp = static_cast<const char*>(x.untyped_data());
  const char* wp = static_cast<const char*>(w.untyped_data()) + index * layer_bytes;
  const ffi::Error done = [&]() -> ffi::Error {
    const int64_t pool_threads = std::max<int64_t>(1, pool.num_threads());

    if (min_rows_per_thread > 0 && m >= 2 * min_rows_per_thread && pool_threads > 1) {
      // By rows: thread t takes rows [t * rows, (t + 1) * rows) of x and out, and all of w.
      const int64_t threads = std::min(pool_threads, m / min_rows_per_thread);
      const int64_t rows = (m + threads - 1) / threads;
      std::shared_ptr<const Product> full, tail;
      try {
        full = PackedPrimitive(bf16, rows, k, n, layout.t);
        if (m % rows) tail = PackedPrimitive(bf16, m % rows, k, n, layout.t);
      } catch (const dnnl::error& e) {
        return ffi::Error::Internal(std::string("paged_jax oneDNN packed matmul: ") + e.what());
      }
      const int64_t total = (m + rows - 1) / rows;
      const bool ok = RunBlocks(pool, threads, total, [&](dnnl::stream& stream, int64_t i) {
        const int64_t r0 = i * rows;
        const Product& p = r0 + rows > m ? *tail : *full;
        Execute(p, stream, xp + r0 * k * size, wp, o + r0 * n);
      });
      return ok ? ffi::Error::Success()
                : ffi::Error::Internal("paged_jax oneDNN packed matmul: a block failed");
    }

    // By columns: blocks of whole packed column blocks, each into a dense scratch of [m, cols].
    int64_t threads = 1;
    if (min_columns_per_thread > 0)
      threads = std::max<int64_t>(1, std::min(pool_threads, n / min_columns_per_thread));
    const int64_t per = (n + threads - 1) / threads;
    const int64_t cols = std::min(n, (per + layout.block - 1) / layout.block * layout.block);
    const int64_t total = (n + cols - 1) / cols;
    std::shared_ptr<const Product> full, tail;
    try {
      full = PackedPrimitive(bf16, m, k, cols, layout.t);
      if (n % cols) tail = PackedPrimitive(bf16, m, k, n % cols, layout.t);
    } catch (const dnnl::error& e) {
      return ffi::Error::Internal(std::string("paged_jax oneDNN packed matmul: ") + e.what());
    }
    const bool ok = RunBlocks(pool, threads, total, [&](dnnl::stream& stream, int64_t i) {
      const int64_t n0 = i * cols, width = std::min(cols, n - n0);
      const Product& p = width < cols ? *tail : *full;
      thread_local std::vector<float> scratch;
      float* dst = o;   // one block: out itself is dense
      if (total > 1) {
        if (static_cast<int64_t>(scratch.size()) < m * width) scratch.resize(m * width);
        dst = scratch.data();
      }
      Execute(p, stream, xp, wp + (n0 / layout.block) * layout.block_bytes, dst);
      if (total > 1)
        for (int64_t r = 0; r < m; ++r)
          std::copy(dst + r * width, dst + (r + 1) * width, o + r * n + n0);
    });
    return ok ? ffi::Error::Success()
              : ffi::Error::Internal("paged_jax oneDNN packed matmul: a block failed");
  }();
  if (!done.failure() && real < m)
    std::fill(o + real * n, o + m * n, 0.0f);   // the rows rounding computed past `real`
  return done;
}

}  // namespace

// Host-side entry points (ctypes; matmul.onednn_pack).

// Bytes of w [k, n] packed as oneDNN asks (its column block in *block), or -1 where oneDNN
// asks for a layout PackedMatmul does not take, -2 on a oneDNN error.
extern "C" int64_t PagedJaxOnednnPackedBytes(int bf16, int64_t k, int64_t n, int64_t* block) {
  try {
    const Layout layout = PackedLayout(bf16 != 0, k, n);
    *block = layout.block;
    return layout.block ? layout.bytes : -1;
  } catch (const dnnl::error&) {
    return -2;
  }
}

// Packs w (T[k, n] row-major, or T[n, k] with transpose) into dst (PagedJaxOnednnPackedBytes
// bytes); 0 on success.
extern "C" int PagedJaxOnednnPack(int bf16, int64_t k, int64_t n, int transpose, const void* src,
                                  void* dst) {
  try {
    const Layout layout = PackedLayout(bf16 != 0, k, n);
    if (!layout.block) return 1;
    const dt t = bf16 ? dt::bf16 : dt::f32;
    dnnl::memory::desc from({k, n}, t, transpose ? dnnl::memory::dims{1, k}
                                                 : dnnl::memory::dims{n, 1});
    dnnl::memory::desc to({k, n}, t, layout.t);
    std::memset(dst, 0, layout.bytes);   // the padding of a partial block stays zero
    dnnl::memory a(from, Engine(), const_cast<void*>(src)), b(to, Engine(), dst);
    dnnl::stream stream(Engine());
    dnnl::reorder(a, b).execute(stream, a, b);
    stream.wait();
    return 0;
  } catch (const dnnl::error&) {
    return 2;
  }
}

// oneDNN's name for the kernel it runs a packed product of m rows and cols columns with (e.g.
// "brg:avx512_core"), into buf; for tests.
extern "C" int PagedJaxOnednnPackedImpl(int bf16, int64_t m, int64_t k, int64_t cols, char* buf,
                                        int64_t len) {
  try {
    const Layout layout = PackedLayout(bf16 != 0, k, cols);
    if (!layout.block) return 1;
    const dt t = bf16 ? dt::bf16 : dt::f32;
    dnnl::memory::desc a({m, k}, t, tag::ab), b({k, cols}, t, layout.t),
        c({m, cols}, dt::f32, tag::ab);
    omp_set_num_threads(1);
    const std::string impl = dnnl::matmul::primitive_desc(Engine(), a, b, c).impl_info_str();
    std::snprintf(buf, len, "%s", impl.c_str());
    return 0;
  } catch (const dnnl::error&) {
    return 2;
  }
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedJaxOnednnMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_rhs")
                                  .Attr<int64_t>("min_columns_per_thread")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedJaxOnednnPackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("min_columns_per_thread")
                                  .Attr<int64_t>("min_rows_per_thread")
                                  .Ret<ffi::Buffer<ffi::F32>>());
