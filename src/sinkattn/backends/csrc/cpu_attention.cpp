// The CPU path's tiles in one compiled kernel: the softmax over keys of each row (forward) and its
// gradients (backward), for every sequence of a packed batch in one call, without a pass over memory
// between the products. Built on first use for the instruction set PyTorch dispatches to
// (sinkattn/backends/cpu_native.py); the numerics are those of cpu_tiles.py, whose docstring explains
// them. Inputs are fp32 and contiguous, lengths and visible key ranges are given by the caller:
//
//   q [Tq, HQ, D], k [Tk, HKV, D], v [Tk, HKV, Dv], cu_q / cu_k [N + 1] int64,
//   bounds [Tq, 2] int64: the keys [lo, hi) of its sequence that a query token sees (hi <= lo: none),
//   skip [N] int64 or empty: the sequences the caller computes another way (the kernel writes none of their
//   results: rows, statistics, dK/dV of their keys).
//
// A task is one sequence and one KV head: its G query heads are stacked as the rows of a block
// (at most BM rows: R = BM / G positions of each head), its keys in chunks of at most BN, both sized
// to the sequence (Layout); the forward's tasks are its row blocks, and the backward's split passes
// (backward_impl) take a row block or a chunk of keys. Tasks run in parallel; each result element is
// written by exactly one task, in a fixed order, so results do not depend on the thread count. The
// products take fp32 operands, or bf16 ones for inputs that are bf16 values (Operands: P and dS
// rounded, or split hi + lo).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif


namespace {

using Vec = at::vec::Vectorized<float>;
using bf16 = at::BFloat16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kExpFloor = -87.0f;   // cpu_tiles.EXP_FLOOR
constexpr double kDominantFrom = 0.5;   // cpu_tiles.DOMINANT_FROM

// Row-major C[M, N] (+)= A[M, K] B[K, N] on one thread, accumulated and returned in fp32. Operands T = float:
// oneDNN's batch-reduce GEMM (BLAS where it has none); T = bf16: PyTorch's bf16 x bf16 -> fp32 GEMM (oneMKL's,
// on AMX or AVX512-BF16 units where the CPU has them), whose products of bf16 values are exact.
template <typename T>
void mm(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, float* C, int64_t ldc,
        bool add) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!add) for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, 0.0f);
    return;
  }
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C, false);
}

// e^(x - c) - e^floor with the exponent floored, over n elements in place; every element goes through
// the same vector code (a partial vector for the tail), so its bits do not depend on its position.
float exp_floor_value() {
  float x = kExpFloor;
  Vec::loadu(&x, 1).exp().store(&x, 1);
  return x;
}

// Four independent vector accumulators: a row's reductions run at the adder's throughput, not its latency.
struct Acc4 {
  Vec a[4];
  explicit Acc4(float init) : a{Vec(init), Vec(init), Vec(init), Vec(init)} {}
  float sum() const { return at::vec::vec_reduce_all<float>(std::plus<Vec>(), (a[0] + a[1]) + (a[2] + a[3])); }
  float max() const {
    auto mx = [](Vec& x, Vec& y) { return at::vec::maximum(x, y); };
    return at::vec::vec_reduce_all<float>(mx, at::vec::maximum(at::vec::maximum(a[0], a[1]),
                                                                at::vec::maximum(a[2], a[3])));
  }
};

// Returns the sum of what it wrote.
float exp_shifted(float* x, int64_t n, float c, float scale_after, float at_floor) {
  const Vec vc(c), vfloor(kExpFloor), vat(at_floor), vs(scale_after);
  auto one = [&](Vec v) { return (at::vec::maximum(v - vc, vfloor).exp() - vat) * vs; };
  Acc4 acc(0.0f);
  int64_t j = 0;
  for (int64_t u = 0; j + Vec::size() <= n; j += Vec::size(), u = (u + 1) & 3) {
    const Vec e = one(Vec::loadu(x + j));
    e.store(x + j);
    acc.a[u] = acc.a[u] + e;
  }
  if (j < n) {
    const Vec e = one(Vec::loadu(x + j, n - j));
    e.store(x + j, n - j);
    acc.a[0] = acc.a[0] + Vec::set(Vec(0.0f), e, n - j);
  }
  return acc.sum();
}

// max of x[0, n): -inf for none
float row_max(const float* x, int64_t n) {
  Acc4 acc(kNegInf);
  int64_t j = 0;
  for (int64_t u = 0; j + Vec::size() <= n; j += Vec::size(), u = (u + 1) & 3)
    acc.a[u] = at::vec::maximum(acc.a[u], Vec::loadu(x + j));
  if (j < n) acc.a[0] = at::vec::maximum(acc.a[0], Vec::set(Vec(kNegInf), Vec::loadu(x + j, n - j), n - j));
  return acc.max();
}

// sum of x[j] y[j] over [0, n)
float dot(const float* x, const float* y, int64_t n) {
  Acc4 acc(0.0f);
  int64_t j = 0;
  for (int64_t u = 0; j + Vec::size() <= n; j += Vec::size(), u = (u + 1) & 3)
    acc.a[u] = at::vec::fmadd(Vec::loadu(x + j), Vec::loadu(y + j), acc.a[u]);
  if (j < n) acc.a[0] = at::vec::fmadd(Vec::loadu(x + j, n - j), Vec::loadu(y + j, n - j), acc.a[0]);
  return acc.sum();
}

// whether every x[j] of [0, n) is finite: x - x is 0 for those, NaN for inf and NaN
bool all_finite(const float* x, int64_t n) {
  Acc4 acc(0.0f);
  int64_t j = 0;
  for (int64_t u = 0; j + Vec::size() <= n; j += Vec::size(), u = (u + 1) & 3) {
    const Vec e = Vec::loadu(x + j);
    acc.a[u] = acc.a[u] + (e - e);
  }
  if (j < n) {
    const Vec e = Vec::loadu(x + j, n - j);
    acc.a[0] = acc.a[0] + Vec::set(Vec(0.0f), e - e, n - j);
  }
  return acc.sum() == 0.0f;
}

template <typename T = float>
struct Aligned {
  std::vector<T> data;
  T* get(int64_t n) {
    constexpr int64_t slack = 64 / sizeof(T);
    if ((int64_t)data.size() < n + slack) data.resize(n + slack);
    auto p = reinterpret_cast<uintptr_t>(data.data());
    return data.data() + ((64 - p % 64) % 64) / sizeof(T);
  }
};

// fp32 rows x [rows, n] (row stride ld) as the operands of a product of type T, in the same layout: for
// T = float, x itself; for T = bf16, x rounded (hi = bf16(x)) and, for a compensated product, also the
// rounding of what remains (lo = bf16(x - hi)): hi + lo holds x to about 16 bits, and the product is
// taken as the sum of the products of both.
template <typename T>
struct Operands {
  const T* part[2];
  int count;
};

template <typename T>
Operands<T> operands(const float* x, int64_t rows, int64_t n, int64_t ld, Aligned<T>& buf, bool compensated) {
  if constexpr (std::is_same_v<T, float>) {
    return {{x, nullptr}, 1};
  } else {
    using VB = at::vec::Vectorized<bf16>;
    bf16* hi = buf.get((compensated ? 2 : 1) * rows * ld);
    bf16* lo = compensated ? hi + rows * ld : nullptr;
    for (int64_t i = 0; i < rows; ++i) {
      const float* xi = x + i * ld;
      bf16 *hi_i = hi + i * ld, *lo_i = compensated ? lo + i * ld : nullptr;
      int64_t j = 0;
      for (; j + VB::size() <= n; j += VB::size()) {
        const Vec a = Vec::loadu(xi + j), b = Vec::loadu(xi + j + Vec::size());
        const VB h = at::vec::convert_from_float<bf16>(a, b);
        h.store(hi_i + j);
        if (compensated) {
          auto [ah, bh] = at::vec::convert_to_float<bf16>(h);
          at::vec::convert_from_float<bf16>(a - ah, b - bh).store(lo_i + j);
        }
      }
      for (; j < n; ++j) {
        hi_i[j] = bf16(xi[j]);
        if (compensated) lo_i[j] = bf16(xi[j] - (float)hi_i[j]);
      }
    }
    return {{hi, lo}, compensated ? 2 : 1};
  }
}

