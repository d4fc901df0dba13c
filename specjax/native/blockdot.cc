// y[M, N] = x[M, K] @ W[K, N] for decode-sized M, as an XLA FFI custom call on the CPU.
//
// W is float32 [K, N]; or block codes as specjax.models.quant.BlockQuant lays them out: int8
// codes [K, N] (row k, column n), float32 scale and offset [K / bs, N], the weight being
// codes * scale + offset; or the same values tile-major (native.PackedQuant: each 32-column tile
// one contiguous stream), int8 or 4-bit codes two per byte (row 2j in the low nibble, row 2j + 1
// in the high one; unsigned 0..15 or signed -8..7), possibly one layer of a stack, read in place.
// XLA:CPU cannot fuse a dequantization into its dot, so it writes a float32 copy of every weight
// and reads it again; here each weight is expanded in registers right before its multiply-adds,
// once per group of up to kRows rows (a decode step, a verify pass), or once into a small
// float32 buffer that every group reads when there are more rows (a prefill).
//
// Numerics: every output is one float32 sum over k = 0 .. K-1 in order, a multiply-add per
// term, in both the block and the float kernel, and a code's value (code * scale + offset) is
// the one that BlockQuant.dequantize gives (the product is exact). So a block-quantized model
// and its dequantized float32 copy give the same outputs bit for bit, and a row's output
// does not depend on M or on how the work is split among threads.
//
// Threads: the columns are cut into tiles of kCols, claimed from an atomic counter by the
// calling thread and by helpers scheduled on XLA's intra-op pool (parallel.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "parallel.h"

namespace ffi = xla::ffi;

namespace {

// Vectors of the widest float SIMD the compiler targets; a tile of 32 columns is 2 or 4 of them.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float VecF __attribute__((vector_size(kLanes * sizeof(float))));
constexpr int64_t kCols = 32;  // columns per tile (the Python side asks for N % 32 == 0)
constexpr int kVecs = kCols / kLanes;
// rows sharing one pass over a tile's weights: with AVX-512 their accumulators take 20 of the 32
// vector registers, so a verify pass of up to K + 1 = 10 rows expands each weight once
#if defined(__AVX512F__)
constexpr int64_t kRows = 10;
#else
constexpr int64_t kRows = 2;
#endif
constexpr int64_t kTilesPerClaim = 8;  // at most: 256 adjacent columns read whole cache lines
constexpr int64_t kChunk = 64;         // rows of weights read across a claim's columns at a time

template <typename V, typename T>
inline V Load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

// kLanes int8 codes as floats (GCC lowers a generic int8 -> float convertvector to scalar code).
inline VecF LoadCodes(const int8_t* p) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  VecF f;
  for (int i = 0; i < kLanes; ++i) f[i] = static_cast<float>(p[i]);
#endif
  VecF v;
  std::memcpy(&v, &f, sizeof(VecF));
  return v;
}

// kLanes bytes, each holding two 4-bit codes: (low nibbles, high nibbles) as floats.
template <bool kSigned>
inline void LoadNibbles(const uint8_t* p, VecF* lo, VecF* hi) {
#if defined(__AVX512F__)
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i l = kSigned ? _mm512_srai_epi32(_mm512_slli_epi32(b, 28), 28) : _mm512_and_si512(b, _mm512_set1_epi32(15));
  const __m512i h = kSigned ? _mm512_srai_epi32(_mm512_slli_epi32(b, 24), 28) : _mm512_srli_epi32(b, 4);
  const __m512 fl = _mm512_cvtepi32_ps(l), fh = _mm512_cvtepi32_ps(h);
#elif defined(__AVX2__)
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i l = kSigned ? _mm256_srai_epi32(_mm256_slli_epi32(b, 28), 28) : _mm256_and_si256(b, _mm256_set1_epi32(15));
  const __m256i h = kSigned ? _mm256_srai_epi32(_mm256_slli_epi32(b, 24), 28) : _mm256_srli_epi32(b, 4);
  const __m256 fl = _mm256_cvtepi32_ps(l), fh = _mm256_cvtepi32_ps(h);
#else
  VecF fl, fh;
  for (int i = 0; i < kLanes; ++i) {
    const int l = p[i] & 15, h = p[i] >> 4;
    fl[i] = static_cast<float>(kSigned && l >= 8 ? l - 16 : l);
    fh[i] = static_cast<float>(kSigned && h >= 8 ? h - 16 : h);
  }
#endif
  std::memcpy(lo, &fl, sizeof(VecF));
  std::memcpy(hi, &fh, sizeof(VecF));
}

