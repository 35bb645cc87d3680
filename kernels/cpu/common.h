// What every kernel family shares: the includes, the generated constants (constants.h,
// written by the build from constants.py), the parallel loop, the GIL guard, the KV pool's
// dtype pairs and the vector layer (one set of float-vector helpers per width).
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "constants.h"

namespace {

// fn(begin, end, next) for runs of items that together cover [0, n) once, in a parallel
// region. Each thread starts on a contiguous share (first[t] to first[t + 1]; even shares
// where first is empty) and takes runs of about an eighth of it from its front; a thread
// whose share is done takes runs from the back of the others'. `next` is the first item of
// the run the thread takes after this one unless another takes it first (-1: none), for
// prefetching across runs. Why: on a two-core host the stack's other processes (and the
// worker's own event loop) preempt one of the engine's two threads now and then, and with
// fixed shares the other then waits at the region's end for the whole of the preempted
// thread's share; here only for the run it is in. Runs, not single items: handed one item a
// call, linear_i16's one-row tiles compiled to slower code (docs/benchmarks.md).
template <typename Fn>
void parallel_items(int64_t n, Fn&& fn, const std::vector<int64_t>& first = {}) {
  const int64_t threads = first.empty() ? std::min<int64_t>(at::get_num_threads(), n)
                                        : static_cast<int64_t>(first.size()) - 1;
  if (threads <= 1 || at::in_parallel_region()) {
    if (n > 0) fn(0, n, -1);
    return;
  }
  // A share's front (low 32 bits) and end (high), one cache line each, and its run length.
  struct alignas(64) Share {
    std::atomic<uint64_t> span;
    int64_t run;
  };
  std::vector<Share> shares(threads);
  for (int64_t t = 0; t < threads; ++t) {
    const uint64_t begin = first.empty() ? t * n / threads : first[t];
    const uint64_t end = first.empty() ? (t + 1) * n / threads : first[t + 1];
    shares[t].span.store(begin | end << 32, std::memory_order_relaxed);
    shares[t].run = std::max<int64_t>(1, static_cast<int64_t>(end - begin + 7) / 8);
  }
  // A run from the front of share s (from_back false) or from its back, as [begin, end);
  // false when the share is empty.
  auto take = [&](int64_t s, bool from_back, int64_t& begin, int64_t& end, int64_t& next) -> bool {
    const int64_t run = shares[s].run;
    uint64_t span = shares[s].span.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(span & 0xFFFFFFFFu), back = static_cast<int64_t>(span >> 32);
      if (front >= back) return false;
      const int64_t len = std::min(run, back - front);
      const uint64_t rest = from_back ? static_cast<uint64_t>(front) | static_cast<uint64_t>(back - len) << 32
                                      : static_cast<uint64_t>(front + len) | static_cast<uint64_t>(back) << 32;
      if (shares[s].span.compare_exchange_weak(span, rest, std::memory_order_relaxed)) {
        begin = from_back ? back - len : front;
        end = begin + len;
        if (from_back) {
          next = back - len > front ? std::max(front, back - len - run) : -1;
        } else {
          next = front + len < back ? front + len : -1;
        }
        return true;
      }
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    int64_t begin = 0, end = 0, next = -1;
    for (int64_t s = t0; s < t1; ++s) {
      while (take(s, false, begin, end, next)) fn(begin, end, next);
    }
    for (int64_t k = 1; k < threads; ++k) {
      const int64_t s = (t1 - 1 + k) % threads;
      while (take(s, true, begin, end, next)) fn(begin, end, next);
    }
  });
}

// The long kernels (the GEMMs, attention) run without the GIL: the worker's event loop thread
// runs its Python (publishing tokens, taking requests) while the engine thread is in them,
// instead of waiting for the interpreter's switch interval and then stopping the step until
// it is done. They touch no Python object; the guard takes the GIL back before returning.
using NoGil = pybind11::gil_scoped_release;

// The activations' dtype against the pool's: the same, float32 compute beside a float16
// pool, or bf16 or float32 compute beside a float8 (e4m3) pool: half or a quarter of the
// bytes for decode attention to read (EngineConfig.kv_cache_dtype).
bool pool_pairs_with(at::ScalarType act, at::ScalarType pool) {
  return act == pool || (act == at::kFloat && pool == at::kHalf) ||
         ((act == at::kBFloat16 || act == at::kFloat) && pool == at::kFloat8_e4m3fn);
}

// Calls f(act_t{}, pool_t{}) with the C++ types of a pair that pool_pairs_with allows.
template <typename F>
void with_pool_types(at::ScalarType act, at::ScalarType pool, F&& f) {
  if (pool == at::kFloat8_e4m3fn) {
    if (act == at::kBFloat16) {
      f(at::BFloat16{}, at::Float8_e4m3fn{});
    } else {
      f(float{}, at::Float8_e4m3fn{});
    }
    return;
  }
  if (act != pool) {
    f(float{}, at::Half{});
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, act, "kv_pool", [&] { f(scalar_t{}, scalar_t{}); });
}