// A row stride for n floats: a whole number of 64-byte lines, never a multiple of 1 KiB. Rows 4 KiB
// apart share a cache set (and look alike to the store forwarding), which halves the products' speed
// at power-of-two lengths.
inline int64_t padded(int64_t n) {
  const int64_t r = (n + 15) / 16 * 16;
  return r % 256 == 0 ? r + 16 : r;
}

// Each sequence's keys in chunks of bn keys, the last one zero-padded, and its rows in blocks of r
// positions of each of the G heads: every product of the kernel then has one of a few shapes and row
// strides. (oneDNN compiles a kernel per shape and stride, and PyTorch keeps each one, about 200 KiB,
// for the life of the process: shapes that followed the lengths grew memory with every new length.)
// bn and r are the smallest of a few sizes (powers of two up to BN and R) that hold the sequence, so
// that a short sequence is not padded to a long one's tiles; they follow the sequence's own lengths, so
// its results do not depend on what it is packed with.
int64_t size_class(int64_t length, int64_t largest) {
  int64_t size = std::max<int64_t>(1, largest / 8);
  while (size < length && size < largest) size *= 2;
  return std::min(size, largest);
}

struct Layout {
  std::vector<int64_t> bn, ld, r, chunks;   // per sequence: chunk size, its row stride, block positions, chunks
  std::vector<int64_t> keys, cols;          // per sequence: padded keys and [*, ld] columns before it
  // lq / lk: the query and key counts the kernel takes of each sequence (Shape::lq, lk)
  Layout(const int64_t* lq, const int64_t* lk, int64_t N, int64_t BN, int64_t R)
      : bn(N), ld(N), r(N), chunks(N), keys(N + 1, 0), cols(N + 1, 0) {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t Lk = lk[n];
      bn[n] = size_class(Lk, BN);
      ld[n] = padded(bn[n]);
      r[n] = size_class(lq[n], R);
      chunks[n] = (Lk + bn[n] - 1) / bn[n];
      keys[n + 1] = keys[n] + chunks[n] * bn[n];
      cols[n + 1] = cols[n] + chunks[n] * ld[n];
    }
  }
  int64_t total_keys() const { return keys.back(); }
  int64_t total_cols() const { return cols.back(); }
  // x [T, H, W] as chunked by chunked(): head h of sequence n, transposed ([chunks, W, ld]) or as rows
  // ([keys, W], key j at j * W)
  template <typename T>
  T* transposed(T* X, int64_t h, int64_t n, int64_t W) const { return X + (h * total_cols() + cols[n]) * W; }
  template <typename T>
  T* rows(T* X, int64_t h, int64_t n, int64_t W) const { return X + (h * total_keys() + keys[n]) * W; }
};

// oneMKL's thread count for the calling thread, where PyTorch carries oneMKL (libtorch_cpu exports it on
// x86-64; weak: null elsewhere).
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

// For its lifetime, the products of this thread run on it alone. A GEMM that PyTorch hands to oneMKL (bf16
// operands, or fp32 where oneDNN has no kernel) opens an OpenMP team of its own: of the calling thread's
// OpenMP thread count outside a parallel region (a call of one task), and of oneMKL's count inside one
// when nested parallelism is on; its sums then depend on the team. Both counts are held to 1.
struct OneThreadProducts {
  int mkl = 0;
#ifdef _OPENMP
  int omp = omp_get_max_threads();
#endif
  OneThreadProducts() {
    if (MKL_Set_Num_Threads_Local) mkl = MKL_Set_Num_Threads_Local(1);
#ifdef _OPENMP
    omp_set_num_threads(1);
#endif
  }
  ~OneThreadProducts() {
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(mkl);
#ifdef _OPENMP
    omp_set_num_threads(omp);
#endif
  }
};

// body(first, n, step) on each of the threads PyTorch uses for an op (at::get_num_threads()): thread i
// takes tasks i, i + T, ... of [0, n), so that tasks of growing cost (causal row blocks) spread evenly.
// OpenMP directly, not at::parallel_for, whose OpenMP loop lives in this file's headers: it follows
// torch's thread count only when the two share one OpenMP runtime.
template <typename F>
void parallel_tasks(int64_t n, const F& body) {
  if (n <= 0) return;
  const int64_t T = at::in_parallel_region() ? 1 : std::min<int64_t>(n, at::get_num_threads());
#ifdef _OPENMP
  if (T > 1) {
    std::exception_ptr error;
#pragma omp parallel num_threads((int)T)
    {
      try {
        OneThreadProducts one;
        body(omp_get_thread_num(), n, omp_get_num_threads());
      } catch (...) {
#pragma omp critical
        if (!error) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
#endif
  OneThreadProducts one;
  body(0, n, 1);
}

// x [T, H, W] by sequence in chunks (Layout), as operands of type T (x's values must be T's: the caller's
// bf16 inputs): each chunk transposed, [W, ld], or as rows, [bn, W].
template <typename T>
at::Tensor chunked(const at::Tensor& x, const int64_t* ck, const int64_t* lk, int64_t N, const Layout& L,
                   bool transposed) {
  const int64_t H = x.size(1), W = x.size(2);
  at::Tensor out = at::zeros({H, (transposed ? L.total_cols() : L.total_keys()) * W},
                             x.options().dtype(c10::CppTypeToScalarType<T>::value));
  const float* X = x.data_ptr<float>();
  T* Y = out.data_ptr<T>();
  parallel_tasks(H * N, [&](int64_t first, int64_t end, int64_t step) {
    for (int64_t t = first; t < end; t += step) {
      const int64_t h = t / N, n = t % N, bn = L.bn[n], ld = L.ld[n];
      T* seq = transposed ? L.transposed(Y, h, n, W) : L.rows(Y, h, n, W);
      for (int64_t j = 0; j < lk[n]; ++j) {
        const float* src = X + ((ck[n] + j) * H + h) * W;
        if (transposed) {
          T* chunk = seq + j / bn * W * ld;
          for (int64_t d = 0; d < W; ++d) chunk[d * ld + j % bn] = T(src[d]);
        } else {
          at::vec::convert(src, seq + j * W, W);
        }
      }
    }
  });
  return out;
}

struct Shape {
  int64_t Tq, Tk, HQ, HKV, G, D, Dv, N;
  std::vector<int64_t> lq, lk;   // per sequence: the queries and keys the kernel takes (0, 0 for one it skips)
};

// A tensor as the kernel reads or writes it: on the CPU, contiguous, of this dtype and these sizes.
void expect(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef sizes) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.sizes() == sizes,
              "sinkattn_cpu: ", name, " must be a contiguous CPU ", dtype, " tensor of shape ", sizes, ", got ",
              t.scalar_type(), " ", t.sizes(), t.is_contiguous() ? "" : " (not contiguous)");
}

// The call's sizes, after checking q, k, v, the sequence bounds and the tensors of shape [HQ, Tq].
// skip: int64 [N] (nonzero: a sequence the caller computes another way: the kernel writes none of its results),
// or empty.
Shape shape_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
               const at::Tensor& cu_k, const at::Tensor& bounds, const at::Tensor& skip,
               std::initializer_list<const at::Tensor*> per_row) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && cu_q.dim() == 1 && cu_q.numel() >= 1,
              "sinkattn_cpu: q, k, v must be [T, H, D] and cu_q [N + 1]");
  Shape s{q.size(0), k.size(0), q.size(1), k.size(1), 0, q.size(2), v.size(2), cu_q.numel() - 1, {}, {}};
  TORCH_CHECK(s.HKV > 0 && s.HQ % s.HKV == 0, "sinkattn_cpu: q's heads must be a multiple of k's");
  s.G = s.HQ / s.HKV;
  expect(q, "q", at::kFloat, {s.Tq, s.HQ, s.D});
  expect(k, "k", at::kFloat, {s.Tk, s.HKV, s.D});
  expect(v, "v", at::kFloat, {s.Tk, s.HKV, s.Dv});
  expect(cu_q, "cu_q", at::kLong, {s.N + 1});
  expect(cu_k, "cu_k", at::kLong, {s.N + 1});
  expect(bounds, "bounds", at::kLong, {s.Tq, 2});
  for (const at::Tensor* t : per_row) expect(*t, "a per-row tensor", at::kFloat, {s.HQ, s.Tq});
  const int64_t *cq = cu_q.data_ptr<int64_t>(), *ck = cu_k.data_ptr<int64_t>();
  TORCH_CHECK(cq[0] == 0 && ck[0] == 0 && cq[s.N] == s.Tq && ck[s.N] == s.Tk,
              "sinkattn_cpu: cu_q and cu_k must run from 0 to Tq and Tk");
  const int64_t* b = bounds.data_ptr<int64_t>();
  if (skip.numel()) expect(skip, "skip", at::kLong, {s.N});
  const int64_t* sk = skip.numel() ? skip.data_ptr<int64_t>() : nullptr;
  s.lq.resize(s.N);
  s.lk.resize(s.N);
  for (int64_t n = 0; n < s.N; ++n) {
    TORCH_CHECK(cq[n] <= cq[n + 1] && ck[n] <= ck[n + 1], "sinkattn_cpu: cu_q and cu_k must not decrease");
    const bool skipped = sk && sk[n];
    s.lq[n] = skipped ? 0 : cq[n + 1] - cq[n];
    s.lk[n] = skipped ? 0 : ck[n + 1] - ck[n];
    for (int64_t t = cq[n]; t < cq[n + 1]; ++t)
      TORCH_CHECK(b[2 * t + 1] <= b[2 * t] || (b[2 * t] >= 0 && b[2 * t + 1] <= ck[n + 1] - ck[n]),
                  "sinkattn_cpu: bounds must lie within their sequence's keys");
  }
  return s;
}