// How the weights are held.
enum class Codes { kDense, kInt8, kU4, kS4 };

// Int8 codes and floats come row-major ([K, N], scales [K / bs, N]); nibbles come tile-major
// (native.PackedQuant: [N / 32, K / 2, 32], scales [N / 32, K / bs, 32]), so that a tile's weights
// are one contiguous stream. `Rows(t)` is where tile t's rows start and `stride` the step between
// rows, for the codes and for the scales.
struct Weights {
  const uint8_t* nibbles = nullptr;  // kU4 / kS4
  const int8_t* codes = nullptr;     // kInt8
  const float* scale = nullptr;
  const float* offset = nullptr;     // or null
  const float* dense = nullptr;      // kDense
  int64_t bs = 1;
  int64_t code_stride = 0, side_stride = 0;  // elements between consecutive rows
  int64_t code_tile = 0, side_tile = 0;      // elements between consecutive tiles
};

// Calls fn(k, wv) for rows k = k0 .. k1 - 1 of tile t, in order, wv the row's kCols weight values
// (a code's value as BlockQuant.dequantize computes it; k0 is a multiple of the block size).
template <Codes kCodes, bool kOffset, typename Fn>
inline void ForEachRow(const Weights& w, int64_t t, int64_t k0, int64_t k1, Fn&& fn) {
  const int64_t cs = w.code_stride, ss = w.side_stride;
  if constexpr (kCodes == Codes::kDense) {
    const float* d = w.dense + t * w.code_tile;
    for (int64_t k = k0; k < k1; ++k) {
      VecF wv[kVecs];
#pragma GCC unroll 16
      for (int v = 0; v < kVecs; ++v) wv[v] = Load<VecF>(d + k * cs + v * kLanes);
      fn(k, wv);
    }
  } else {
    const int64_t bs = w.bs;
    const float* sc = w.scale + t * w.side_tile;
    const float* of = kOffset ? w.offset + t * w.side_tile : nullptr;
    for (int64_t kb = k0; kb < k1; kb += bs) {
      VecF sv[kVecs], ov[kVecs];
#pragma GCC unroll 16
      for (int v = 0; v < kVecs; ++v) {
        sv[v] = Load<VecF>(sc + (kb / bs) * ss + v * kLanes);
        ov[v] = kOffset ? Load<VecF>(of + (kb / bs) * ss + v * kLanes) : VecF{};
      }
      auto value = [&](const VecF& q, int v) { return kOffset ? q * sv[v] + ov[v] : q * sv[v]; };
      if constexpr (kCodes == Codes::kInt8) {
        for (int64_t k = kb; k < kb + bs; ++k) {
          VecF wv[kVecs];
#pragma GCC unroll 16
          for (int v = 0; v < kVecs; ++v) wv[v] = value(LoadCodes(w.codes + t * w.code_tile + k * cs + v * kLanes), v);
          fn(k, wv);
        }
      } else {  // two rows per byte, in row order
        for (int64_t k = kb; k < kb + bs; k += 2) {
          VecF lo[kVecs], hi[kVecs];
#pragma GCC unroll 16
          for (int v = 0; v < kVecs; ++v) {
            LoadNibbles<kCodes == Codes::kS4>(w.nibbles + t * w.code_tile + (k / 2) * cs + v * kLanes, &lo[v], &hi[v]);
            lo[v] = value(lo[v], v);
            hi[v] = value(hi[v], v);
          }
          fn(k, lo);
          fn(k + 1, hi);
        }
      }
    }
  }
}

