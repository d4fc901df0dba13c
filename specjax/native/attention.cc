// Attention of T new positions per row over one layer of the KV cache, read where it lies, as an
// XLA FFI custom call on the CPU (Engine(matmul="q8") uses it; see specjax.native.attention).
//
// XLA computes a cached attention over the whole cache length S, masked, and first copies the
// layer's keys and values into the layout its dots want; here each query reads only the keys it
// can see (j <= its position), in place in the stack of layers. Each (row, position, KV head)
// is one task: its H / G query heads share every key and value read.
//
// The deferred variant (SpecjaxAttentionDeferred) takes the T new keys and values apart, as a
// verify inside a branch computes them without writing the cache: positions before a row's first
// new one are read from the stack, the new ones from those arrays, in the same key order, so its
// output is bit for bit that of writing them into the cache first (and no copy of a layer).
//
// Numerics: float32; for a query, one pass of scores in key order, the max, exponentials (a
// polynomial with about 2 ulp of error, not libm's), their sum in key order, and the weighted
// sum of values in key order. So a query's output depends on its position and the cache only:
// not on T, S or the other rows. A score's dot over Dh (a multiple of 16) is summed in 16 lanes
// reduced in AVX-512's tree, by the AVX2 build too, so both give the same bits (the portable
// build, one chain in order, may differ in the last bit).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "parallel.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
// exp(x) for x <= 0 (scores minus their max); below -87.3 the result is 0 or a denormal.
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif

// The same polynomial, one value at a time (the portable build and the tails).
inline float ExpScalar(float x) {
  x = std::max(x, -87.3f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(-n, 0.693359375f, x);
  r = std::fma(-n, -2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r + 1.0f);
  return std::ldexp(p, static_cast<int>(n));
}

struct Shape {
  int64_t B, T, H, G, S, Dh;
};

// Where the keys and values of one (row, KV head) lie: positions [0, n_old) in the stack, the
// rest (from position first on, one per new token) in the new arrays.
struct Keys {
  const float *k, *v;  // position 0 of the stack
  int64_t stride;      // between consecutive positions in the stack
  const float *nk, *nv;  // the first new position's (nullptr: none apart)
  int64_t nstride;     // between consecutive new positions
  int64_t first;       // the first new token's position (n_old = min(first, n))
  inline const float* K(int64_t j) const { return j < first ? k + j * stride : nk + (j - first) * nstride; }
  inline const float* V(int64_t j) const { return j < first ? v + j * stride : nv + (j - first) * nstride; }
};

// One task: row b, position t, KV head g, its Q = H / G query heads, over the n visible keys.
void Task(const float* q, const Keys& kv, int64_t n, float* out, const Shape& s, int64_t b, int64_t t, int64_t g,
          std::vector<float>& scores) {
  const int64_t Q = s.H / s.G, Dh = s.Dh;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
  scores.resize(static_cast<size_t>(Q * std::max<int64_t>(n, 1)));
  for (int64_t qh = 0; qh < Q; ++qh) {
    const int64_t h = g * Q + qh;
    const float* qv = q + ((b * s.T + t) * s.H + h) * Dh;
    float* o = out + ((b * s.T + t) * s.H + h) * Dh;
    float* sc = scores.data() + qh * n;
    if (n == 0) {
      std::memset(o, 0, sizeof(float) * Dh);
      continue;
    }
    float m = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      const float* kj = kv.K(j);
      float d = 0.0f;
#if defined(__AVX512F__)
      if (Dh % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < Dh; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qv + i), _mm512_loadu_ps(kj + i), acc);
        d = _mm512_reduce_add_ps(acc);
      } else
#elif defined(__AVX2__) && defined(__FMA__)
      if (Dh % 16 == 0) {
        // AVX-512's sum, bit for bit: its 16 lanes as two halves, reduced in the tree GCC's
        // _mm512_reduce_add_ps takes (halves, then quarters, then pairs), so a run resumed on an
        // AVX2 machine decodes what an AVX-512 one would
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
        for (int64_t i = 0; i < Dh; i += 16) {
          lo = _mm256_fmadd_ps(_mm256_loadu_ps(qv + i), _mm256_loadu_ps(kj + i), lo);
          hi = _mm256_fmadd_ps(_mm256_loadu_ps(qv + i + 8), _mm256_loadu_ps(kj + i + 8), hi);
        }
        const __m256 h8 = _mm256_add_ps(hi, lo);
        const __m128 h4 = _mm_add_ps(_mm256_extractf128_ps(h8, 1), _mm256_castps256_ps128(h8));
        const __m128 h2 = _mm_add_ps(h4, _mm_shuffle_ps(h4, h4, _MM_SHUFFLE(1, 0, 3, 2)));
        d = _mm_cvtss_f32(h2) + _mm_cvtss_f32(_mm_shuffle_ps(h2, h2, 1));
      } else
#endif
      {
        for (int64_t i = 0; i < Dh; ++i) d = std::fma(qv[i], kj[i], d);
      }
      sc[j] = d * scale;
      m = std::max(m, sc[j]);
    }
    float sum = 0.0f;
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16) {
      const __m512 e = Exp(_mm512_sub_ps(_mm512_loadu_ps(sc + j), _mm512_set1_ps(m)));
      _mm512_storeu_ps(sc + j, e);
    }
#endif
    for (; j < n; ++j) sc[j] = ExpScalar(sc[j] - m);
    for (j = 0; j < n; ++j) sum += sc[j];  // in key order
    const float inv = 1.0f / sum;