// One row block: positions [r0, r1) of a sequence, its keys [k0, k1) (the union of its rows' ranges).
struct Block {
  int64_t r0, r1, k0, k1;
};

std::vector<Block> row_blocks(const int64_t* bounds, int64_t tq0, int64_t Lq, int64_t R) {
  std::vector<Block> blocks;
  for (int64_t r0 = 0; r0 < Lq; r0 += R) {
    const int64_t r1 = std::min(Lq, r0 + R);
    int64_t k0 = std::numeric_limits<int64_t>::max(), k1 = 0;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t lo = bounds[2 * (tq0 + r)], hi = bounds[2 * (tq0 + r) + 1];
      if (hi > lo) {
        k0 = std::min(k0, lo);
        k1 = std::max(k1, hi);
      }
    }
    if (k1 <= k0) k0 = k1 = 0;
    blocks.push_back({r0, r1, k0, k1});
  }
  return blocks;
}

// The rows of a block stacked by head: row i = g * Rb + r is head h * G + g at position r0 + r.
struct Rows {
  int64_t Rb, M;
  Rows(const Block& b, int64_t G) : Rb(b.r1 - b.r0), M(G * (b.r1 - b.r0)) {}
};

// x [T, H, W] rows of the block's heads into a dense [M, W] buffer, times scale.
void gather_rows(const float* x, int64_t H, int64_t W, int64_t h0, int64_t G, int64_t t0, int64_t Rb, float scale,
                 float* out) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < Rb; ++r) {
      const float* src = x + ((t0 + r) * H + h0 + g) * W;
      float* dst = out + (g * Rb + r) * W;
      if (scale == 1.0f) std::memcpy(dst, src, W * sizeof(float));
      else for (int64_t d = 0; d < W; ++d) dst[d] = src[d] * scale;
    }
}

// The visible columns [a, b) of a chunk [c0, c1) for a row of key range [lo, hi): 0 <= a <= b <= c1 - c0.
inline void visible_cols(int64_t lo, int64_t hi, int64_t c0, int64_t c1, int64_t& a, int64_t& b) {
  const int64_t C = c1 - c0;
  a = std::min(std::max<int64_t>(lo - c0, 0), C);
  b = std::min(std::max(hi - c0, a), C);
}

// The columns of a chunk [c0, c0 + bn) that a block's products compute: its keys up to the block's last
// (C = c1 - c0 of them) rounded up to a multiple of 32, so that a causal block's last chunk skips the keys
// past its diagonal, with at most bn / 32 shapes per product.
inline int64_t product_cols(int64_t C, int64_t bn) {
  return std::min(bn, (C + 31) / 32 * 32);
}

// T: the products' operands (float, or bf16 for inputs that are bf16 values: P rounded to bf16 in P V).
template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                  const at::Tensor& cu_k, const at::Tensor& bounds_t, const at::Tensor& skip, double row_scale,
                  double score_scale, int64_t BM, int64_t max_bn, at::Tensor& o, at::Tensor& m_out,
                  at::Tensor& log_l_out) {
  const Shape S = shape_of(q, k, v, cu_q, cu_k, bounds_t, skip, {&m_out, &log_l_out});
  expect(o, "o", at::kFloat, {S.Tq, S.HQ, S.Dv});
  TORCH_CHECK(BM > 0 && max_bn > 0, "sinkattn_cpu: BM and BN must be positive");
  const int64_t *cq = cu_q.data_ptr<int64_t>(), *ck = cu_k.data_ptr<int64_t>(), *bounds = bounds_t.data_ptr<int64_t>();
  const Layout L(S.lq.data(), S.lk.data(), S.N, max_bn, std::max<int64_t>(1, BM / S.G));
  const at::Tensor kt = chunked<T>(k, ck, S.lk.data(), S.N, L, true), vc = chunked<T>(v, ck, S.lk.data(), S.N, L, false);
  const float* Q = q.data_ptr<float>();
  const T *VC = vc.data_ptr<T>(), *KT = kt.data_ptr<T>();
  float *O = o.data_ptr<float>(), *Mo = m_out.data_ptr<float>(), *Lo = log_l_out.data_ptr<float>();
  const float at_floor = exp_floor_value();
  const float post = (float)score_scale;

  struct Task { int64_t n, h; Block b; };
  std::vector<Task> tasks;
  for (int64_t n = 0; n < S.N; ++n)
    for (const Block& b : row_blocks(bounds, cq[n], S.lq[n], L.r[n]))
      for (int64_t h = 0; h < S.HKV; ++h) tasks.push_back({n, h, b});

  parallel_tasks((int64_t)tasks.size(), [&](int64_t first, int64_t end, int64_t step) {
    Aligned<> qbuf, sbuf, accbuf;
    Aligned<T> qop, sop;
    std::vector<float> mx, c, l;
    for (int64_t t = first; t < end; t += step) {
      const Task& task = tasks[t];
      const Block& b = task.b;
      const Rows rows(b, S.G);
      const int64_t tq0 = cq[task.n], M = rows.M, Mp = S.G * L.r[task.n];   // the last block's rows padded
      const int64_t BNn = L.bn[task.n], lds = L.ld[task.n];
      float* qs = qbuf.get(Mp * S.D);
      float* acc = accbuf.get(Mp * S.Dv);
      float* s = sbuf.get(Mp * lds);
      gather_rows(Q, S.HQ, S.D, task.h * S.G, S.G, tq0 + b.r0, rows.Rb, (float)row_scale, qs);
      std::fill(qs + M * S.D, qs + Mp * S.D, 0.0f);
      const T* qo = operands<T>(qs, Mp, S.D, S.D, qop, false).part[0];
      mx.assign(M, kNegInf);
      c.assign(M, 0.0f);
      l.assign(M, 0.0f);
      std::fill(acc, acc + Mp * S.Dv, 0.0f);
      const T* KTn = L.transposed(KT, task.h, task.n, S.D);    // the sequence's chunks
      const T* Vn = L.rows(VC, task.h, task.n, S.Dv);
      for (int64_t c0 = b.k0 / BNn * BNn; c0 < b.k1; c0 += BNn) {
        const int64_t c1 = std::min(b.k1, c0 + BNn), Nc = product_cols(c1 - c0, BNn);
        mm(Mp, Nc, S.D, qo, S.D, KTn + c0 / BNn * S.D * lds, lds, s, lds, false);
        for (int64_t i = 0; i < M; ++i) {
          const int64_t r = i % rows.Rb, tok = tq0 + b.r0 + r;
          int64_t a, e;
          visible_cols(bounds[2 * tok], bounds[2 * tok + 1], c0, c1, a, e);
          float* si = s + i * lds;
          if (post != 1.0f) for (int64_t j = a; j < e; ++j) si[j] *= post;
          const float m_new = std::max(mx[i], row_max(si + a, e - a));
          const float c_new = std::isfinite(m_new) ? m_new : 0.0f;
          const float alpha = mx[i] == kNegInf ? 0.0f : std::exp(c[i] - c_new);
          std::fill(si, si + a, 0.0f);
          std::fill(si + e, si + Nc, 0.0f);
          l[i] = l[i] * alpha + exp_shifted(si + a, e - a, c_new, 1.0f, at_floor);
          if (alpha != 1.0f) {
            float* ai = acc + i * S.Dv;
            for (int64_t d = 0; d < S.Dv; ++d) ai[d] *= alpha;
          }
          mx[i] = m_new;
          c[i] = c_new;
        }
        const T* p = operands<T>(s, Mp, Nc, lds, sop, false).part[0];
        mm(Mp, S.Dv, Nc, p, lds, Vn + c0 * S.Dv, S.Dv, acc, S.Dv, true);   // padded rows of s are 0
      }
      for (int64_t i = 0; i < M; ++i) {
        const int64_t g = i / rows.Rb, r = i % rows.Rb, tok = tq0 + b.r0 + r, hq = task.h * S.G + g;
        const float inv = 1.0f / std::max(l[i], 1.0f);
        float* oi = O + (tok * S.HQ + hq) * S.Dv;
        const float* ai = acc + i * S.Dv;
        for (int64_t d = 0; d < S.Dv; ++d) oi[d] = ai[d] * inv;
        Mo[hq * S.Tq + tok] = c[i];
        Lo[hq * S.Tq + tok] = std::log(l[i]);
      }
    }
    at::native::cpublas::brgemm_release(false);
  });
}