// Rows k0 .. k1 - 1 of one tile of kCols columns starting at n0, for rows m0 .. m0 + R - 1 of x;
// the partial sums continue those in y (k0 == 0: start from 0). The accumulators stay in registers.
template <int R, Codes kCodes, bool kOffset>
inline void Tile(const float* x, float* y, const Weights& w, int64_t K, int64_t N, int64_t m0,
                 int64_t n0, int64_t k0, int64_t k1) {
  VecF acc[R][kVecs];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < kVecs; ++v)
      acc[r][v] = k0 == 0 ? VecF{} : Load<VecF>(y + (m0 + r) * N + n0 + v * kLanes);
  const float* xr[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * K;
  ForEachRow<kCodes, kOffset>(w, n0 / kCols, k0, k1, [&](int64_t k, const VecF (&wv)[kVecs]) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float xv = xr[r][k];
#pragma GCC unroll 16
      for (int v = 0; v < kVecs; ++v) acc[r][v] += xv * wv[v];
    }
  });
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < kVecs; ++v) std::memcpy(y + (m0 + r) * N + n0 + v * kLanes, &acc[r][v], sizeof(VecF));
}

template <Codes kCodes, bool kOffset>
void Rows(const float* x, float* y, const Weights& w, int64_t M, int64_t K, int64_t N, int64_t n0,
          int64_t k0, int64_t k1) {
  if constexpr (kCodes != Codes::kDense) {
    if (M > kRows) {  // several passes (a prefill, a batch's verify): expand the weights once
      thread_local std::unique_ptr<float[]> buf;
      thread_local int64_t size = 0;
      if (size < K * kCols) buf.reset(new float[size = K * kCols]);
      float* b = buf.get();
      ForEachRow<kCodes, kOffset>(w, n0 / kCols, k0, k1, [&](int64_t k, const VecF (&wv)[kVecs]) {
#pragma GCC unroll 16
        for (int v = 0; v < kVecs; ++v) std::memcpy(b + k * kCols + v * kLanes, &wv[v], sizeof(VecF));
      });
      Weights d;  // the tile's values as a dense tile, row k at b + k * kCols
      d.dense = b;
      d.code_stride = kCols;
      d.code_tile = 0;
      Rows<Codes::kDense, false>(x, y, d, M, K, N, n0, k0, k1);
      return;
    }
  }
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) Tile<kRows, kCodes, kOffset>(x, y, w, K, N, m, n0, k0, k1);
  switch (M - m) {
    case 9: Tile<9, kCodes, kOffset>(x, y, w, K, N, m, n0, k0, k1); break;
    case 8: Tile<8, kCodes, kOffset>(x, y, w, K, N, m, n0, k0, k1); break;
    case 7: Tile<7, kCodes, kOffset>(x, y, w, K, N, m, n0, k0, k1); break;
    case 6: Tile<6, kCodes, kOffset>(x, y, w, K, N, m, n0, k0, k1); break;
    case 5: Tile<5, kCodes, kOffset>(x, y, w, K, N, m, n0, k0, k1); break;
    case 4: Tile<4, kCodes, kOffset>(x, y, w, K, N, m, n0, k0, k1); break;
    case 3: Tile<3, kCodes, kOffset>(x, y, w, K, N, m, n0, k0, k1); break;
    case 2: Tile<2, kCodes, kOffset>(x, y, w, K, N, m, n0, k0, k1); break;
    case 1: Tile<1, kCodes, kOffset>(x, y, w, K, N, m, n0, k0, k1); break;
    default: break;
  }
}

// Tiles t0 .. t1 - 1 (adjacent columns). Row-major weights: kChunk rows at a time across all of
// them, since a tile's rows lie N bytes apart, too far for the hardware prefetcher, so a chunk's
// rows are read across the whole group (contiguous bytes) before moving down; the partial sums
// wait in y, every output still one sum over k in order. Tile-major weights: each tile is one
// contiguous stream, read whole (chunks there made the prefetcher lose the stream at every
// chunk: 2.5x the time of a [576, 1536] product at one row, weights not in cache).
template <Codes kCodes, bool kOffset>
void Group(const float* x, float* y, const Weights& w, int64_t M, int64_t K, int64_t N, int64_t t0,
           int64_t t1) {
  const bool tile_major = w.code_stride == kCols;
  const int64_t chunk = tile_major ? K : kCodes == Codes::kDense ? kChunk : (kChunk + w.bs - 1) / w.bs * w.bs;
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t k1 = std::min(K, k0 + chunk);
    for (int64_t t = t0; t < t1; ++t) Rows<kCodes, kOffset>(x, y, w, M, K, N, t * kCols, k0, k1);
  }
}

