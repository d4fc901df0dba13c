// y[M, N] = x[M, K] @ W[K, N] for decode-sized M, as an XLA FFI custom call on the CPU.
//
// W is float32 [K, N]; or block codes as specjax.models.quant.BlockQuant lays them out: int8
// codes [K, N] (row k, column n), float32 scale and offset [K / bs, N], the weight being
// codes * scale + offset; or the same values tile-major (quant.PackedQuant: each 32-column tile
// one contiguous stream), int8 or 4-bit codes two per byte (row 2j in the low nibble, row 2j + 1
// in the high one; unsigned 0..15 or signed -8..7), possibly one layer of a stack, read in place.
// XLA:CPU cannot fuse a dequantization into its dot, so it writes a float32 copy of every weight
// and reads it again; here each weight is expanded in registers right before its multiply-adds,
// and is read once per group of up to kRows rows.
//
// Numerics: every output is one float32 sum over k = 0 .. K-1 in order, a multiply-add per
// term, in both the block and the float kernel, and a code's value (code * scale + offset) is
// the one that BlockQuant.dequantize gives (the product is exact). So a block-quantized model
// and its dequantized float32 copy give the same outputs bit for bit, and a row's output
// does not depend on M or on how the work is split among threads.
//
// Threads: the columns are cut into tiles of kCols, claimed from an atomic counter by the
// calling thread and by helpers scheduled on XLA's intra-op pool; a helper that starts late
// finds nothing to claim, so the call never waits on a busy pool.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

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
// rows sharing one pass over a tile's weights: their accumulators fill half the vector registers
#if defined(__AVX512F__)
constexpr int64_t kRows = 8;
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
// (quant.PackedQuant: [N / 32, K / 2, 32], scales [N / 32, K / bs, 32]), so that a tile's weights
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

// Rows k0 .. k1 - 1 of one tile of kCols columns starting at n0, for rows m0 .. m0 + R - 1 of x;
// the partial sums continue those in y (k0 == 0: start from 0). The accumulators stay in registers.
template <int R, Codes kCodes, bool kOffset>
inline void Tile(const float* x, float* y, const Weights& w, int64_t K, int64_t N, int64_t m0,
                 int64_t n0, int64_t k0, int64_t k1) {
  VecF acc[R][kVecs];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v)
      acc[r][v] = k0 == 0 ? VecF{} : Load<VecF>(y + (m0 + r) * N + n0 + v * kLanes);
  const float* xr[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * K;
  auto step = [&](int64_t k, const VecF (&wv)[kVecs]) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xv = xr[r][k];
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) acc[r][v] += xv * wv[v];
    }
  };
  const int64_t t = n0 / kCols, cs = w.code_stride, ss = w.side_stride;
  if constexpr (kCodes == Codes::kDense) {
    const float* d = w.dense + t * w.code_tile;
    for (int64_t k = k0; k < k1; ++k) {
      VecF wv[kVecs];
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) wv[v] = Load<VecF>(d + k * cs + v * kLanes);
      step(k, wv);
    }
  } else {
    const int64_t bs = w.bs;
    const float* sc = w.scale + t * w.side_tile;
    const float* of = kOffset ? w.offset + t * w.side_tile : nullptr;
    for (int64_t kb = k0; kb < k1; kb += bs) {  // k0 is a multiple of bs
      VecF sv[kVecs], ov[kVecs];
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) {
        sv[v] = Load<VecF>(sc + (kb / bs) * ss + v * kLanes);
        ov[v] = kOffset ? Load<VecF>(of + (kb / bs) * ss + v * kLanes) : VecF{};
      }
      // a code's value, as BlockQuant.dequantize computes it
      auto value = [&](const VecF& q, int v) { return kOffset ? q * sv[v] + ov[v] : q * sv[v]; };
      if constexpr (kCodes == Codes::kInt8) {
        for (int64_t k = kb; k < kb + bs; ++k) {
          VecF wv[kVecs];
#pragma GCC unroll 8
          for (int v = 0; v < kVecs; ++v) wv[v] = value(LoadCodes(w.codes + t * w.code_tile + k * cs + v * kLanes), v);
          step(k, wv);
        }
      } else {  // two rows per byte, summed in row order
        for (int64_t k = kb; k < kb + bs; k += 2) {
          VecF lo[kVecs], hi[kVecs];
#pragma GCC unroll 8
          for (int v = 0; v < kVecs; ++v) {
            LoadNibbles<kCodes == Codes::kS4>(w.nibbles + t * w.code_tile + (k / 2) * cs + v * kLanes, &lo[v], &hi[v]);
            lo[v] = value(lo[v], v);
            hi[v] = value(hi[v], v);
          }
          step(k, lo);
          step(k + 1, hi);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) std::memcpy(y + (m0 + r) * N + n0 + v * kLanes, &acc[r][v], sizeof(VecF));
}

template <Codes kCodes, bool kOffset>
void Rows(const float* x, float* y, const Weights& w, int64_t M, int64_t K, int64_t N, int64_t n0,
          int64_t k0, int64_t k1) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) Tile<kRows, kCodes, kOffset>(x, y, w, K, N, m, n0, k0, k1);
  switch (M - m) {
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

// Tiles t0 .. t1 - 1 (adjacent columns), kChunk rows of weights at a time across all of them:
// a tile's rows lie N bytes apart, too far for the hardware prefetcher, so a chunk's rows are
// read across the whole group (contiguous bytes) before moving down. The partial sums wait in
// y; every output is still one sum over k in order.
template <Codes kCodes, bool kOffset>
void Group(const float* x, float* y, const Weights& w, int64_t M, int64_t K, int64_t N, int64_t t0,
           int64_t t1) {
  const int64_t chunk = kCodes == Codes::kDense ? kChunk : (kChunk + w.bs - 1) / w.bs * w.bs;
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t k1 = std::min(K, k0 + chunk);
    for (int64_t t = t0; t < t1; ++t) Rows<kCodes, kOffset>(x, y, w, M, K, N, t * kCols, k0, k1);
  }
}

template <Codes kCodes, bool kOffset>
struct Job {
  const float* x;
  float* y;
  Weights w;
  int64_t M, K, N, tiles, claim;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    for (;;) {
      const int64_t t0 = next.fetch_add(claim, std::memory_order_relaxed);
      if (t0 >= tiles) return;
      const int64_t t1 = std::min(tiles, t0 + claim);
      Group<kCodes, kOffset>(x, y, w, M, K, N, t0, t1);
      done.fetch_add(t1 - t0, std::memory_order_release);
    }
  }
};

template <Codes kCodes, bool kOffset>
ffi::Error RunAs(ffi::ThreadPool& pool, const float* x, float* y, const Weights& w, int64_t M, int64_t K,
                 int64_t N) {
  auto job = std::make_shared<Job<kCodes, kOffset>>();
  job->x = x;
  job->y = y;
  job->w = w;
  job->M = M;
  job->K = K;
  job->N = N;
  job->tiles = N / kCols;
  // Claims small enough that every thread gets a few (a layer's 6 or 18 tiles too), and up to
  // 8 tiles where there are many (the LM head's 1536).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  job->claim = std::clamp<int64_t>(job->tiles / (4 * threads), 1, kTilesPerClaim);
  const int64_t helpers = std::min<int64_t>(threads, job->tiles / job->claim) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->Work(); });
  job->Work();
  // Tiles claimed by helpers may still be in flight.
  while (job->done.load(std::memory_order_acquire) < job->tiles) std::this_thread::yield();
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

// Tile-major codes (quant.PackedQuant) of a stack of L layers, layer `layer` read where it lies
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