struct Optional {
  const float* p;
  Optional(const at::Tensor& t) : p(t.numel() ? t.data_ptr<float>() : nullptr) {}
};

// What one pass over a row block computes (backward_impl): everything (Fused); dQ, Delta and each row's
// dominant-key correction (DQ); or dK and dV of one chunk of keys from the Delta and corrections that the
// DQ pass left (DKV). The split passes add every product and correction in the fused pass's order, so
// their results are its bits; they give a sequence's key-value head more than one thread.
enum class Pass { Fused, DQ, DKV };

// One thread's buffers for its row blocks
template <typename T>
struct Scratch {
  Aligned<> qbuf, dobuf, pbuf, dpbuf, dqbuf;
  Aligned<T> qop, doop, qtbuf, dotbuf, pop, dsop;
  std::vector<float> mrow, ilrow, drow, sums, best, fix;
  std::vector<double> ds_sum;
  std::vector<int64_t> best_key;
};

// The backward's inputs and outputs as the row blocks read and write them.
template <typename T>
struct Backward {
  Shape S;
  const Layout& L;
  const int64_t *cq, *ck, *bounds;
  const float *Q, *DO, *Mst, *LL, *DL, *SM;   // DL (dlse), SM (sink mass): null for none
  const T *KC, *KT, *VT;                      // keys as rows, keys and values transposed, by chunk (Layout)
  float *DELTA, *DQ;
  float* FIX;          // [HQ, Tq]: a row's dominant-key correction of dS (DQ pass), 0 for none
  int64_t* BEST;       // [HQ, Tq]: its key (-1: none)
  float at_floor, post, row_scale, softmax_scale;
  bool exact;
  int64_t kept_elements;