template <Codes kCodes, bool kOffset>
ffi::Error RunAs(ffi::ThreadPool& pool, const float* x, float* y, const Weights& w, int64_t M, int64_t K,
                 int64_t N) {
  // Claims small enough that every thread gets a few (a layer's 6 or 18 tiles too), and up to
  // 8 tiles where there are many (the LM head's 1536).
  const int64_t tiles = N / kCols, threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t claim = std::clamp<int64_t>(tiles / (4 * threads), 1, kTilesPerClaim);
  specjax_native::ParallelFor(pool, tiles, claim, [=, &w](int64_t t0, int64_t t1) {
    Group<kCodes, kOffset>(x, y, w, M, K, N, t0, t1);
  });
  return ffi::Error::Success();
}

ffi::Error Run(ffi::ThreadPool pool, const float* x, float* y, Weights w, Codes codes, int64_t M, int64_t K,
               int64_t N) {
  if (N % kCols != 0) return ffi::Error::InvalidArgument("blockdot: N must be a multiple of the tile width");
  if (codes != Codes::kDense && (w.bs <= 0 || K % w.bs != 0 || ((codes == Codes::kU4 || codes == Codes::kS4) && w.bs % 2)))
    return ffi::Error::InvalidArgument("blockdot: K must be a multiple of an (even, for nibbles) block size");
  const bool off = w.offset != nullptr;
  switch (codes) {
    case Codes::kDense: return RunAs<Codes::kDense, false>(pool, x, y, w, M, K, N);
    case Codes::kInt8: return off ? RunAs<Codes::kInt8, true>(pool, x, y, w, M, K, N)
                                  : RunAs<Codes::kInt8, false>(pool, x, y, w, M, K, N);
    case Codes::kU4: return off ? RunAs<Codes::kU4, true>(pool, x, y, w, M, K, N)
                                : RunAs<Codes::kU4, false>(pool, x, y, w, M, K, N);
    case Codes::kS4: return off ? RunAs<Codes::kS4, true>(pool, x, y, w, M, K, N)
                                : RunAs<Codes::kS4, false>(pool, x, y, w, M, K, N);
  }
  return ffi::Error::Internal("blockdot: unknown code kind");
}

// int8 codes, row-major: codes [K, N], scale/offset [K / bs, N]
ffi::Error BlockImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes,
                     ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset,
                     ffi::ResultBuffer<ffi::F32> y, bool has_offset) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 || xd[1] != cd[0] || sd[1] != cd[1] ||
      (has_offset && offset.element_count() != scale.element_count()))
    return ffi::Error::InvalidArgument("blockdot: expected x [M, K], codes [K, N], scale/offset [K/bs, N]");
  Weights w;
  w.codes = codes.typed_data();
  w.scale = scale.typed_data();
  w.offset = has_offset ? offset.typed_data() : nullptr;
  w.bs = sd[0] > 0 ? cd[0] / sd[0] : 0;
  if (w.bs * sd[0] != cd[0]) return ffi::Error::InvalidArgument("blockdot: K is not blocks x block size");
  w.code_stride = w.side_stride = cd[1];
  w.code_tile = w.side_tile = kCols;
  return Run(pool, x.typed_data(), y->typed_data(), w, Codes::kInt8, xd[0], xd[1], cd[1]);
}