#if defined(__AVX512F__)
    if (Dh % 16 == 0 && Dh <= 256) {
      __m512 acc[16];
      const int64_t nv = Dh / 16;
      for (int64_t i = 0; i < nv; ++i) acc[i] = _mm512_setzero_ps();
      for (j = 0; j < n; ++j) {
        const __m512 p = _mm512_set1_ps(sc[j]);
        const float* vj = kv.V(j);
        for (int64_t i = 0; i < nv; ++i) acc[i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj + 16 * i), acc[i]);
      }
      for (int64_t i = 0; i < nv; ++i) _mm512_storeu_ps(o + 16 * i, _mm512_mul_ps(acc[i], _mm512_set1_ps(inv)));
      continue;
    }
#endif
    for (int64_t i = 0; i < Dh; ++i) o[i] = 0.0f;
    for (j = 0; j < n; ++j) {
      const float* vj = kv.V(j);
      for (int64_t i = 0; i < Dh; ++i) o[i] = std::fma(sc[j], vj[i], o[i]);
    }
    for (int64_t i = 0; i < Dh; ++i) o[i] *= inv;
  }
}

// The checks both handlers share; the shape on success.
ffi::Error Check(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v,
                 ffi::Buffer<ffi::S32>& layer, ffi::Buffer<ffi::S32>& positions, Shape& s) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), pd = positions.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5 || pd.size() != 2 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("attention: expected q [B, T, H, Dh], k/v [L, B, S, G, Dh], a layer, positions [B, T]");
  for (size_t i = 0; i < 5; ++i)
    if (kd[i] != vd[i]) return ffi::Error::InvalidArgument("attention: keys and values differ in shape");
  s = Shape{qd[0], qd[1], qd[2], kd[3], kd[2], qd[3]};
  if (kd[1] != s.B || kd[4] != s.Dh || pd[0] != s.B || pd[1] != s.T || s.G <= 0 || s.H % s.G != 0)
    return ffi::Error::InvalidArgument("attention: q, cache and positions disagree (or H is not a multiple of G)");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= kd[0]) return ffi::Error::InvalidArgument("attention: layer index out of range");
  return ffi::Error::Success();
}

// Keys a query at position p sees: positions j <= p that the cache holds (j < S).
inline int64_t Visible(const int32_t* pos, const Shape& s, int64_t b, int64_t t) {
  return std::clamp<int64_t>(static_cast<int64_t>(pos[b * s.T + t]) + 1, 0, s.S);
}

// Every (row, position, KV head) task of one call; nk / nv: the new keys and values [B, T, G, Dh]
// from each row's first position on, or nullptr (all in the stack).
void Run(ffi::ThreadPool& pool, const Shape& s, int64_t l, const float* qp, const float* k, const float* v,
         const int32_t* pp, const float* nkp, const float* nvp, float* op) {
  const int64_t per_layer = s.B * s.S * s.G * s.Dh;
  const float *kp = k + l * per_layer, *vp = v + l * per_layer;
  specjax_native::ParallelFor(pool, s.B * s.T * s.G, 1, [=](int64_t i0, int64_t i1) {
    thread_local std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i % s.G, bt = i / s.G, b = bt / s.T, t = bt % s.T;
      const int64_t base = (b * s.S * s.G + g) * s.Dh, nbase = (b * s.T * s.G + g) * s.Dh;
      const Keys kv = nkp == nullptr
          ? Keys{kp + base, vp + base, s.G * s.Dh, nullptr, nullptr, 0, s.S}
          : Keys{kp + base, vp + base, s.G * s.Dh, nkp + nbase, nvp + nbase, s.G * s.Dh, pp[b * s.T]};
      Task(qp, kv, Visible(pp, s, b, t), op, s, b, t, g, scores);
    }
  });
}

// q [B, T, H, Dh]; cache k / v [L, B, S, G, Dh]; layer s32[]; positions s32[B, T]; out [B, T, H, Dh].
ffi::Error AttnImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                    ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions, ffi::ResultBuffer<ffi::F32> out) {
  Shape s;
  if (auto e = Check(q, k, v, layer, positions, s); e.failure()) return e;
  Run(pool, s, layer.typed_data()[0], q.typed_data(), k.typed_data(), v.typed_data(), positions.typed_data(),
      nullptr, nullptr, out->typed_data());
  return ffi::Error::Success();
}

// As AttnImpl, with the T new tokens' keys and values nk / nv [B, T, G, Dh] apart: a row's
// positions must be consecutive (p, p + 1, ...), as a verify's are; the stack is read before p.
ffi::Error AttnDeferredImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                            ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions,
                            ffi::Buffer<ffi::F32> nk, ffi::Buffer<ffi::F32> nv, ffi::ResultBuffer<ffi::F32> out) {
  Shape s;
  if (auto e = Check(q, k, v, layer, positions, s); e.failure()) return e;
  const auto nd = nk.dimensions(), vd = nv.dimensions();
  if (nd.size() != 4 || vd.size() != 4 || nd[0] != s.B || nd[1] != s.T || nd[2] != s.G || nd[3] != s.Dh)
    return ffi::Error::InvalidArgument("attention: the new keys must be [B, T, G, Dh] as q and the cache give");
  for (size_t i = 0; i < 4; ++i)
    if (nd[i] != vd[i]) return ffi::Error::InvalidArgument("attention: new keys and values differ in shape");
  const int32_t* pp = positions.typed_data();
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t t = 1; t < s.T; ++t)
      if (pp[b * s.T + t] != pp[b * s.T] + t)
        return ffi::Error::InvalidArgument("attention: deferred new positions must be consecutive in each row");
  Run(pool, s, layer.typed_data()[0], q.typed_data(), k.typed_data(), v.typed_data(), pp, nk.typed_data(),
      nv.typed_data(), out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxAttention, AttnImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxAttentionDeferred, AttnDeferredImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