  // Row block b of sequence n, KV head h, in pass `pass`. dKT / dVT: dK^T / dV^T by chunk ([chunks, D, ld]
  // for the fused pass; for DKV, [D, ld] / [Dv, ld] of the chunk at key c, the only one it computes).
  void block(Scratch<T>& w, Pass pass, int64_t n, int64_t h, const Block& b, int64_t c, float* dKT,
             float* dVT) const {
    const int64_t tq0 = cq[n], BN = L.bn[n], ldc = L.ld[n], Mp = S.G * L.r[n];   // the sequence's tiles
    const T* Kh = L.rows(KC, h, n, S.D);    // the sequence's keys as rows, key j at j * D
    const T* KTn = L.transposed(KT, h, n, S.D);
    const T* VTn = L.transposed(VT, h, n, S.Dv);
    const int64_t ldk = S.D;
    const Rows rows(b, S.G);
    const int64_t M = rows.M, c00 = b.k0 / BN * BN;               // the block's first chunk starts at c00
    const int64_t tiles = b.k1 > b.k0 ? (b.k1 - c00 + BN - 1) / BN : 0;
    const bool kept = exact && Mp * tiles * BN <= kept_elements;   // P, dP of every chunk kept: [tiles, Mp, ldc]
    const bool keep = kept && pass != Pass::DKV;                   // (DKV has one chunk)
    const bool dq_pass = pass != Pass::DKV, dkv_pass = pass != Pass::DQ;
    float* qs = w.qbuf.get(Mp * S.D);
    float* dos = w.dobuf.get(Mp * S.Dv);
    float* dqs = w.dqbuf.get(Mp * S.D);
    float* pb = w.pbuf.get((keep ? tiles : 1) * Mp * ldc);
    float* dpb = w.dpbuf.get((keep ? tiles : 1) * Mp * ldc);
    auto tile = [&](float* buf, int64_t c0) { return keep ? buf + (c0 - c00) / BN * Mp * ldc : buf; };
    auto cols = [&](int64_t c0) { return product_cols(std::min(b.k1, c0 + BN) - c0, BN); };   // computed
    auto dk_chunk = [&](int64_t c0) { return pass == Pass::DKV ? dKT : dKT + c0 / BN * S.D * ldc; };
    auto dv_chunk = [&](int64_t c0) { return pass == Pass::DKV ? dVT : dVT + c0 / BN * S.Dv * ldc; };
    auto at = [&](int64_t i) { return (h * S.G + i / rows.Rb) * S.Tq + tq0 + b.r0 + i % rows.Rb; };
    gather_rows(Q, S.HQ, S.D, h * S.G, S.G, tq0 + b.r0, rows.Rb, row_scale, qs);
    gather_rows(DO, S.HQ, S.Dv, h * S.G, S.G, tq0 + b.r0, rows.Rb, 1.0f, dos);
    std::fill(qs + M * S.D, qs + Mp * S.D, 0.0f);
    std::fill(dos + M * S.Dv, dos + Mp * S.Dv, 0.0f);
    const T* qo = operands<T>(qs, Mp, S.D, S.D, w.qop, false).part[0];
    const T* doo = operands<T>(dos, Mp, S.Dv, S.Dv, w.doop, false).part[0];
    T* qsT = dkv_pass ? w.qtbuf.get(Mp * S.D) : nullptr;      // Qs^T, dO^T: the dK / dV products only
    T* dosT = dkv_pass ? w.dotbuf.get(Mp * S.Dv) : nullptr;
    if (dkv_pass)
      for (int64_t i = 0; i < Mp; ++i) {
        for (int64_t d = 0; d < S.D; ++d) qsT[d * Mp + i] = qo[i * S.D + d];
        for (int64_t d = 0; d < S.Dv; ++d) dosT[d * Mp + i] = doo[i * S.Dv + d];
      }
    std::fill(dqs, dqs + Mp * S.D, 0.0f);
    std::vector<float>&mrow = w.mrow, &ilrow = w.ilrow, &drow = w.drow, &best = w.best, &fix = w.fix;
    std::vector<int64_t>& best_key = w.best_key;
    std::vector<double>& ds_sum = w.ds_sum;
    mrow.resize(M);
    ilrow.resize(M);
    drow.resize(M);
    bool dominant_possible = false;
    for (int64_t i = 0; i < M; ++i) {
      mrow[i] = Mst[at(i)];
      ilrow[i] = LL[at(i)] == kNegInf ? 0.0f : std::exp(-LL[at(i)]);   // 1 / l; no key and no sink: P = 0
      drow[i] = DELTA[at(i)];
      dominant_possible = dominant_possible || ilrow[i] >= kDominantFrom;
    }
    const bool dominant = exact && dominant_possible;
    // P = e^(S - m) / l and dP = dO V^T of the chunk at c0 (keys [c0, c1) of the block) into p / dp
    auto probabilities = [&](int64_t c0, int64_t c1, float* p, float* dp) {
      const int64_t Nc = cols(c0);
      mm(Mp, Nc, S.D, qo, S.D, KTn + c0 / BN * S.D * ldc, ldc, p, ldc, false);
      mm(Mp, Nc, S.Dv, doo, S.Dv, VTn + c0 / BN * S.Dv * ldc, ldc, dp, ldc, false);
      for (int64_t i = 0; i < M; ++i) {
        const int64_t tok = tq0 + b.r0 + i % rows.Rb;
        int64_t a, e;
        visible_cols(bounds[2 * tok], bounds[2 * tok + 1], c0, c1, a, e);
        float* pi = p + i * ldc;
        if (post != 1.0f) for (int64_t j = a; j < e; ++j) pi[j] *= post;
        std::fill(pi, pi + a, 0.0f);
        std::fill(pi + e, pi + Nc, 0.0f);
        exp_shifted(pi + a, e - a, mrow[i], ilrow[i], at_floor);
      }
    };
    const bool search = dominant && dq_pass;   // the DKV pass reads the corrections instead
    if (search) {
      ds_sum.assign(M, 0.0);
      best.assign(M, -1.0f);
      best_key.assign(M, 0);
    }
    auto see = [&](const float* p, int64_t ld, int64_t c0, int64_t C) {
      for (int64_t i = 0; i < M; ++i) {
        if (!(ilrow[i] >= kDominantFrom)) continue;     // P <= 1/l: no key of this row can dominate
        const float* pi = p + i * ld;
        for (int64_t j = 0; j < C; ++j)
          if (pi[j] > best[i]) { best[i] = pi[j]; best_key[i] = c0 + j; }
      }
    };
    if (exact && dq_pass) {   // Delta from the products themselves: sum_j P dP - dlse
      std::vector<float>& sums = w.sums;
      sums.assign(M, 0.0f);
      for (int64_t c0 = c00; c0 < b.k1; c0 += BN) {
        const int64_t c1 = std::min(b.k1, c0 + BN), C = c1 - c0;
        float *p = tile(pb, c0), *dp = tile(dpb, c0);
        probabilities(c0, c1, p, dp);
        for (int64_t i = 0; i < M; ++i) sums[i] += dot(p + i * ldc, dp + i * ldc, C);
        if (search) see(p, ldc, c0, C);
      }
      for (int64_t i = 0; i < M; ++i) {
        drow[i] = DL ? sums[i] - DL[at(i)] : sums[i];
        DELTA[at(i)] = drow[i];
      }
    }
    auto make_ds = [&](const float* p, float* dp, int64_t ld, int64_t C) {   // dS = P (dP - Delta) over dp
      for (int64_t i = 0; i < M; ++i) {
        const float* pi = p + i * ld;
        float* di = dp + i * ld;
        const Vec vd(drow[i]);
        int64_t j = 0;
        for (; j + Vec::size() <= C; j += Vec::size())
          ((Vec::loadu(di + j) - vd) * Vec::loadu(pi + j)).store(di + j);
        if (j < C) ((Vec::loadu(di + j, C - j) - vd) * Vec::loadu(pi + j, C - j)).store(di + j, C - j);
        if (search && ilrow[i] >= kDominantFrom) {
          double acc = 0.0;
          for (int64_t jj = 0; jj < C; ++jj) acc += (double)di[jj];
          ds_sum[i] += acc;
        }
      }
    };
    auto correction = [&]() {   // fix[i]: what the row's dominant key adds to its dS
      fix.assign(M, 0.0f);
      for (int64_t i = 0; i < M; ++i) {
        if (!(best[i] >= kDominantFrom)) continue;
        double target = SM ? (double)SM[at(i)] * (double)drow[i] : 0.0;
        if (DL) target += (double)DL[at(i)];
        fix[i] = (float)(target - ds_sum[i]);
      }
    };
    // whole chunks: dS is 0 outside the visible keys (P is), padded rows of Q, dO, P and dS are 0
    auto products = [&](const float* p, const float* ds, int64_t c0) {
      const int64_t Nc = cols(c0);
      const Operands<T> dso = operands<T>(ds, Mp, Nc, ldc, w.dsop, true);
      for (int part = 0; part < dso.count; ++part) {
        if (dq_pass) mm(Mp, S.D, Nc, dso.part[part], ldc, Kh + c0 * ldk, ldk, dqs, S.D, true);
        if (dkv_pass) mm(S.D, Nc, Mp, qsT, Mp, dso.part[part], ldc, dk_chunk(c0), ldc, true);   // dK^T += Qs^T dS
      }
      if (!dkv_pass) return;
      const Operands<T> po = operands<T>(p, Mp, Nc, ldc, w.pop, true);
      for (int part = 0; part < po.count; ++part)
        mm(S.Dv, Nc, Mp, dosT, Mp, po.part[part], ldc, dv_chunk(c0), ldc, true);   // dV^T += dO^T P
    };
    // the correction of row i at key `key` added after the products: to dQ (dq_pass) and to dK (dkv_pass)
    auto add_after = [&](int64_t i, int64_t key, float f) {
      if (dq_pass) {
        const T* k_row = Kh + key * ldk;
        float* dqi = dqs + i * S.D;
        for (int64_t d = 0; d < S.D; ++d) dqi[d] += f * (float)k_row[d];
      }
      if (dkv_pass) {
        const float* qi = qs + i * S.D;
        float* col = dk_chunk(key / BN * BN) + key % BN;
        for (int64_t d = 0; d < S.D; ++d) col[d * ldc] += f * qi[d];
      }
    };
    if (pass == Pass::DKV) {   // one chunk, the corrections from the DQ pass
      const int64_t c1 = std::min(b.k1, c + BN);
      auto mine = [&](int64_t i) { return dominant && BEST[at(i)] >= c && BEST[at(i)] < c1; };
      probabilities(c, c1, pb, dpb);
      make_ds(pb, dpb, ldc, cols(c));
      if (kept)
        for (int64_t i = 0; i < M; ++i)
          if (mine(i)) dpb[i * ldc + BEST[at(i)] - c] += FIX[at(i)];
      products(pb, dpb, c);
      if (!kept)
        for (int64_t i = 0; i < M; ++i)
          if (mine(i) && FIX[at(i)] != 0.0f) add_after(i, BEST[at(i)], FIX[at(i)]);
      return;
    }
    if (kept) {
      for (int64_t c0 = c00; c0 < b.k1; c0 += BN) make_ds(tile(pb, c0), tile(dpb, c0), ldc, cols(c0));
      if (dominant) {
        correction();
        for (int64_t i = 0; i < M; ++i)
          if (best[i] >= kDominantFrom) tile(dpb, best_key[i] / BN * BN)[i * ldc + best_key[i] % BN] += fix[i];
      }
      for (int64_t c0 = c00; c0 < b.k1; c0 += BN) products(tile(pb, c0), tile(dpb, c0), c0);
    } else {
      for (int64_t c0 = c00; c0 < b.k1; c0 += BN) {
        probabilities(c0, std::min(b.k1, c0 + BN), pb, dpb);
        make_ds(pb, dpb, ldc, cols(c0));
        products(pb, dpb, c0);
      }
      if (dominant) {
        correction();
        for (int64_t i = 0; i < M; ++i)
          if (fix[i] != 0.0f) add_after(i, best_key[i], fix[i]);
      }
    }
    if (pass == Pass::DQ && dominant)
      for (int64_t i = 0; i < M; ++i) {
        FIX[at(i)] = fix[i];
        BEST[at(i)] = best[i] >= kDominantFrom ? best_key[i] : -1;
      }
    for (int64_t i = 0; i < M; ++i) {
      const int64_t g = i / rows.Rb, r = i % rows.Rb, tok = tq0 + b.r0 + r;
      float* out = DQ + (tok * S.HQ + h * S.G + g) * S.D;
      const float* src = dqs + i * S.D;
      for (int64_t d = 0; d < S.D; ++d) out[d] = src[d] * softmax_scale;
    }
  }
};