// Tile-major codes (native.PackedQuant) of a stack of L layers, layer `layer` read where it lies
// (a scan over the stack copies no slice): data [L, N / 32, K / per, 32] (uint8 nibbles, per = 2,
// or int8 codes, per = 1), scale/offset [L, N / 32, K / bs, 32], layer an int32 scalar.
ffi::Error TileImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                    ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset, ffi::Buffer<ffi::S32> layer,
                    ffi::ResultBuffer<ffi::F32> y, bool has_offset, int32_t bits, bool is_signed) {
  const auto xd = x.dimensions(), dd = data.dimensions(), sd = scale.dimensions();
  const int64_t per = bits == 4 ? 2 : 1;
  if ((bits != 4 && bits != 8) || data.element_type() != (bits == 4 ? ffi::U8 : ffi::S8))
    return ffi::Error::InvalidArgument("blockdot: expected uint8 nibbles (bits 4) or int8 codes (bits 8)");
  if (xd.size() != 2 || dd.size() != 4 || sd.size() != 4 || dd[3] != kCols || sd[3] != kCols ||
      sd[0] != dd[0] || sd[1] != dd[1] || xd[1] != per * dd[2] ||
      (has_offset && offset.element_count() != scale.element_count()) || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "blockdot: expected x [M, K], data [L, N/32, K/per, 32], scale/offset [L, N/32, K/bs, 32], a layer index");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= dd[0]) return ffi::Error::InvalidArgument("blockdot: layer index out of range");
  const int64_t K = xd[1], T = dd[1], nb = sd[2];
  const int64_t data_layer = T * dd[2] * kCols, side_layer = T * nb * kCols;
  Weights w;
  if (bits == 4)
    w.nibbles = static_cast<const uint8_t*>(data.untyped_data()) + l * data_layer;
  else
    w.codes = static_cast<const int8_t*>(data.untyped_data()) + l * data_layer;
  w.scale = scale.typed_data() + l * side_layer;
  w.offset = has_offset ? offset.typed_data() + l * side_layer : nullptr;
  w.bs = nb > 0 ? K / nb : 0;
  if (w.bs * nb != K) return ffi::Error::InvalidArgument("blockdot: K is not blocks x block size");
  w.code_stride = w.side_stride = kCols;
  w.code_tile = dd[2] * kCols;
  w.side_tile = nb * kCols;
  const Codes kind = bits == 8 ? Codes::kInt8 : is_signed ? Codes::kS4 : Codes::kU4;
  return Run(pool, x.typed_data(), y->typed_data(), w, kind, xd[0], K, T * kCols);
}

ffi::Error DenseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dense,
                     ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = dense.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("blockdot: expected x [M, K], w [K, N]");
  Weights w;
  w.dense = dense.typed_data();
  w.code_stride = wd[1];
  w.code_tile = kCols;
  return Run(pool, x.typed_data(), y->typed_data(), w, Codes::kDense, xd[0], xd[1], wd[1]);
}


// ---------------------------------------------------------------------------------------------
// Int8 activations (Engine(matmul="q8")): llama.cpp's numerics, not float32's. Each row of x is
// quantized per block of xb = min(bs, 32) columns to int8 (scale amax / 127, round to nearest
// even), each weight block's codes (shifted by `zero` to be unsigned) meet them in exact
// integer dot products (AVX512-VNNI: 64 multiply-adds per instruction, against 16 float ones),
// and a block's integer sums are scaled in float32:
//   y[m, n] += dx[m, b] * (scale[b, n] * (I[m, b, n] - zero * X[m, b]) + offset[b, n] * X[m, b])
// with I = sum(u * xq) and X = sum(xq) over the block. A row's outputs depend on that row only.
//
// Weights (native.Q8Tiles): tiles of 16 columns, each one contiguous stream of 64-byte groups;
// bits 4: group g holds rows 8g .. 8g + 7 of the tile, byte 4n + i = u(8g + i, n) | u(8g + 4 + i,
// n) << 4; bits 8: rows 4g .. 4g + 3, byte 4n + i = u(4g + i, n). So a group's low nibbles (or
// its bytes) are, in lane n, four consecutive rows of column n: one VNNI operand.
constexpr int64_t kQCols = 16;
constexpr int kQRowsMax = 10;  // rows per pass: 2 x 10 accumulators + weights fit 32 registers

struct QActs {
  const int8_t* q;     // [M, K]
  const float* d;      // [M, nxb]
  const int32_t* sum;  // [M, nxb]
  int64_t K, xb, nxb;
};

struct QWeights {
  const uint8_t* data = nullptr;  // one layer: [N / 16, K / per, 64]
  const float* scale = nullptr;   // [N / 16, K / bs, 16]
  const float* offset = nullptr;  // or null
  int64_t bs = 0, data_tile = 0, side_tile = 0;
  int32_t zero = 0;
};