void check_pool(const at::Tensor& kv_layer) {
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(1) == 2,
              "kv_layer must be [num_blocks, 2, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(kv_layer.stride(4) == 1, "kv_layer's head_dim axis must be contiguous");
}


// The vector layer: one set of float-vector helpers at the widest width the build has, 16
// lanes with AVX-512 and 8 with AVX2 + FMA, so that each kernel's vector loop is written
// once. Without either, TY_VEC is undefined and the kernels run their scalar loops.
#if defined(__AVX512F__)
#define TY_VEC 1
#if defined(__AVX512BF16__)
#define TY_DOT_BF16 1  // vdpbf16ps: bf16 pair products summed into fp32 lanes
#endif
constexpr int kW = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float a) { return _mm512_set1_ps(a); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
// 1 / d from the 14-bit estimate and one Newton step (about 1 ulp): a division of 16 lanes
// issues once in 10-16 cycles, and held silu_and_mul to a third of its speed.
inline vf vrcp(vf d) {
  const vf r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
}
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
inline float vhmax(vf v) { return _mm512_reduce_max_ps(v); }
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vscale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
// Lane t of the result = the sum of a[t]'s lanes, for kW vectors: four rounds of pairwise
// shuffles and adds (46 instructions for 16 sums, against about 8 for each horizontal sum).
// The rounds leave token 4j + k in lane 4k + j; one permute puts lane t back at token t.
inline vf vsum_lanes(const vf* a) {
  vf b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: a[2i]'s halves added, lanes 8-15: a[2i + 1]'s
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit chunk k: token 4i + k, four partial sums
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const vf e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}
// 16 int8 (or uint8) -> float.
inline vf vload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf vload_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
template <typename scalar_t>
inline vf vload(const scalar_t* p);
template <>
inline vf vload<at::BFloat16>(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
template <>
inline vf vload<at::Half>(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 16 float8 e4m3 -> float, by way of fp16: the byte sign-extended and shifted left by 7
// puts the sign in bit 15 and the seven magnitude bits in bits 7-13, an fp16 worth 2^-8
// times the e4m3 number, subnormals included (one stray sign bit, 14, is cleared); F16C
// widens that to fp32 exactly and one multiply scales it back. (Moving the bits into fp32
// directly would need a multiply of fp32 denormals, which the FPU runs in microcode: 4x
// slower on a Xeon.)
// vload_fp8_scaled gives the fp16 step's value, 2^-8 times the number: decode attention
// folds the 256 into its queries and outputs instead (one vector op of six a load).
inline vf vload_fp8_scaled(const at::Float8_e4m3fn* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtph_ps(
      _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7), _mm256_set1_epi16(-16512)));
}
template <>
inline vf vload<at::Float8_e4m3fn>(const at::Float8_e4m3fn* p) {
  return _mm512_mul_ps(vload_fp8_scaled(p), _mm512_set1_ps(256.f));
}
#define TY_VEC_HALF 1
#elif defined(__AVX2__) && defined(__FMA__)
#define TY_VEC 1
constexpr int kW = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float a) { return _mm256_set1_ps(a); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vrcp(vf d) {  // the 12-bit estimate and one Newton step (about 2 ulp)
  const vf r = _mm256_rcp_ps(d);
  return _mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(2.f)));
}
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
// Halves, then pairs, then the last two.
inline float vsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vhmax(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// Lane t of the result = the sum of a[t]'s lanes, for kW vectors (see the AVX-512 version):
// three rounds leave token 2j + k in lane 4k + j; one permute restores the order.
inline vf vsum_lanes(const vf* a) {
  vf b[4], c[2];
  for (int i = 0; i < 4; ++i)
    b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const vf e = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(e, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
// p * 2^n for integral n, built in the exponent bits; n is clamped to the normal range, which
// only the far ends of vexp's clamped input reach.
inline vf vscale2(vf p, vf n) {
  n = _mm256_max_ps(_mm256_min_ps(n, _mm256_set1_ps(127.f)), _mm256_set1_ps(-126.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
// 8 int8 (or uint8) -> float.
inline vf vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf vload_u8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <typename scalar_t>
inline vf vload(const scalar_t* p);
template <>
inline vf vload<at::BFloat16>(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#if defined(__F16C__)
template <>
inline vf vload<at::Half>(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#define TY_VEC_HALF 1
#endif
#if defined(__F16C__)
// 8 float8 e4m3 -> float, as the AVX-512 version.
inline vf vload_fp8_scaled(const at::Float8_e4m3fn* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7), _mm_set1_epi16(-16512)));
}
template <>
inline vf vload<at::Float8_e4m3fn>(const at::Float8_e4m3fn* p) {
  return _mm256_mul_ps(vload_fp8_scaled(p), _mm256_set1_ps(256.f));
}
#endif
#endif

#if defined(TY_VEC)
// The element types the vector loops read and write: float and bf16 always, fp16 and
// float8 e4m3 where the CPU converts fp16 (F16C), never double.
template <typename scalar_t>
constexpr bool kVectorType = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>
#if defined(TY_VEC_HALF)
                             || std::is_same_v<scalar_t, at::Half> || std::is_same_v<scalar_t, at::Float8_e4m3fn>
#endif
    ;

// e^x: Cephes' expf (range reduction by ln 2, degree-6 polynomial), within about 2 ulp of
// std::exp over the range softmax and SiLU use.
inline vf vexp(vf x) {
  x = vmax(vmin(x, vset(88.3762626647949f)), vset(-88.3762626647949f));
  const vf n = vround(vmul(x, vset(1.44269504088896341f)));
  vf r = vfnma(n, vset(0.693359375f), x);
  r = vfnma(n, vset(-2.12194440e-4f), r);
  vf p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(vmul(p, r), r, vadd(r, vset(1.f)));
  return vscale2(p, n);
}

// Stores kW floats as T, rounding to nearest even as c10's conversions do.
template <typename T>
inline void vstore(T* p, vf v) {
  alignas(64) float tmp[kW];
  vstore(tmp, v);
  for (int j = 0; j < kW; ++j) p[j] = static_cast<T>(tmp[j]);
}
#if defined(__AVX512BF16__)
template <>
inline void vstore<at::BFloat16>(at::BFloat16* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
#endif
#if defined(__AVX512F__)
template <>
inline void vstore<at::Half>(at::Half* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif defined(TY_VEC_HALF)
template <>
inline void vstore<at::Half>(at::Half* p, vf v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// kW floats as float8 e4m3, rounded to nearest even and saturated at +-448 (c10's own
// conversion makes NaN of anything past 448; the torch twin clamps first, see
// tokenyard.models.attention). Normal results: fp32's bits rounded to three mantissa bits,
// the exponent rebiased (127 -> 7). Subnormal ones (under 2^-6): added to 2^14, whose ulp
// is e4m3's subnormal step 2^-9, so the FPU rounds and the low bits are the code (8 when
// it rounds up to 2^-6, which is that number's code too).
#if defined(__AVX512F__)
template <>
inline void vstore<at::Float8_e4m3fn>(at::Float8_e4m3fn* p, vf v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  const vf a = _mm512_min_ps(_mm512_abs_ps(v), _mm512_set1_ps(448.f));
  const __m512i ab = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(ab, 20), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(ab, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF), odd));
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32(120 << 3));
  const vf magic = _mm512_set1_ps(16384.f);
  const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(a, magic)), _mm512_castps_si512(magic));
  const __mmask16 tiny = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0x1p-6f), _CMP_LT_OQ);
  const __m512i code = _mm512_or_si512(_mm512_mask_blend_epi32(tiny, normal, sub), sign);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(code));
}
#elif defined(TY_VEC)
template <>
inline void vstore<at::Float8_e4m3fn>(at::Float8_e4m3fn* p, vf v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  const vf a = _mm256_min_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), v), _mm256_set1_ps(448.f));
  const __m256i ab = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(ab, 20), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(ab, _mm256_add_epi32(_mm256_set1_epi32(0x7FFFF), odd));
  const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(rounded, 20), _mm256_set1_epi32(120 << 3));
  const vf magic = _mm256_set1_ps(16384.f);
  const __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(a, magic)), _mm256_castps_si256(magic));
  const vf tiny = _mm256_cmp_ps(a, _mm256_set1_ps(0x1p-6f), _CMP_LT_OQ);
  const __m256i code = _mm256_or_si256(
      _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(normal), _mm256_castsi256_ps(sub), tiny)), sign);
  // The low byte of each lane: bytes 0, 4, 8, 12 of each half, then the halves' first words.
  const __m256i packed = _mm256_shuffle_epi8(
      code, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1,
                             -1, -1, -1, -1, -1, -1, -1, -1));
  const __m256i joined = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(joined));
}
#endif

// v rounded to T's precision and back: where the torch twin would store an intermediate.
template <typename T>
inline vf round_as(vf v) {
  alignas(64) T tmp[kW];
  vstore(tmp, v);
  return vload(tmp);
}
template <>
inline vf round_as<float>(vf v) {
  return v;
}
#endif

// dst[0:n] = float(src[0:n]); vectorized where the vector layer is, for bf16 and fp16 above
// all, which compilers leave scalar.
template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t n) {
  int64_t d = 0;
#if defined(TY_VEC)
  if constexpr (kVectorType<scalar_t>) {
    for (; d + kW <= n; d += kW) vstore(dst + d, vload(src + d));
  }
#endif
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

}  // namespace