// T as in forward_impl; with bf16 operands, P and dS enter dQ, dK and dV compensated (hi + lo).
// split: 1 one fused pass per (sequence, KV head) task; 2 a dQ pass over row blocks, then a dK/dV pass over
// chunks of keys (the same bits, more tasks, seven products per tile where the fused pass has five); 0 the
// split passes where the fused tasks would keep at most half of the threads busy and the dK/dV pass has
// at least twice their number (a sequence of one chunk of keys gains nothing from it).
template <typename T>
void backward_impl(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& m_t, const at::Tensor& log_l_t, at::Tensor& delta_t, const at::Tensor& dlse_t,
                   const at::Tensor& sink_t, const at::Tensor& cu_q, const at::Tensor& cu_k,
                   const at::Tensor& bounds_t, const at::Tensor& skip, double row_scale, double score_scale,
                   double softmax_scale, bool exact, int64_t BM, int64_t max_bn, int64_t kept_elements, int64_t split,
                   at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const Shape S = shape_of(q, k, v, cu_q, cu_k, bounds_t, skip, {&m_t, &log_l_t, &delta_t});
  expect(dout, "dout", at::kFloat, {S.Tq, S.HQ, S.Dv});
  expect(dq, "dq", at::kFloat, q.sizes());
  expect(dk, "dk", at::kFloat, k.sizes());
  expect(dv, "dv", at::kFloat, v.sizes());
  TORCH_CHECK(BM > 0 && max_bn > 0, "sinkattn_cpu: BM and BN must be positive");
  TORCH_CHECK(split >= 0 && split <= 2, "sinkattn_cpu: split must be 0, 1 or 2");
  if (dlse_t.numel()) expect(dlse_t, "dlse", at::kFloat, {S.HQ, S.Tq});
  if (sink_t.numel()) expect(sink_t, "sink_mass", at::kFloat, {S.HQ, S.Tq});
  const int64_t *cq = cu_q.data_ptr<int64_t>(), *ck = cu_k.data_ptr<int64_t>(), *bounds = bounds_t.data_ptr<int64_t>();
  const Layout L(S.lq.data(), S.lk.data(), S.N, max_bn, std::max<int64_t>(1, BM / S.G));
  const int64_t* lk = S.lk.data();
  const at::Tensor kt = chunked<T>(k, ck, lk, S.N, L, true), vt = chunked<T>(v, ck, lk, S.N, L, true),
                   kc = chunked<T>(k, ck, lk, S.N, L, false);
  float *DK = dk.data_ptr<float>(), *DV = dv.data_ptr<float>();
  const float post = (float)score_scale;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  int64_t chunks = 0;
  for (int64_t n = 0; n < S.N; ++n) chunks += L.chunks[n];
  const int64_t fused_tasks = S.N * S.HKV;
  const bool two_passes = split == 2 || (split == 0 && 2 * fused_tasks <= threads && chunks >= 2 * S.N);
  std::vector<float> fix(two_passes ? S.HQ * S.Tq : 0, 0.0f);
  std::vector<int64_t> best(two_passes ? S.HQ * S.Tq : 0, -1);
  const Backward<T> B{S, L, cq, ck, bounds, q.data_ptr<float>(), dout.data_ptr<float>(), m_t.data_ptr<float>(),
                      log_l_t.data_ptr<float>(), Optional(dlse_t).p, Optional(sink_t).p, kc.data_ptr<T>(),
                      kt.data_ptr<T>(), vt.data_ptr<T>(), delta_t.data_ptr<float>(), dq.data_ptr<float>(),
                      fix.data(), best.data(), exp_floor_value(), post, (float)row_scale, (float)softmax_scale,
                      exact, kept_elements};
  std::vector<std::vector<Block>> blocks(S.N);
  for (int64_t n = 0; n < S.N; ++n) blocks[n] = row_blocks(bounds, cq[n], S.lq[n], L.r[n]);
  // dK, dV of keys [j0, j1) of sequence n, head h, from dK^T / dV^T chunks that start at key j0 / BN * BN
  auto store = [&](int64_t n, int64_t h, int64_t j0, int64_t j1, const float* dKT, const float* dVT) {
    const int64_t BN = L.bn[n], ldc = L.ld[n], first = j0 / BN * BN;
    for (int64_t j = j0; j < j1; ++j) {
      float* dkj = DK + ((ck[n] + j) * S.HKV + h) * S.D;
      float* dvj = DV + ((ck[n] + j) * S.HKV + h) * S.Dv;
      const int64_t chunk = (j - first) / BN, col = (j - first) % BN;
      const float *kcol = dKT + chunk * S.D * ldc + col, *vcol = dVT + chunk * S.Dv * ldc + col;
      for (int64_t d = 0; d < S.D; ++d) dkj[d] = kcol[d * ldc] * post;
      for (int64_t d = 0; d < S.Dv; ++d) dvj[d] = vcol[d * ldc];
    }
  };
  if (!two_passes) {
    parallel_tasks(fused_tasks, [&](int64_t first, int64_t end, int64_t step) {
      Scratch<T> w;
      Aligned<> dkbuf, dvbuf;
      for (int64_t task = first; task < end; task += step) {
        const int64_t n = task / S.HKV, h = task % S.HKV, chunks = L.chunks[n], ldc = L.ld[n];
        float* dKT = dkbuf.get(chunks * S.D * ldc);      // dK^T by chunk [chunks, D, ldc]
        float* dVT = dvbuf.get(chunks * S.Dv * ldc);     // dV^T by chunk [chunks, Dv, ldc]
        std::fill(dKT, dKT + chunks * S.D * ldc, 0.0f);
        std::fill(dVT, dVT + chunks * S.Dv * ldc, 0.0f);
        for (const Block& b : blocks[n]) B.block(w, Pass::Fused, n, h, b, 0, dKT, dVT);
        store(n, h, 0, S.lk[n], dKT, dVT);
      }
      at::native::cpublas::brgemm_release(false);
    });
    return;
  }
  struct Task { int64_t n, h, i; };   // i: a row block (DQ) or a chunk (DKV) of sequence n
  std::vector<Task> dq_tasks, dkv_tasks;
  for (int64_t n = 0; n < S.N; ++n)
    for (int64_t h = 0; h < S.HKV; ++h) {
      for (int64_t i = 0; i < (int64_t)blocks[n].size(); ++i) dq_tasks.push_back({n, h, i});
      for (int64_t i = 0; i < L.chunks[n]; ++i) dkv_tasks.push_back({n, h, i});
    }
  parallel_tasks((int64_t)dq_tasks.size(), [&](int64_t first, int64_t end, int64_t step) {
    Scratch<T> w;
    for (int64_t t = first; t < end; t += step) {
      const Task& task = dq_tasks[t];
      B.block(w, Pass::DQ, task.n, task.h, blocks[task.n][task.i], 0, nullptr, nullptr);
    }
    at::native::cpublas::brgemm_release(false);
  });
  parallel_tasks((int64_t)dkv_tasks.size(), [&](int64_t first, int64_t end, int64_t step) {
    Scratch<T> w;
    Aligned<> dkbuf, dvbuf;
    for (int64_t t = first; t < end; t += step) {
      const Task& task = dkv_tasks[t];
      const int64_t n = task.n, BN = L.bn[n], ldc = L.ld[n], c = task.i * BN;
      float* dKT = dkbuf.get(S.D * ldc);
      float* dVT = dvbuf.get(S.Dv * ldc);
      std::fill(dKT, dKT + S.D * ldc, 0.0f);
      std::fill(dVT, dVT + S.Dv * ldc, 0.0f);
      for (const Block& b : blocks[n])      // the blocks that see a key of the chunk, in order
        if (b.k1 > b.k0 && b.k0 / BN * BN <= c && c < b.k1) B.block(w, Pass::DKV, n, task.h, b, c, dKT, dVT);
      store(n, task.h, c, std::min(c + BN, S.lk[n]), dKT, dVT);
    }
    at::native::cpublas::brgemm_release(false);
  });
}

// The sink's rule (sinkattn/sink.py's with_sink and lse_of, natural units; tests/test_sink.py holds the two
// together): one row's softmax over keys, (m, log_l) with log_l = -inf for a row that sees no key (its m then
// takes no part), joined by the sink as one more key of logit `sink` -> the weight of the row's o and the final
// statistics (c, log z), lse = c + log z.
struct Joined {
  float w, c, log_z;
};

inline float finite_or_floor(float x) { return std::isfinite(x) ? x : kNegInf; }