// One block of xb (16 or 32) activations: int8 codes, their scale and their sum.
inline void QuantizeBlock(const float* xr, int64_t xb, int8_t* q, float* d, int32_t* sum) {
#if defined(__AVX512F__)
  if (xb == 16 || xb == 32) {
    const __m512 v0 = _mm512_loadu_ps(xr), v1 = xb == 32 ? _mm512_loadu_ps(xr + 16) : _mm512_setzero_ps();
    // _mm512_max_ps would drop a nan; a nan block must give a nan scale
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const bool finite = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_mul_ps(v0, _mm512_setzero_ps()),
                                                           _mm512_mul_ps(v1, _mm512_setzero_ps()))) == 0.0f;
    const float dx = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
    const float inv = dx > 0.0f ? 1.0f / dx : 0.0f;
    // round to nearest even (the default rounding mode), saturate to int8 (|x * inv| <= 127);
    // a non-finite block's codes are 0 (inv = 0; the conversion turns nan into INT_MIN)
    const __m512 f0 = finite ? _mm512_mul_ps(v0, _mm512_set1_ps(inv)) : _mm512_setzero_ps();
    const __m512 f1 = finite ? _mm512_mul_ps(v1, _mm512_set1_ps(inv)) : _mm512_setzero_ps();
    const __m512i q0 = _mm512_cvtps_epi32(f0), q1 = _mm512_cvtps_epi32(f1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q0));
    if (xb == 32) _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q1));
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    *d = dx;
    return;
  }
#endif
  float amax = 0.0f;
  bool finite = true;
  for (int64_t j = 0; j < xb; ++j) {
    amax = std::max(amax, std::fabs(xr[j]));
    finite = finite && std::isfinite(xr[j]);
  }
  // a non-finite block gets a nan scale, so the row's outputs are not finite
  const float dx = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
  const float inv = dx > 0.0f ? 1.0f / dx : 0.0f;
  int32_t s = 0;
  for (int64_t j = 0; j < xb; ++j) {
    const int32_t c = finite ? std::clamp<int32_t>(static_cast<int32_t>(std::nearbyint(xr[j] * inv)), -127, 127) : 0;
    q[j] = static_cast<int8_t>(c);
    s += c;
  }
  *sum = s;
  *d = dx;
}

void QuantizeRows(const float* x, int64_t M, int64_t K, int64_t xb, int8_t* q, float* d, int32_t* sum) {
  const int64_t nxb = K / xb;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nxb; ++b)
      QuantizeBlock(x + m * K + b * xb, xb, q + m * K + b * xb, d + m * nxb + b, sum + m * nxb + b);
}