inline Joined join_row(float m, float log_l, float sink) {
  const float top = log_l == kNegInf ? kNegInf : finite_or_floor(m);
  float c = std::max(top, finite_or_floor(sink));
  if (c == kNegInf) c = 0.0f;
  const float mass_keys = std::exp((m - c) + log_l);
  const float z = mass_keys + std::exp(sink - c);
  const float w = log_l == kNegInf ? 0.0f : mass_keys / (z == 0.0f ? 1.0f : z);   // a row without keys adds nothing
  return {w, c, std::log(z)};
}

// The join over a packed call's rows: o [T, HQ, Dv] scaled in place, m / log_l [HQ, T] replaced by the final
// statistics, lse [HQ, T] written.
void join_sink_op(at::Tensor o, at::Tensor m, at::Tensor log_l, const at::Tensor& sinks, at::Tensor lse) {
  TORCH_CHECK(o.dim() == 3, "sinkattn_cpu: o must be [T, HQ, Dv]");
  const int64_t T = o.size(0), HQ = o.size(1), Dv = o.size(2);
  expect(o, "o", at::kFloat, {T, HQ, Dv});
  expect(sinks, "sinks", at::kFloat, {HQ});
  for (const at::Tensor* t : {&m, &log_l, &lse}) expect(*t, "a per-row tensor", at::kFloat, {HQ, T});
  float *O = o.data_ptr<float>(), *M = m.data_ptr<float>(), *LL = log_l.data_ptr<float>(), *LSE = lse.data_ptr<float>();
  const float* SK = sinks.data_ptr<float>();
  parallel_tasks(HQ, [&](int64_t first, int64_t end, int64_t step) {
    for (int64_t h = first; h < end; h += step) {
      for (int64_t t = 0; t < T; ++t) {
        const int64_t at = h * T + t;
        const Joined j = join_row(M[at], LL[at], SK[h]);
        float* row = O + (t * HQ + h) * Dv;
        for (int64_t d = 0; d < Dv; ++d) row[d] *= j.w;
        M[at] = j.c;
        LL[at] = j.log_z;
        LSE[at] = j.c + j.log_z;
      }
    }
  });
}

// The largest Euclidean norm of the rows x[b, s, h, :] of a [B, S, H, D] tensor of any strides whose rows are
// contiguous (0 for none; NaN or inf where a row holds one, or its squares overflow).
float max_row_norm(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 4 && (x.size(3) <= 1 || x.stride(3) == 1), "sinkattn_cpu: x must be [B, S, H, D], rows contiguous");
  const int64_t D = x.size(3);
  const float* X = x.data_ptr<float>();
  float best = 0.0f;
  for (int64_t b = 0; b < x.size(0); ++b)
    for (int64_t s = 0; s < x.size(1); ++s)
      for (int64_t h = 0; h < x.size(2); ++h) {
        const float* row = X + b * x.stride(0) + s * x.stride(1) + h * x.stride(2);
        const float norm = std::sqrt(dot(row, row, D));
        if (!(norm <= best)) best = norm;        // NaN is kept
        if (std::isnan(best)) return best;
      }
  return best;
}

// A dense inference call's results from one unmasked fused-attention call over keys (o, lse_keys), taken when
// they are the formula's: every score bound |scale| max|q_i| max|k_j| <= max_bound (cpu backend: scores stay
// well inside fp32), every row's lse over keys finite (every row of such a call sees a key) and o finite
// (a NaN or inf input reaches one of them). Then the sink joins, o [B, Sq, HQ, Dv] (any strides, rows
// contiguous) is scaled in place, and [m, log_l, lse] ([HQ, B * Sq] each, NaN-filled first when `poison`) are
// returned. Otherwise nothing is written and nothing returned: the caller takes its exact path.
// lse_keys [B, HQ, Sq], any strides; sinks [HQ] or none.
std::vector<at::Tensor> join_dense_op(at::Tensor o, const at::Tensor& lse_keys, const at::Tensor& q,
                                      const at::Tensor& k, const c10::optional<at::Tensor>& sinks_opt,
                                      double softmax_scale, double max_bound, bool poison) {
  TORCH_CHECK(o.dim() == 4 && lse_keys.dim() == 3 && o.scalar_type() == at::kFloat &&
              lse_keys.scalar_type() == at::kFloat && q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat,
              "sinkattn_cpu: join_dense takes fp32 o [B, Sq, HQ, Dv] and lse_keys [B, HQ, Sq]");
  const int64_t B = o.size(0), Sq = o.size(1), HQ = o.size(2), Dv = o.size(3), T = B * Sq;
  TORCH_CHECK(lse_keys.size(0) == B && lse_keys.size(1) == HQ && lse_keys.size(2) == Sq && (Dv <= 1 || o.stride(3) == 1),
              "sinkattn_cpu: join_dense's o and lse_keys disagree, or o's rows are not contiguous");
  const bool has_sinks = sinks_opt.has_value();
  at::Tensor sinks;
  if (has_sinks) {
    sinks = sinks_opt->to(at::kFloat).contiguous();
    expect(sinks, "sinks", at::kFloat, {HQ});
  }
  const double bound = std::abs(softmax_scale) * (double)max_row_norm(q) * (double)max_row_norm(k);
  if (!(bound <= max_bound)) return {};
  float* O = o.data_ptr<float>();
  const float* LK = lse_keys.data_ptr<float>();
  const int64_t ob = o.stride(0), os = o.stride(1), oh = o.stride(2);
  const int64_t lb = lse_keys.stride(0), lh = lse_keys.stride(1), ls = lse_keys.stride(2);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < Sq; ++s)
      for (int64_t h = 0; h < HQ; ++h) {
        const float* row = O + b * ob + s * os + h * oh;
        if (!std::isfinite(LK[b * lb + h * lh + s * ls]) || !all_finite(row, Dv)) return {};
      }
  const auto options = o.options().dtype(at::kFloat);
  std::vector<at::Tensor> out;
  for (int i = 0; i < 3; ++i)
    out.push_back(poison ? at::full({HQ, T}, std::numeric_limits<float>::quiet_NaN(), options)
                         : at::empty({HQ, T}, options));
  float *M = out[0].data_ptr<float>(), *LL = out[1].data_ptr<float>(), *LSE = out[2].data_ptr<float>();
  const float* SK = has_sinks ? sinks.data_ptr<float>() : nullptr;
  for (int64_t h = 0; h < HQ; ++h)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < Sq; ++s) {
        const int64_t at = h * T + b * Sq + s;
        const float keys = LK[b * lb + h * lh + s * ls];
        if (!has_sinks) {
          M[at] = LSE[at] = keys;
          LL[at] = 0.0f;
          continue;
        }
        const Joined j = join_row(keys, 0.0f, SK[h]);
        float* row = O + b * ob + s * os + h * oh;
        for (int64_t d = 0; d < Dv; ++d) row[d] *= j.w;
        M[at] = j.c;
        LL[at] = j.log_z;
        LSE[at] = j.c + j.log_z;
      }
  return out;
}