template <int R, int kBits>
void QTile(const QActs& a, const QWeights& w, float* y, int64_t N, int64_t m0, int64_t t) {
  constexpr int64_t per_group = kBits == 4 ? 8 : 4;  // rows of K per 64-byte group
  const uint8_t* g = w.data + t * w.data_tile;
  const float* sc = w.scale + t * w.side_tile;
  const float* of = w.offset ? w.offset + t * w.side_tile : nullptr;
  const int8_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = a.q + (m0 + r) * a.K;
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi8(15);
  auto bcast = [](const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); };
  for (int64_t k0 = 0, xbi = 0; k0 < a.K; k0 += a.xb, ++xbi) {
    __m512i isum[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k0 + a.xb; k += per_group, g += 64) {
      const __m512i wb = _mm512_loadu_si512(g);
      if constexpr (kBits == 4) {
        const __m512i lo = _mm512_and_si512(wb, mask), hi = _mm512_and_si512(_mm512_srli_epi32(wb, 4), mask);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          isum[r] = _mm512_dpbusd_epi32(isum[r], lo, bcast(xq[r] + k));
          isum[r] = _mm512_dpbusd_epi32(isum[r], hi, bcast(xq[r] + k + 4));
        }
      } else {
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) isum[r] = _mm512_dpbusd_epi32(isum[r], wb, bcast(xq[r] + k));
      }
    }
    const int64_t b = k0 / w.bs;
    const __m512 s = _mm512_loadu_ps(sc + b * kQCols);
    const __m512 o = of ? _mm512_loadu_ps(of + b * kQCols) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int32_t X = a.sum[(m0 + r) * a.nxb + xbi];
      const __m512i iv = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(w.zero * X));
      __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(iv), s);
      if (of) v = _mm512_fmadd_ps(o, _mm512_set1_ps(static_cast<float>(X)), v);
      acc[r] = _mm512_fmadd_ps(v, _mm512_set1_ps(a.d[(m0 + r) * a.nxb + xbi]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (m0 + r) * N + t * kQCols, acc[r]);
#elif defined(__AVX2__) && defined(__FMA__)
  // AVX2 without VNNI: the tile as two halves of 8 columns (bytes 0-31 and 32-63 of each group).
  // A VNNI step, 4 products u * x summed into int32, is maddubs (u8 x s8 products summed in pairs
  // to int16) then madd with ones. The pairs cannot saturate for codes below 16 (2 x 15 x 127), so
  // an 8-bit code is split into nibbles, u = lo + 16 hi, and its high half's pairs are scaled by 16
  // in that madd. The integer sums are exact, and the float32 steps are the AVX-512 path's, so
  // every path gives the same bits (the audits resume across machines on that).
  const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  auto bcast = [](const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); };
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* gh = g + 32 * half;
    for (int64_t k0 = 0, xbi = 0; k0 < a.K; k0 += a.xb, ++xbi) {
      __m256i isum[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
      for (int64_t k = k0; k < k0 + a.xb; k += per_group, gh += 64) {
        const __m256i wb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gh));
        const __m256i lo = _mm256_and_si256(wb, mask), hi = _mm256_and_si256(_mm256_srli_epi16(wb, 4), mask);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          if constexpr (kBits == 4) {
            // rows k .. k+3 in the low nibbles, k+4 .. k+7 in the high ones: 2 x 2 x 15 x 127 fits int16
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast(xq[r] + k)),
                                               _mm256_maddubs_epi16(hi, bcast(xq[r] + k + 4)));
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, ones));
          } else {
            const __m256i x = bcast(xq[r] + k);
            isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(
                _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x), ones),
                _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x), sixteen)));
          }
        }
      }
      const int64_t b = k0 / w.bs;
      const __m256 s = _mm256_loadu_ps(sc + b * kQCols + 8 * half);
      const __m256 o = of ? _mm256_loadu_ps(of + b * kQCols + 8 * half) : _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const int32_t X = a.sum[(m0 + r) * a.nxb + xbi];
        const __m256i iv = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(w.zero * X));
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(iv), s);
        if (of) v = _mm256_fmadd_ps(o, _mm256_set1_ps(static_cast<float>(X)), v);
        acc[r] = _mm256_fmadd_ps(v, _mm256_set1_ps(a.d[(m0 + r) * a.nxb + xbi]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (m0 + r) * N + t * kQCols + 8 * half, acc[r]);
  }
#else
  // Portable: the same integer sums and the same float32 steps (one multiply-add fewer fused).
  float acc[R][kQCols] = {};
  for (int64_t k0 = 0, xbi = 0; k0 < a.K; k0 += a.xb, ++xbi) {
    int32_t isum[R][kQCols] = {};
    for (int64_t k = k0; k < k0 + a.xb; k += per_group, g += 64)
      for (int n = 0; n < kQCols; ++n)
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = g[4 * n + i];
          for (int r = 0; r < R; ++r) {
            if constexpr (kBits == 4) {
              isum[r][n] += (byte & 15) * xq[r][k + i] + (byte >> 4) * xq[r][k + 4 + i];
            } else {
              isum[r][n] += byte * xq[r][k + i];
            }
          }
        }
    const int64_t b = k0 / w.bs;
    for (int r = 0; r < R; ++r) {
      const int32_t X = a.sum[(m0 + r) * a.nxb + xbi];
      const float dx = a.d[(m0 + r) * a.nxb + xbi];
      for (int n = 0; n < kQCols; ++n) {
        float v = static_cast<float>(isum[r][n] - w.zero * X) * sc[b * kQCols + n];
        if (of) v = std::fma(of[b * kQCols + n], static_cast<float>(X), v);
        acc[r][n] = std::fma(v, dx, acc[r][n]);
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + (m0 + r) * N + t * kQCols, acc[r], sizeof(acc[r]));
#endif
}