// A dense call without gradients computed whole, for calls whose few query rows make a fused-attention library
// call cost more than its arithmetic (decoding): q [B, Sq, HQ, D], k [B, Sk, HKV, D], v [B, Sk, HKV, Dv], fp32,
// rows contiguous, any other strides; bounds [Sq, 2] int64, the keys [lo, hi) row i sees (sinkattn.masks, the
// same for every batch item); sinks [HQ] or none. Per batch item and KV head, each of its G query heads' rows:
// scores s_j = <q, k_j> scale (products, then the scale, as eager attention rounds them) over its visible keys,
// the softmax over keys as the tiles compute it (exp_shifted), o = sum_j p_j v_j / l, and the sink's rule
// (join_row). Returns [o [B, Sq, HQ, Dv], m, log_l, lse [HQ, B * Sq]] (NaN-filled first when `poison`), or
// nothing when the results would not be the formula's as computed here: a score bound |scale| max|q_i|
// max|k_j| above max_bound (a NaN or inf in q or k included), or a NaN or inf in v; the caller then takes
// its exact path.
std::vector<at::Tensor> forward_small_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& bounds_t, const c10::optional<at::Tensor>& sinks_opt,
                                         double softmax_scale, double max_bound, bool poison) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == at::kFloat &&
              k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "sinkattn_cpu: forward_small takes fp32 q [B, Sq, HQ, D], k [B, Sk, HKV, D], v [B, Sk, HKV, Dv]");
  const int64_t B = q.size(0), Sq = q.size(1), HQ = q.size(2), D = q.size(3), Sk = k.size(1), HKV = k.size(2),
                Dv = v.size(3), T = B * Sq;
  TORCH_CHECK(HKV > 0 && HQ % HKV == 0 && k.size(0) == B && v.size(0) == B && v.size(1) == Sk &&
              v.size(2) == HKV && k.size(3) == D && (D <= 1 || (q.stride(3) == 1 && k.stride(3) == 1)) &&
              (Dv <= 1 || v.stride(3) == 1), "sinkattn_cpu: forward_small's q, k, v disagree, or rows not contiguous");
  expect(bounds_t, "bounds", at::kLong, {Sq, 2});
  const int64_t G = HQ / HKV;
  at::Tensor sinks;
  if (sinks_opt.has_value()) {
    sinks = sinks_opt->to(at::kFloat).contiguous();
    expect(sinks, "sinks", at::kFloat, {HQ});
  }
  const double bound = std::abs(softmax_scale) * (double)max_row_norm(q) * (double)max_row_norm(k);
  if (!(bound <= max_bound)) return {};
  const float* V = v.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < Sk; ++j)
      for (int64_t h = 0; h < HKV; ++h)
        if (!all_finite(V + b * v.stride(0) + j * v.stride(1) + h * v.stride(2), Dv)) return {};

  const auto options = q.options();
  auto make = [&](at::IntArrayRef sizes) {
    return poison ? at::full(sizes, std::numeric_limits<float>::quiet_NaN(), options) : at::empty(sizes, options);
  };
  std::vector<at::Tensor> out{make({B, Sq, HQ, Dv}), make({HQ, T}), make({HQ, T}), make({HQ, T})};
  float *O = out[0].data_ptr<float>(), *M = out[1].data_ptr<float>(), *LL = out[2].data_ptr<float>(),
        *LSE = out[3].data_ptr<float>();
  const float *Q = q.data_ptr<float>(), *K = k.data_ptr<float>();
  const float* SK = sinks.defined() ? sinks.data_ptr<float>() : nullptr;
  const int64_t* bounds = bounds_t.data_ptr<int64_t>();
  const float at_floor = exp_floor_value(), scale = (float)softmax_scale;
  const int64_t qb = q.stride(0), qs = q.stride(1), qh = q.stride(2), kb = k.stride(0), ks = k.stride(1),
                kh = k.stride(2), vb = v.stride(0), vs = v.stride(1), vh = v.stride(2);
  auto task = [&](int64_t first, int64_t end, int64_t step) {
    std::vector<float> qt(G * D), st(std::max<int64_t>(G * Sk, 1)), scores(std::max<int64_t>(G * Sk, 1));
    for (int64_t t = first; t < end; t += step) {
      const int64_t b = t / HKV, h = t % HKV;
      for (int64_t i = 0; i < Sq; ++i) {       // the G rows of position i share its keys [lo, hi)
        const int64_t lo = bounds[2 * i], n = std::max<int64_t>(bounds[2 * i + 1] - lo, 0);
        const float* Qi = Q + b * qb + i * qs + h * G * qh;                      // [G, D], rows qh apart
        float* Oi = O + ((b * Sq + i) * HQ + h * G) * Dv;                        // [G, Dv]
        float* S = scores.data();                                                // [G, n]
        if (n > 0) {   // S^T = K Q^T (row-major products: K's rows are the operand at hand), S = S^T^T scale
          for (int64_t g = 0; g < G; ++g)
            for (int64_t d = 0; d < D; ++d) qt[d * G + g] = Qi[g * qh + d];
          mm<float>(n, G, D, K + b * kb + lo * ks + h * kh, ks, qt.data(), G, st.data(), G, false);
          for (int64_t j = 0; j < n; ++j)
            for (int64_t g = 0; g < G; ++g) S[g * n + j] = st[j * G + g] * scale;
        }
        for (int64_t g = 0; g < G; ++g) {
          float* sg = S + g * n;
          const float c = n > 0 ? row_max(sg, n) : 0.0f;
          const float l = n > 0 ? exp_shifted(sg, n, c, 1.0f, at_floor) : 0.0f;
          const int64_t hq = h * G + g, at = hq * T + b * Sq + i;
          const Joined joined = SK ? join_row(c, std::log(l), SK[hq]) : Joined{1.0f, c, std::log(l)};
          M[at] = joined.c;
          LL[at] = joined.log_z;
          LSE[at] = joined.c + joined.log_z;
          // o = P V / l, then the sink's weight: P scaled first, so that one product gives the result
          const float w = n > 0 ? joined.w / std::max(l, 1.0f) : 0.0f;
          for (int64_t j = 0; j < n; ++j) sg[j] *= w;
        }
        if (n > 0)
          mm<float>(G, Dv, n, S, n, V + b * vb + lo * vs + h * vh, vs, Oi, Dv, false);
        else
          std::fill(Oi, Oi + G * Dv, 0.0f);
      }
    }
    at::native::cpublas::brgemm_release(false);
  };
  if (B * HQ * Sq * Sk * (D + Dv) >= (int64_t)1 << 20) {     // worth more threads than one
    parallel_tasks(B * HKV, task);
  } else {
    OneThreadProducts one;
    task(0, B * HKV, 1);
  }
  return out;
}

void forward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                const at::Tensor& cu_k, const at::Tensor& bounds, const at::Tensor& skip, double row_scale,
                double score_scale, int64_t BM, int64_t BN, bool bf16_products, at::Tensor o, at::Tensor m,
                at::Tensor log_l) {
  (bf16_products ? forward_impl<bf16> : forward_impl<float>)(q, k, v, cu_q, cu_k, bounds, skip, row_scale,
                                                             score_scale, BM, BN, o, m, log_l);
}

void backward_op(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& m, const at::Tensor& log_l, at::Tensor delta, const at::Tensor& dlse,
                 const at::Tensor& sink_mass, const at::Tensor& cu_q, const at::Tensor& cu_k,
                 const at::Tensor& bounds, const at::Tensor& skip, double row_scale, double score_scale,
                 double softmax_scale, bool exact, int64_t BM, int64_t BN, int64_t kept_elements, bool bf16_products,
                 int64_t split, at::Tensor dq, at::Tensor dk, at::Tensor dv) {
  (bf16_products ? backward_impl<bf16> : backward_impl<float>)(dout, q, k, v, m, log_l, delta, dlse, sink_mass, cu_q,
                                                               cu_k, bounds, skip, row_scale, score_scale,
                                                               softmax_scale, exact, BM, BN, kept_elements, split, dq,
                                                               dk, dv);
}

}  // namespace

TORCH_LIBRARY(sinkattn_cpu, lib) {
  lib.def("forward(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, Tensor bounds, Tensor skip, "
          "float row_scale, float score_scale, int BM, int BN, bool bf16_products, Tensor(a!) o, Tensor(b!) m, "
          "Tensor(c!) log_l) -> ()");
  lib.def("join_sink(Tensor(a!) o, Tensor(b!) m, Tensor(c!) log_l, Tensor sinks, Tensor(d!) lse) -> ()");
  lib.def("join_dense(Tensor(a!) o, Tensor lse_keys, Tensor q, Tensor k, Tensor? sinks, float softmax_scale, "
          "float max_bound, bool poison) -> Tensor[]");
  lib.def("forward_small(Tensor q, Tensor k, Tensor v, Tensor bounds, Tensor? sinks, float softmax_scale, "
          "float max_bound, bool poison) -> Tensor[]");
  lib.def("backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor m, Tensor log_l, Tensor(a!) delta, "
          "Tensor dlse, Tensor sink_mass, Tensor cu_q, Tensor cu_k, Tensor bounds, Tensor skip, float row_scale, "
          "float score_scale, float softmax_scale, bool exact, int BM, int BN, int kept_elements, "
          "bool bf16_products, int split, Tensor(b!) dq, Tensor(c!) dk, Tensor(d!) dv) -> ()");
}

TORCH_LIBRARY_IMPL(sinkattn_cpu, CPU, lib) {
  lib.impl("forward", &forward_op);
  lib.impl("backward", &backward_op);
  lib.impl("join_sink", &join_sink_op);
  lib.impl("join_dense", &join_dense_op);
  lib.impl("forward_small", &forward_small_op);
}