// All rows of x against tile t, in passes of at most kQRowsMax rows of balanced size (9 rows, a
// verify pass at K = 8, are one pass); the tile's weights stay in L1 between passes.
template <int kBits>
void QRows(const QActs& a, const QWeights& w, float* y, int64_t M, int64_t N, int64_t t) {
  const int64_t passes = (M + kQRowsMax - 1) / kQRowsMax;
  for (int64_t p = 0, m0 = 0; p < passes; ++p) {
    const int64_t rows = (M - m0) / (passes - p);
    switch (rows) {
#define SPECJAX_QCASE(n) case n: QTile<n, kBits>(a, w, y, N, m0, t); break;
      SPECJAX_QCASE(1) SPECJAX_QCASE(2) SPECJAX_QCASE(3) SPECJAX_QCASE(4) SPECJAX_QCASE(5)
      SPECJAX_QCASE(6) SPECJAX_QCASE(7) SPECJAX_QCASE(8) SPECJAX_QCASE(9) SPECJAX_QCASE(10)
#undef SPECJAX_QCASE
      default: break;
    }
    m0 += rows;
  }
}

template <int kBits>
ffi::Error QRun(ffi::ThreadPool& pool, const QActs& a, const QWeights& w, float* y, int64_t M, int64_t N) {
  const int64_t tiles = N / kQCols, threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t claim = std::clamp<int64_t>(tiles / (4 * threads), 1, 2 * kTilesPerClaim);
  specjax_native::ParallelFor(pool, tiles, claim, [=, &a, &w](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) QRows<kBits>(a, w, y, M, N, t);
  });
  return ffi::Error::Success();
}

// x f32 [M, K]; data uint8 [L, N/16, K/per, 64] (per = 8 for bits 4, 4 for bits 8); scale and
// offset f32 [L, N/16, K/bs, 16]; layer an int32 scalar.
ffi::Error Q8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> data,
                  ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset, ffi::Buffer<ffi::S32> layer,
                  ffi::ResultBuffer<ffi::F32> y, bool has_offset, int32_t bits, int32_t zero) {
  const auto xd = x.dimensions(), dd = data.dimensions(), sd = scale.dimensions();
  const int64_t per = bits == 4 ? 8 : 4;
  if (bits != 4 && bits != 8) return ffi::Error::InvalidArgument("q8dot: bits must be 4 or 8");
  if (xd.size() != 2 || dd.size() != 4 || sd.size() != 4 || dd[3] != 64 || sd[3] != kQCols || sd[0] != dd[0] ||
      sd[1] != dd[1] || xd[1] != per * dd[2] || (has_offset && offset.element_count() != scale.element_count()) ||
      layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "q8dot: expected x [M, K], data [L, N/16, K/per, 64], scale/offset [L, N/16, K/bs, 16], a layer index");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= dd[0]) return ffi::Error::InvalidArgument("q8dot: layer index out of range");
  const int64_t M = xd[0], K = xd[1], T = dd[1], nb = sd[2];
  const int64_t bs = nb > 0 ? K / nb : 0;
  if (bs <= 0 || bs * nb != K || bs % per != 0 || (bs % 32 != 0 && 32 % bs != 0))
    return ffi::Error::InvalidArgument("q8dot: the block size must divide K, be a multiple of 8 (4 for 8 bits) "
                                       "and divide 32 or be a multiple of it");
  QWeights w;
  w.data = data.typed_data() + l * T * dd[2] * 64;
  w.scale = scale.typed_data() + l * T * nb * kQCols;
  w.offset = has_offset ? offset.typed_data() + l * T * nb * kQCols : nullptr;
  w.bs = bs;
  w.data_tile = dd[2] * 64;
  w.side_tile = nb * kQCols;
  w.zero = zero;
  QActs a;
  a.K = K;
  a.xb = std::min<int64_t>(bs, 32);
  a.nxb = K / a.xb;
  std::unique_ptr<int8_t[]> q(new int8_t[M * K]);
  std::unique_ptr<float[]> d(new float[M * a.nxb]);
  std::unique_ptr<int32_t[]> sum(new int32_t[M * a.nxb]);
  QuantizeRows(x.typed_data(), M, K, a.xb, q.get(), d.get(), sum.get());
  a.q = q.get();
  a.d = d.get();
  a.sum = sum.get();
  return bits == 4 ? QRun<4>(pool, a, w, y->typed_data(), M, T * kQCols)
                   : QRun<8>(pool, a, w, y->typed_data(), M, T * kQCols);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxBlockDot, BlockImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("has_offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxDenseDot, DenseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxTileDot, TileImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("has_offset")
                                  .Attr<int32_t>("bits")
                                  .Attr<bool>("is_signed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ8Dot, Q8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("has_offset")
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("zero"));
