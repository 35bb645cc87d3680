// CPU kernels, built at first use by tokenyard.kernels.cpu (torch's JIT extension loader;
// the object is cached on disk). Each has a torch twin that the tests compare it against.
//
// - write_kv, decode_attention: twins in tokenyard.models.attention. A decode row walks its
//   block table in the pool and never gathers its context into a temporary tensor, which is
//   what made the torch path's decode attention cost a quarter of a 32-sequence step.
// - int8_linear, int4_linear: weight-only GEMMs for steps of a few rows, where decoding is
//   bound by the bytes of weights read (twin: tokenyard.models.quantize.QuantizedLinear).
//   int4 runs here on x86 CPUs with AVX2 or AVX-512: in fp32 without native bf16 (where
//   torch's int4 kernel converts its activations to bf16 in software), with bf16 dot
//   products on AVX512-BF16.
// - linear_i16, linear_i8: int4 and int8 GEMMs in integer arithmetic against int16 (or, for
//   int4, 8-bit) activations: at every row count on AVX2 CPUs without native bf16, for small
//   steps of bf16 layers on AVX512-VNNI (twin: the dequantized weight times the rounded
//   activations, in the tests).
// - linear_amx: the same int4 and int8 weights widened to bf16 tiles for AMX, for bf16 layers
//   on CPUs with AMX (twin: x times the widened weight, in the tests).
// - linear_amx_silu: linear_amx of a gate/up projection with silu_and_mul in its epilogue
//   (twin: silu_and_mul(linear_amx(x)), equal to the bit).
// - add_rms_norm, rotary, silu_and_mul: twins in tokenyard.models.fused. Each replaces five
//   to eight small torch ops per layer; at batch 1 those ops' dispatch cost more than the
//   arithmetic, a third of a decode step on a 30-layer model.
// - decoder_layers: a step through every layer of a Llama model in one call of the kernels
//   above (twin: tokenyard.models.llama's layers, one call at a time).
//
// The pool's per-layer view is [num_blocks, 2, block_size, num_kv_heads, head_dim] with any
// strides but a unit innermost one (the layer is a slice of a block-major pool).

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
// call, linear_i16's one-row tiles compiled to slower code (SmolLM2's 120 layers at one row:
// 3.9 against 3.2 ms).
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

// Rows of k and v (src_t) into the pool (kv_t): a copy, or a conversion where the pool keeps
// keys and values narrower than the activations (an fp16 pool beside fp32 compute).
template <typename src_t, typename kv_t>
inline void copy_row(const src_t* src, kv_t* dst, int64_t n) {
  if constexpr (std::is_same_v<src_t, kv_t>) {
    std::copy_n(src, n, dst);
  } else {
    int64_t d = 0;
#if defined(TY_VEC)
    if constexpr (kVectorType<src_t> && kVectorType<kv_t>) {
      for (; d + kW <= n; d += kW) vstore(dst + d, vload(src + d));
    }
#endif
    for (; d < n; ++d) {
      float x = static_cast<float>(src[d]);
      if constexpr (std::is_same_v<kv_t, at::Float8_e4m3fn>) x = std::clamp(x, -448.f, 448.f);  // as vstore
      dst[d] = static_cast<kv_t>(x);
    }
  }
}

template <typename src_t, typename kv_t>
void write_kv_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_layer,
                   const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  const int64_t rows = k.size(0), row_len = k.size(1) * k.size(2);
  const int64_t s_block = kv_layer.stride(0), s_kv = kv_layer.stride(1), s_tok = kv_layer.stride(2);
  // A row's heads lie side by side; rows may be apart (k and v as views of a fused q/k/v).
  const int64_t k_row = k.stride(0), v_row = v.stride(0);
  const src_t* kp = k.data_ptr<src_t>();
  const src_t* vp = v.data_ptr<src_t>();
  kv_t* pool = kv_layer.data_ptr<kv_t>();
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    kv_t* dst = pool + blocks[r] * s_block + offsets[r] * s_tok;
    copy_row(kp + r * k_row, dst, row_len);
    copy_row(vp + r * v_row, dst + s_kv, row_len);
  }
}

// Where one (sequence, KV head) pair's inputs and outputs live; see decode_attention_impl.
template <typename scalar_t>
struct DecodeItem {
  const float* q;  // [group, head_dim], already multiplied by the softmax scale
  const scalar_t* pool;  // this layer's pool view, offset to KV head h
  const int64_t* table;  // the sequence's block table
  int64_t ctx, group, head_dim, block_size, s_block, s_kv, s_tok;
  float* scores;  // scratch [group, ctx]
  float* out;  // [group, head_dim]
  const scalar_t* q_raw;  // the same rows as q, unscaled, when q has the pool's dtype (the bf16 dot path)
  float scale;
};

// Softmax over each query head's scores, in place.
void softmax_rows(float* scores, int64_t rows, int64_t ctx) {
  for (int64_t i = 0; i < rows; ++i) {
    float* si = scores + i * ctx;
    float mx = -std::numeric_limits<float>::infinity();
    int64_t t = 0;
#if defined(TY_VEC)
    // The maximum in vectors: a scalar max is a chain of dependent instructions (the
    // compiler may not reorder it). 32 sequences of 240 tokens, 30 layers in cache (2-core
    // Zen 4): 9.2 -> 4.4 ms.
    vf vmx_acc = vset(mx);
    for (; t + kW <= ctx; t += kW) vmx_acc = vmax(vmx_acc, vload(si + t));
    mx = vhmax(vmx_acc);
#endif
    for (; t < ctx; ++t) mx = std::max(mx, si[t]);
    float sum = 0.f;
    t = 0;
#if defined(TY_VEC)
    vf acc = vzero();
    const vf vmx = vset(mx);
    for (; t + kW <= ctx; t += kW) {
      const vf e = vexp(vsub(vload(si + t), vmx));
      vstore(si + t, e);
      acc = vadd(acc, e);
    }
    sum = vsum(acc);
#endif
    for (; t < ctx; ++t) {
      si[t] = std::exp(si[t] - mx);
      sum += si[t];
    }
    const float inv = 1.f / sum;
    for (t = 0; t < ctx; ++t) si[t] *= inv;
  }
}

// The portable path: any head_dim, any group size.
template <typename scalar_t>
void attend_item(const DecodeItem<scalar_t>& it, float* row) {
  const scalar_t* block = nullptr;
  for (int64_t t = 0; t < it.ctx; ++t) {  // pass 1: scores = q . k
    if ((t & (it.block_size - 1)) == 0) block = it.pool + it.table[t / it.block_size] * it.s_block;
    to_float(block + (t & (it.block_size - 1)) * it.s_tok, row, it.head_dim);
    for (int64_t i = 0; i < it.group; ++i) {
      const float* qi = it.q + i * it.head_dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < it.head_dim; ++d) s += qi[d] * row[d];
      it.scores[i * it.ctx + t] = s;
    }
  }
  softmax_rows(it.scores, it.group, it.ctx);
  std::fill(it.out, it.out + it.group * it.head_dim, 0.f);
  for (int64_t t = 0; t < it.ctx; ++t) {  // pass 2: out = probs . v
    if ((t & (it.block_size - 1)) == 0) block = it.pool + it.table[t / it.block_size] * it.s_block + it.s_kv;
    to_float(block + (t & (it.block_size - 1)) * it.s_tok, row, it.head_dim);
    for (int64_t i = 0; i < it.group; ++i) {
      const float p = it.scores[i * it.ctx + t];
      float* oi = it.out + i * it.head_dim;
#pragma omp simd
      for (int64_t d = 0; d < it.head_dim; ++d) oi[d] += p * row[d];
    }
  }
}

#if defined(TY_VEC)
constexpr int64_t kMaxGroup = 8;  // query heads per KV head that the vector path holds

// Asks for the next block's rows of this KV head while the current block is being read: the
// rows are strided (the other KV heads lie between them), which hardware prefetchers miss.
// Into L2 (T1), not L1: a block's rows are more lines than L1 can have in flight, and
// with T0 a core read the pool no faster than with no prefetch at all. 32 sequences of 240
// tokens, 30 layers cold (2-core Zen 4): 13 -> 8.4 ms; 8 of 600: 8.3 -> 5.7 ms. Prefetching
// whole token rows (every KV head's part) or two to eight blocks ahead was slower.
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* rows, int64_t n, int64_t stride, int64_t row_bytes) {
  for (int64_t r = 0; r < n; ++r) {
    const char* p = reinterpret_cast<const char*>(rows + r * stride);
    for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
  }
}

#if defined(TY_DOT_BF16)
// attend_item_vec's second pass for a bf16 pool: out = probs . v, two keys an instruction. Each
// pair of value rows (keys t and t + 1) is interleaved so that every 32-bit lane holds one
// dimension's two values, and vdpbf16ps multiplies it by the pair of probabilities, rounded to
// bf16 (as flash attention rounds them before its second matmul), summing in fp32. The fp32
// path took a conversion of each row and an FMA per key and head for every 16 dimensions; this
// takes one instruction per key pair and head for every 16. 32 sequences of 225 tokens, 30
// layers, 2-core Zen 4: 3.2-3.4 against 4.4-4.9 ms with the pool in cache, but 9.6-10.8
// against 10.3-12.0 from memory (a 212 MB pool), where the reads are the limit; a 32-sequence
// decode step 44.1-44.4 against 45.0-45.7 ms (p50). G: the query heads per KV head when known
// at compile time (0: it.group), so that the accumulators stay in registers.
template <int NV, int G>
void attend_values_bf16(const DecodeItem<at::BFloat16>& it) {
  constexpr int NC = NV / 2;  // vectors of 32 bf16 in a row
  const int64_t group = G ? G : it.group;
  const int64_t pairs = (it.ctx + 1) / 2;
  // The probabilities as bf16 pairs (p[t], p[t + 1]), one 32-bit word per pair and head; an
  // odd context's last pair is (p[t], 0).
  thread_local std::vector<uint32_t> pp;
  pp.resize(group * pairs);
  for (int64_t i = 0; i < group; ++i) {
    const float* p = it.scores + i * it.ctx;
    uint32_t* dst = pp.data() + i * pairs;
    int64_t t = 0;
    for (; t + 2 * kW <= it.ctx; t += 2 * kW)
      _mm512_storeu_si512(dst + t / 2, (__m512i)_mm512_cvtne2ps_pbh(vload(p + t + kW), vload(p + t)));
    for (; t < it.ctx; t += 2) {
      const uint16_t lo = c10::BFloat16(p[t]).x;
      const uint16_t hi = t + 1 < it.ctx ? c10::BFloat16(p[t + 1]).x : 0;
      dst[t / 2] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
  }
  const int64_t num_blocks = (it.ctx + it.block_size - 1) / it.block_size;
  const int64_t row_bytes = NV * kW * sizeof(at::BFloat16);
  vf acc[G ? G : kMaxGroup][NV];
  for (int64_t i = 0; i < group; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vzero();
  const at::BFloat16* block = nullptr;
  for (int64_t t = 0; t < it.ctx; t += 2) {  // t even: t and t + 1 lie in one block
    if ((t & (it.block_size - 1)) == 0) {
      const int64_t j = t / it.block_size;
      block = it.pool + it.table[j] * it.s_block + it.s_kv;
      if (j + 1 < num_blocks) prefetch_rows(it.pool + it.table[j + 1] * it.s_block + it.s_kv, it.block_size, it.s_tok, row_bytes);
    }
    const at::BFloat16* r0 = block + (t & (it.block_size - 1)) * it.s_tok;
    const bool two = t + 1 < it.ctx;  // else the row after is not this sequence's (maybe not numbers)
    for (int c = 0; c < NC; ++c) {
      const __m512i a = _mm512_loadu_si512(r0 + 2 * kW * c);
      const __m512i b = two ? _mm512_loadu_si512(r0 + it.s_tok + 2 * kW * c) : _mm512_setzero_si512();
      // Lane k of lo: dimension 8 * (k / 4) + k % 4 of this vector's 32; of hi: that + 4.
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int64_t i = 0; i < group; ++i) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[i * pairs + t / 2]));
        acc[i][2 * c] = _mm512_dpbf16_ps(acc[i][2 * c], lo, p);
        acc[i][2 * c + 1] = _mm512_dpbf16_ps(acc[i][2 * c + 1], hi, p);
      }
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t i = 0; i < group; ++i) {
    for (int c = 0; c < NC; ++c) {
      float* o = it.out + (i * NV + 2 * c) * kW;
      vstore(o, _mm512_permutex2var_ps(acc[i][2 * c], first, acc[i][2 * c + 1]));
      vstore(o + kW, _mm512_permutex2var_ps(acc[i][2 * c], second, acc[i][2 * c + 1]));
    }
  }
}
#endif

#if defined(TY_DOT_BF16)
// A prefill span's attention (span_attention): n query rows over ctx keys, row j at position
// ctx - n + j seeing keys 0 to its own position. The rows path (decode attention, one work
// item per row and KV head) reads every key once per row and scores it with a sum across
// lanes; here each KV head's keys are laid out once per call with one key's pair of
// dimensions in each 32-bit lane (16 keys a vector), so that a tile of rows scores 16 keys per
// vdpbf16ps with no sum across lanes, and its values in pairs of keys for the second product,
// as attend_values_bf16 takes them (the probabilities rounded to bf16, sums in fp32; the sum
// of the exponentials divides the output once). SmolLM2's 30 layers, a fresh prompt, 2-core
// Zen 4: 160 tokens 4.1 against 7.7 ms as rows, 600 tokens 54 against 88.
struct SpanHead {
  const uint32_t* kt;  // [ceil(ctx / 16)][head_dim / 2][16]: key 16b + l's pair dp at [b][dp][l]
  const uint32_t* vp;  // [ceil(ctx / 2)][head_dim]: (v[2t][d], v[2t + 1][d]) at [t][d]
};

// Query rows a work item takes: with the group's heads, R * G score accumulators in registers.
constexpr int span_rows(int g) { return g <= 3 ? 4 : (g <= 6 ? 2 : 1); }

// Rows [r0, r0 + rows) of one KV head's group (G query heads from head h * G), rows <= span_rows(G).
template <int ND, int G>
void span_tile(const at::BFloat16* q, int64_t q_row, const SpanHead& kv, int64_t h, int64_t r0, int64_t rows,
               int64_t pos0, int64_t ctx, float scale, at::BFloat16* out, int64_t o_row) {
  constexpr int R = span_rows(G);
  constexpr int DP = ND * kW / 2;  // pairs of dimensions
  constexpr int64_t D = ND * kW;
  const int64_t keys = std::min(ctx, pos0 + r0 + rows);  // the last row's keys
  const int64_t stride = (keys + 2 * kW - 1) / (2 * kW) * (2 * kW);
  thread_local std::vector<float> scores;
  thread_local std::vector<uint32_t> pp;
  scores.resize(R * G * stride);
  pp.resize(R * G * stride / 2);
  const uint32_t* qp[R][G];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < G; ++i)
      qp[r][i] = reinterpret_cast<const uint32_t*>(q + (r0 + std::min<int64_t>(r, rows - 1)) * q_row + (h * G + i) * D);
  const vf vscale = vset(scale);
  for (int64_t b = 0; b * kW < keys; ++b) {  // scores, 16 keys at a time
    vf acc[R][G];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < G; ++i) acc[r][i] = vzero();
    const uint32_t* kb = kv.kt + b * DP * kW;
    for (int dp = 0; dp < DP; ++dp) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(kb + dp * kW);
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < G; ++i)
          acc[r][i] = _mm512_dpbf16_ps(acc[r][i], k, (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r][i][dp])));
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < G; ++i) vstore(scores.data() + (r * G + i) * stride + b * kW, vmul(acc[r][i], vscale));
  }
  // Softmax over each row's own keys, not yet divided by the sum (the output is, once): the
  // exponentials go straight to bf16 pairs, zeros from the row's last key to the stride.
  float inv[R][G];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = std::min(ctx, pos0 + r0 + r + 1), full = len / kW;
    const __mmask16 tail = static_cast<__mmask16>((1u << (len % kW)) - 1);
    for (int i = 0; i < G; ++i) {
      const float* sc = scores.data() + (r * G + i) * stride;
      vf mx = vset(-std::numeric_limits<float>::infinity());
      for (int64_t b = 0; b < full; ++b) mx = vmax(mx, vload(sc + b * kW));
      if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, sc + full * kW));
      const vf m = vset(vhmax(mx));
      vf sum = vzero();
      uint32_t* dst = pp.data() + (r * G + i) * stride / 2;
      for (int64_t t = 0; t < stride; t += 2 * kW) {
        vf e[2];
        for (int half = 0; half < 2; ++half) {
          const int64_t b = t / kW + half;
          if (b < full) {
            e[half] = vexp(vsub(vload(sc + b * kW), m));
          } else if (b == full && tail) {
            e[half] = _mm512_maskz_mov_ps(tail, vexp(vsub(_mm512_maskz_loadu_ps(tail, sc + b * kW), m)));
          } else {
            e[half] = vzero();
          }
          sum = vadd(sum, e[half]);
        }
        _mm512_storeu_si512(dst + t / 2, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
      }
      inv[r][i] = 1.f / vsum(sum);
    }
  }
  const int64_t pairs = (keys + 1) / 2;
  for (int64_t r = 0; r < rows; ++r) {  // out = probs . v, two keys a vdpbf16ps
    vf acc[G][ND];
    for (int i = 0; i < G; ++i)
      for (int c = 0; c < ND; ++c) acc[i][c] = vzero();
    const uint32_t* pr = pp.data() + r * G * stride / 2;
    for (int64_t t = 0; t < pairs; ++t) {
      __m512bh v[ND];
      for (int c = 0; c < ND; ++c) v[c] = (__m512bh)_mm512_loadu_si512(kv.vp + t * D + c * kW);
      for (int i = 0; i < G; ++i) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pr[i * stride / 2 + t]));
        for (int c = 0; c < ND; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], v[c], p);
      }
    }
    for (int i = 0; i < G; ++i) {
      at::BFloat16* o = out + (r0 + r) * o_row + (h * G + i) * D;
      const vf norm = vset(inv[r][i]);
      for (int c = 0; c < ND; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c * kW), (__m256i)_mm512_cvtneps_pbh(vmul(acc[i][c], norm)));
    }
  }
}

template <int ND, int G>
void span_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& out) {
  constexpr int64_t D = ND * kW;
  const int64_t n = q.size(0), ctx = k.size(0), hkv = k.size(1), pos0 = ctx - n;
  const int64_t kblocks = (ctx + kW - 1) / kW, pairs = (ctx + 1) / 2;
  // Each KV head's keys and values in the layouts above (zeros past the context).
  std::vector<uint32_t> kt(hkv * kblocks * kW * D / 2, 0u), vp(hkv * pairs * D, 0u);
  const auto* kp = k.data_ptr<at::BFloat16>();
  const auto* vptr = v.data_ptr<at::BFloat16>();
  const int64_t k_row = k.stride(0), v_row = v.stride(0);
  at::parallel_for(0, hkv, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      uint32_t* kth = kt.data() + h * kblocks * kW * D / 2;
      uint32_t* vph = vp.data() + h * pairs * D;
      for (int64_t t = 0; t < ctx; ++t) {
        const auto* kr = reinterpret_cast<const uint32_t*>(kp + t * k_row + h * D);
        uint32_t* dst = kth + (t / kW) * (D / 2) * kW + t % kW;
        for (int64_t dp = 0; dp < D / 2; ++dp) dst[dp * kW] = kr[dp];
        const uint16_t* vr = reinterpret_cast<const uint16_t*>(vptr + t * v_row + h * D);
        uint32_t* vd = vph + (t / 2) * D;
        const int shift = (t & 1) * 16;
        for (int64_t d = 0; d < D; ++d) vd[d] |= static_cast<uint32_t>(vr[d]) << shift;
      }
    }
  });
  constexpr int R = span_rows(G);
  const int64_t tiles = (n + R - 1) / R, items = hkv * tiles;
  // Split by cost (a tile's keys), as decode attention splits its rows.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  int64_t total = 0;
  for (int64_t it = 0; it < items; ++it) total += std::min(ctx, pos0 + (it % tiles) * R + R);
  std::vector<int64_t> first(parts + 1, items);
  first[0] = 0;
  for (int64_t it = 0, done = 0, p = 1; it < items && p < parts; ++it) {
    done += std::min(ctx, pos0 + (it % tiles) * R + R);
    while (p < parts && done * parts >= p * total) first[p++] = it + 1;
  }
  const auto* qp = q.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const float fscale = static_cast<float>(scale);
  parallel_items(items, [&](int64_t begin, int64_t end, int64_t) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t h = it / tiles, r0 = (it % tiles) * R;
      const SpanHead kv{kt.data() + h * kblocks * kW * D / 2, vp.data() + h * pairs * D};
      span_tile<ND, G>(qp, q.stride(0), kv, h, r0, std::min<int64_t>(R, n - r0), pos0, ctx, fscale, op, out.stride(0));
    }
  }, first);
}
#endif

// NV = head_dim / kW vectors per row. Pass 1 reads each key row once for all the group's
// query heads; pass 2 keeps every head's output accumulators in vectors (in registers with
// AVX-512 and head_dim 64; partly on the stack, in L1, otherwise).
template <typename scalar_t, int NV>
void attend_item_vec(const DecodeItem<scalar_t>& it) {
  const scalar_t* block = nullptr;
  const int64_t num_blocks = (it.ctx + it.block_size - 1) / it.block_size;
  const int64_t row_bytes = NV * kW * sizeof(scalar_t);
  // Pass 1 takes kW keys at a time where blocks hold whole tiles: each query head's kW
  // partial-sum vectors are reduced together (vsum_lanes), not one horizontal sum per key.
  const bool tiles = it.block_size % kW == 0;
  vf part[kMaxGroup][kW];
#if defined(TY_DOT_BF16)
  // A bf16 pool on a CPU with AVX512-BF16: q . k as bf16 pair products summed in fp32
  // (vdpbf16ps), 32 elements an instruction and no conversion of the keys; the scale is
  // applied to the sums. NV / 2 such vectors per row.
  constexpr bool dot_bf16 = std::is_same_v<scalar_t, at::BFloat16>;
  __m512bh qb[kMaxGroup][NV / 2];
  if constexpr (dot_bf16) {
    for (int64_t i = 0; i < it.group; ++i)
      for (int v = 0; v < NV / 2; ++v)
        qb[i][v] = (__m512bh)_mm512_loadu_si512(it.q_raw + i * NV * kW + 2 * kW * v);
  }
#else
  constexpr bool dot_bf16 = false;
#endif
  // An fp8 pool's rows are read at 2^-8 of their value (vload_fp8_scaled): the scores and
  // the output take the 256 back (a power of two: exact).
  constexpr bool fp8 = std::is_same_v<scalar_t, at::Float8_e4m3fn>;
  constexpr float row_scale = fp8 ? 256.f : 1.f;
  auto row = [](const scalar_t* p) -> vf {
    if constexpr (fp8) {
      return vload_fp8_scaled(p);
    } else {
      return vload(p);
    }
  };
  // The fp32 path's queries carry the scale already (times 1 is exact).
  const float score_scale = dot_bf16 ? it.scale : row_scale;
  const vf vscale = vset(score_scale);
  // q . (the key row at kr), for query head i: a vector whose lanes sum to the score.
  auto dot = [&](const scalar_t* kr, int64_t i, const vf* k) -> vf {
#if defined(TY_DOT_BF16)
    if constexpr (dot_bf16) {
      vf a = _mm512_dpbf16_ps(vzero(), qb[i][0], (__m512bh)_mm512_loadu_si512(kr));
      for (int v = 1; v < NV / 2; ++v)
        a = _mm512_dpbf16_ps(a, qb[i][v], (__m512bh)_mm512_loadu_si512(kr + 2 * kW * v));
      return a;
    }
#endif
    const float* qi = it.q + i * NV * kW;
    vf a = vmul(vload(qi), k[0]);
    for (int v = 1; v < NV; ++v) a = vfma(vload(qi + kW * v), k[v], a);
    return a;
  };
  for (int64_t t = 0; t < it.ctx;) {
    if ((t & (it.block_size - 1)) == 0) {
      const int64_t j = t / it.block_size;
      block = it.pool + it.table[j] * it.s_block;
      if (j + 1 < num_blocks) {
        prefetch_rows(it.pool + it.table[j + 1] * it.s_block, it.block_size, it.s_tok, row_bytes);
      } else {  // the last key block: start on the values
        prefetch_rows(it.pool + it.table[0] * it.s_block + it.s_kv, it.block_size, it.s_tok, row_bytes);
      }
    }
    if (tiles && t + kW <= it.ctx) {  // t is a multiple of kW here: the tile is in one block
      for (int r = 0; r < kW; ++r) {
        const scalar_t* kr = block + ((t + r) & (it.block_size - 1)) * it.s_tok;
        vf k[NV];
        if constexpr (!dot_bf16)
          for (int v = 0; v < NV; ++v) k[v] = row(kr + kW * v);
        for (int64_t i = 0; i < it.group; ++i) part[i][r] = dot(kr, i, k);
      }
      for (int64_t i = 0; i < it.group; ++i) vstore(it.scores + i * it.ctx + t, vmul(vsum_lanes(part[i]), vscale));
      t += kW;
      continue;
    }
    const scalar_t* kr = block + (t & (it.block_size - 1)) * it.s_tok;
    vf k[NV];
    if constexpr (!dot_bf16)
      for (int v = 0; v < NV; ++v) k[v] = row(kr + kW * v);
    for (int64_t i = 0; i < it.group; ++i)
      it.scores[i * it.ctx + t] = vsum(dot(kr, i, k)) * score_scale;
    ++t;
  }
  softmax_rows(it.scores, it.group, it.ctx);
#if defined(TY_DOT_BF16)
  if constexpr (dot_bf16) {
    if (it.group == 3) {  // SmolLM2's 9 query heads over 3 KV heads, as Llama-style models group them
      attend_values_bf16<NV, 3>(it);
    } else {
      attend_values_bf16<NV, 0>(it);
    }
    return;
  }
#endif
  vf acc[kMaxGroup][NV];
  for (int64_t i = 0; i < it.group; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vzero();
  for (int64_t t = 0; t < it.ctx; ++t) {
    if ((t & (it.block_size - 1)) == 0) {
      const int64_t j = t / it.block_size;
      block = it.pool + it.table[j] * it.s_block + it.s_kv;
      if (j + 1 < num_blocks) prefetch_rows(it.pool + it.table[j + 1] * it.s_block + it.s_kv, it.block_size, it.s_tok, row_bytes);
    }
    const scalar_t* vr = block + (t & (it.block_size - 1)) * it.s_tok;
    vf vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = row(vr + kW * v);
    for (int64_t i = 0; i < it.group; ++i) {
      const vf p = vset(it.scores[i * it.ctx + t]);
      for (int v = 0; v < NV; ++v) acc[i][v] = vfma(p, vv[v], acc[i][v]);
    }
  }
  for (int64_t i = 0; i < it.group; ++i) {
    for (int v = 0; v < NV; ++v) {
      if constexpr (fp8) acc[i][v] = vmul(acc[i][v], vset(row_scale));
      vstore(it.out + (i * NV + v) * kW, acc[i][v]);
    }
  }
}
#endif

// q: [B, num_heads, head_dim]; one work item = one (sequence, KV head), whose `group` query
// heads share every K/V row read. The pool is read in place through the block tables.
// q_t: the queries' and output's dtype; scalar_t: the pool's (see pool_pairs_with).
template <typename q_t, typename scalar_t>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = kv_layer.size(2), num_kv_heads = kv_layer.size(3);
  TORCH_CHECK((block_size & (block_size - 1)) == 0, "block_size must be a power of two");
  const int64_t group = num_heads / num_kv_heads;  // query heads [h*group, (h+1)*group) read KV head h
  const q_t* qp = q.data_ptr<q_t>();
  const int64_t q_row = q.stride(0);  // out is contiguous; q's rows may be apart
  const scalar_t* pool = kv_layer.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  q_t* op = out.data_ptr<q_t>();
  const float fscale = static_cast<float>(scale);
#if defined(TY_VEC)
  const bool vector_path = group <= kMaxGroup && (head_dim == 64 || head_dim == 128);
#endif

  // Items start in one contiguous share per thread (parallel_items) by cost (an item's
  // context length), not by count: a prefill chunk's rows (prompt tokens as rows of their
  // own, see tokenyard.models.attention) cost from one key to the whole prompt. Under 512
  // keys in all stay on the calling thread: waking the thread pool costs more than they do.
  const int64_t items = num_seqs * num_kv_heads;
  int64_t total = 0;
  for (int64_t b = 0; b < num_seqs; ++b) total += lens[b] * num_kv_heads;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total / 512));
  std::vector<int64_t> first(parts + 1, items);  // first[p]: part p's first item
  first[0] = 0;
  for (int64_t item = 0, done = 0, p = 1; item < items && p < parts; ++item) {
    done += lens[item / num_kv_heads];
    while (p < parts && done * parts >= p * total) first[p++] = item + 1;
  }
  parallel_items(items, [&](int64_t begin, int64_t end, int64_t) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      scores.resize(group * lens[b]);
      for (int64_t i = 0; i < group; ++i) {
        const q_t* src = qp + b * q_row + (h * group + i) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[i * head_dim + d] = static_cast<float>(src[d]) * fscale;
      }
      DecodeItem<scalar_t> it{qf.data(), pool + h * kv_layer.stride(3), tables + b * block_tables.stride(0),
                                    lens[b], group, head_dim, block_size, kv_layer.stride(0), kv_layer.stride(1),
                                    kv_layer.stride(2), scores.data(), acc.data(), nullptr, fscale};
      if constexpr (std::is_same_v<q_t, scalar_t>) it.q_raw = qp + b * q_row + h * group * head_dim;
#if defined(TY_VEC)
      if constexpr (kVectorType<scalar_t>) {
        if (vector_path && head_dim == 64) {
          attend_item_vec<scalar_t, 64 / kW>(it);
        } else if (vector_path) {
          attend_item_vec<scalar_t, 128 / kW>(it);
        } else {
          attend_item(it, row.data());
        }
      } else {
        attend_item(it, row.data());
      }
#else
      attend_item(it, row.data());
#endif
      for (int64_t i = 0; i < group; ++i) {
        q_t* dst = op + (b * num_heads + h * group + i) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<q_t>(acc[i * head_dim + d]);
      }
    }
  }, first);
}

template <typename scalar_t>
void add_rms_norm_impl(at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                       double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), dim = x.size(1);
  scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* rp = residual ? residual->data_ptr<scalar_t>() : nullptr;
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(dim);
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* xr = xp + r * dim;
      scalar_t* rr = rp ? rp + r * dim : nullptr;
      float ss = 0.f;
      int64_t d = 0;
#if defined(TY_VEC)
      if constexpr (kVectorType<scalar_t>) {
        vf acc = vzero();
        for (; d + kW <= dim; d += kW) {
          vf sum = vload(xr + d);
          if (rr) {
            sum = round_as<scalar_t>(vadd(sum, vload(rr + d)));
            vstore(rr + d, sum);
          }
          vstore(h.data() + d, sum);
          acc = vfma(sum, sum, acc);
        }
        ss = vsum(acc);
      }
#endif
      for (; d < dim; ++d) {
        // The residual sum is rounded to the model's dtype, as the torch twin's x + residual is.
        const scalar_t sum = rr ? static_cast<scalar_t>(static_cast<float>(xr[d]) + static_cast<float>(rr[d])) : xr[d];
        if (rr) rr[d] = sum;
        h[d] = static_cast<float>(sum);
        ss += h[d] * h[d];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + static_cast<float>(eps));
      d = 0;
#if defined(TY_VEC)
      if constexpr (kVectorType<scalar_t>) {
        const vf vinv = vset(inv);
        for (; d + kW <= dim; d += kW) {
          const vf normed = round_as<scalar_t>(vmul(vload(h.data() + d), vinv));
          vstore(op + r * dim + d, vmul(vload(wp + d), normed));
        }
      }
#endif
      for (; d < dim; ++d) {
        const scalar_t normed = static_cast<scalar_t>(h[d] * inv);
        op[r * dim + d] = static_cast<scalar_t>(static_cast<float>(wp[d]) * static_cast<float>(normed));
      }
    }
  });
}

template <typename scalar_t>
void rotary_impl(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                 int64_t num_heads, int64_t head_dim) {
  const int64_t rows = qkv.size(0), row_stride = qkv.stride(0), half = head_dim / 2;
  scalar_t* base = qkv.data_ptr<scalar_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t table_stride = cos.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + pos[r] * table_stride;
      const float* s = sp + pos[r] * table_stride;
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* x = base + r * row_stride + h * head_dim;
        for (int64_t d = 0; d < half; ++d) {
          const float x1 = static_cast<float>(x[d]), x2 = static_cast<float>(x[d + half]);
          x[d] = static_cast<scalar_t>(x1 * c[d] - x2 * s[d]);
          x[d + half] = static_cast<scalar_t>(x2 * c[d + half] + x1 * s[d + half]);
        }
      }
    }
  });
}

template <typename scalar_t>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), width = out.size(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = xp + r * 2 * width;
      const scalar_t* up = gate + width;
      int64_t d = 0;
#if defined(TY_VEC)
      if constexpr (kVectorType<scalar_t>) {
        for (; d + kW <= width; d += kW) {
          const vf g = vload(gate + d);
          const vf act = round_as<scalar_t>(vmul(g, vrcp(vadd(vset(1.f), vexp(vsub(vzero(), g))))));
          vstore(op + r * width + d, vmul(act, vload(up + d)));
        }
      }
#endif
      for (; d < width; ++d) {
        const float g = static_cast<float>(gate[d]);
        // Rounded where the twin's F.silu(gate) * up rounds: after silu, then after the product.
        const scalar_t act = static_cast<scalar_t>(g / (1.f + std::exp(-g)));
        op[r * width + d] = static_cast<scalar_t>(static_cast<float>(act) * static_cast<float>(up[d]));
      }
    }
  });
}

constexpr int64_t kMaxRows = 16;  // the GEMV kernel's row limit: larger steps take the dense path

// The GEMV kernel takes the rows in chunks of at most kChunk, with each row's accumulators
// held in registers (MB is a template argument, so the row loops unroll) and split in two
// so that consecutive FMAs do not wait on each other. A chunk re-reads the weights; steps
// big enough for that to matter take the dense path instead.
constexpr int64_t kChunk = 4;

// out[m, n] = scale[n] * sum_k x[m, k] * q[n, k]; q int8 [N, K], scale fp32 [N].
template <int MB>
void int8_gemv_chunk(const float* x, int64_t K, const int8_t* q, const float* scale, float* out, int64_t N,
                     int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* row = q + n * K;
    float acc[MB] = {};
    int64_t k = 0;
#if defined(TY_VEC)
    // Without the vector loop, the scalar one below took 15.8 ms for SmolLM2's output
    // projection at batch 1 on an AVX2 CPU, against 4.3 ms for torch's int8 kernel.
    vf a0[MB], a1[MB];
    for (int m = 0; m < MB; ++m) a0[m] = a1[m] = vzero();
    for (; k + 2 * kW <= K; k += 2 * kW) {
      const vf w0 = vload_i8(row + k), w1 = vload_i8(row + k + kW);
      for (int m = 0; m < MB; ++m) {
        a0[m] = vfma(w0, vload(x + m * K + k), a0[m]);
        a1[m] = vfma(w1, vload(x + m * K + k + kW), a1[m]);
      }
    }
    for (int m = 0; m < MB; ++m) acc[m] = vsum(vadd(a0[m], a1[m]));
#endif
    for (; k < K; ++k) {
      for (int m = 0; m < MB; ++m) acc[m] += static_cast<float>(row[k]) * x[m * K + k];
    }
    for (int m = 0; m < MB; ++m) out[m * N + n] = acc[m] * scale[n];
  }
}

// fn(std::integral_constant<int, R>{}, m0) for each chunk of R <= kRows rows from row m0:
// the weight-only GEMMs take the chunk's row count as a template argument, so that each
// row's accumulators are unrolled into registers.
template <int R, typename Fn>
void with_rows(int64_t rows, Fn&& fn) {
  if constexpr (R > 1) {
    if (rows < R) return with_rows<R - 1>(rows, fn);
  }
  fn(std::integral_constant<int, R>{});
}

template <int kRows, typename Fn>
void for_row_chunks(int64_t M, Fn&& fn) {
  for (int64_t m0 = 0; m0 < M; m0 += kRows) with_rows<kRows>(std::min<int64_t>(kRows, M - m0), [&](auto r) { fn(r, m0); });
}

// out = x @ (q * scale)^T for every chunk of rows, output rows in parallel.
void int8_gemv(const float* x, int64_t M, int64_t K, const int8_t* q, const float* scale, float* out, int64_t N) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for_row_chunks<kChunk>(M, [&](auto rows, int64_t m0) {
      int8_gemv_chunk<decltype(rows)::value>(x + m0 * K, K, q, scale, out + m0 * N, N, begin, end);
    });
  });
}

// Weight-only int4 in GGUF Q4_1's layout: row n of q holds K / 32 groups of 16 bytes, whose
// low nibbles are the group's weights 0-15 and high nibbles 16-31; w = q * scale + zero, one
// fp32 scale and zero per (row, group). Each group is unpacked and scaled once per chunk of
// up to kChunk4 rows, then multiplied into every row of the chunk: torch's int4 kernel
// unpacks once per four rows (a 2-core AVX2 EPYC: 11 ms for four rows of SmolLM2's 30
// layers, 24 ms for eight, 48 for sixteen).
constexpr int64_t kGroup = 32;
constexpr int64_t kChunk4 = 8;

template <int MB>
void int4_gemm_chunk(const float* x, int64_t K, const uint8_t* q, const float* scale, const float* zero, float* out,
                     int64_t N, int64_t begin, int64_t end) {
  const int64_t G = K / kGroup;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = q + n * (K / 2);
    const float* sr = scale + n * G;
    const float* zr = zero + n * G;
    float acc[MB] = {};
#if defined(TY_VEC)
    vf a[MB];
    for (int m = 0; m < MB; ++m) a[m] = vzero();
    alignas(16) uint8_t nib[kGroup];
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t g = 0; g < G; ++g) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16));
      _mm_store_si128(reinterpret_cast<__m128i*>(nib), _mm_and_si128(b, low));
      _mm_store_si128(reinterpret_cast<__m128i*>(nib + 16), _mm_and_si128(_mm_srli_epi16(b, 4), low));
      const vf s = vset(sr[g]), z = vset(zr[g]);
      for (int v = 0; v < kGroup / kW; ++v) {
        const vf w = vfma(vload_u8(nib + v * kW), s, z);
        for (int m = 0; m < MB; ++m) a[m] = vfma(w, vload(x + m * K + g * kGroup + v * kW), a[m]);
      }
    }
    for (int m = 0; m < MB; ++m) acc[m] = vsum(a[m]);
#else
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t j = 0; j < kGroup; ++j) {
        const uint8_t byte = row[g * 16 + (j & 15)];
        const float w = static_cast<float>(j < 16 ? byte & 15 : byte >> 4) * sr[g] + zr[g];
        for (int m = 0; m < MB; ++m) acc[m] += w * x[m * K + g * kGroup + j];
      }
    }
#endif
    for (int m = 0; m < MB; ++m) out[m * N + n] = acc[m];
  }
}

#if defined(TY_DOT_BF16)
// The same layout with bf16 activations on a CPU with AVX512-BF16. Each group becomes 32 bf16
// weights once per chunk: its 16 values q * scale + zero form a table, and one permute per
// 16 nibbles looks them up (no integer-to-float conversions); each row of the chunk then
// takes one vdpbf16ps per group (32 products summed into fp32 lanes) on its activations as
// they are. The groups alternate between two accumulators per row, so that with one or two
// rows the additions do not all wait on each other; every chunk size does the same (a row's
// sums, in the same order, whatever its neighbours: deterministic mode relies on it).
// SmolLM2's 30 layers on a 2-core AVX512-BF16 EPYC, against torch's int4 kernel: 1 row 4.4
// against 4.7 ms, 8 rows 12.1 against 15.5, 16 rows 17.2 against 22.6.
template <int MB>
void int4_gemm_chunk_bf16(const at::BFloat16* x, int64_t K, const uint8_t* q, const float* scale, const float* zero,
                          float* out, int64_t N, int64_t begin, int64_t end) {
  const int64_t G = K / kGroup;
  const vf iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  constexpr int A = 2;  // accumulator chains per row
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = q + n * (K / 2);
    const float* sr = scale + n * G;
    const float* zr = zero + n * G;
    vf a[A][MB];
    for (int c = 0; c < A; ++c)
      for (int m = 0; m < MB; ++m) a[c][m] = vzero();
    auto group = [&](int64_t g, vf* acc) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16));
      const vf table = vfma(iota, vset(sr[g]), vset(zr[g]));
      const __m512i idx = _mm512_cvtepu8_epi32(b);  // the permute reads each lane's low 4 bits
      const vf lo = _mm512_permutexvar_ps(idx, table);
      const vf hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
      const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);  // weights 0-15, then 16-31
      for (int m = 0; m < MB; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], w, (__m512bh)_mm512_loadu_si512(x + m * K + g * kGroup));
    };
    int64_t g = 0;
    for (; g + A <= G; g += A)
      for (int c = 0; c < A; ++c) group(g + c, a[c]);
    for (; g < G; ++g) group(g, a[0]);
    for (int m = 0; m < MB; ++m) {
      vf t = a[0][m];
      for (int c = 1; c < A; ++c) t = vadd(t, a[c][m]);
      out[m * N + n] = vsum(t);
    }
  }
}

void int4_gemm_bf16(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* q, const float* scale,
                    const float* zero, float* out, int64_t N) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for_row_chunks<kChunk4>(M, [&](auto rows, int64_t m0) {
      int4_gemm_chunk_bf16<decltype(rows)::value>(x + m0 * K, K, q, scale, zero, out + m0 * N, N, begin, end);
    });
  });
}
#endif

void int4_gemm(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* scale, const float* zero,
               float* out, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for_row_chunks<kChunk4>(M, [&](auto rows, int64_t m0) {
      int4_gemm_chunk<decltype(rows)::value>(x + m0 * K, K, q, scale, zero, out + m0 * N, N, begin, end);
    });
  });
}

#if defined(__AVX2__)
// Weight-only int4 or int8 against int16 activations, for CPUs without native bf16, where
// steps of many rows (prefill, big decode batches) ran the fp32 dense matmul and small ones
// the fp32 kernels above. Each row of x is scaled into int16 (one fp32 scale per row: absmax
// / 32767, 15 bits, finer than bf16's 8), and vpmaddwd multiplies a pair of activations into
// eight outputs' pairs of weights: 16 multiply-adds an instruction against 8 for an fp32 FMA,
// at the same rate (two a cycle on Zen 3). Products of a group of 32 inputs sum exactly in
// int32; each group's sum is then scaled in fp32:
//   y[m, n] = xs[m] * sum_g (scale[n, g] * sum_j q[n, g, j] * xi[m, g, j] + zero[n, g] * xsum[m, g] / xs[m])
// with xsum the group's fp32 sum of x (int4: w = q * scale + zero, Q4_1's groups; int8: w = q
// * scale, one scale per output repeated for every group, no zero). A row's result never
// depends on the other rows. The weights are repacked (quantize.pack_i16) as [N / 16, G, 16
// pairs of inputs, B]: word 2i + t of a pair's first operand is q[n0 + i, 2p + t], of its
// second q[n0 + 8 + i, 2p + t]. int8 keeps a byte per weight (B = 32: the two operands' 16
// bytes each, widened with sign); int4 a nibble (B = 16: byte j holds word j of the first
// operand in its low nibble and of the second in its high one), half the bytes to read.
// scale and zero as [N / 16, G, 16] fp32.
constexpr int64_t kOutBlock = 16;  // outputs per block: two vectors of eight int32 lanes
constexpr int64_t kRowTile = 4;    // rows whose accumulators live in registers together
constexpr int64_t kRowPanel = 64;  // rows whose int16 activations stay in L2 while the blocks go by

// tile(rows, m0, b) for every tile of up to RowTile rows from row m0 and every block b of
// kOutBlock outputs: blocks split between threads (parallel_items), rows in panels of kRowPanel
// within each run of blocks.
template <int RowTile = kRowTile, typename Tile>
void for_tiles(int64_t M, int64_t blocks, Tile&& tile) {
  parallel_items(blocks, [&](int64_t begin, int64_t end, int64_t) {
    for (int64_t p0 = 0; p0 < M; p0 += kRowPanel) {
      const int64_t p1 = std::min(M, p0 + kRowPanel);
      for (int64_t b = begin; b < end; ++b)
        for (int64_t m0 = p0; m0 < p1; m0 += RowTile)
          with_rows<RowTile>(std::min<int64_t>(RowTile, p1 - m0), [&](auto rows) { tile(rows, m0, b); });
    }
  });
}

// Bytes of one pair of inputs for 16 outputs: int4 nibbles (Signed false) or int8 bytes.
template <bool Signed>
constexpr int64_t pair_bytes() {
  return Signed ? 32 : 16;
}

// The pair's two vpmaddwd operands (outputs 0-7, 8-15), widened to words.
template <bool Signed>
inline void pair_operands(const uint8_t* p, __m256i& lo, __m256i& hi) {
  if constexpr (Signed) {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  } else {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_and_si256(b, _mm256_set1_epi16(0x0F));
    hi = _mm256_srli_epi16(b, 4);
  }
}

// The four-row tile's inner loop over a group's 16 pairs of inputs (WIDEN: the asm that puts
// the pair's operands in ymm8 and ymm9). Written out because GCC kept some of the intrinsics
// version's 8 accumulators on the stack (a chain through memory every pair); here they stay
// in registers.
#define TY_I16_GROUP(WIDEN, STRIDE)                                                                                \
  for (int p = 0; p < 16; ++p) {                                                                                   \
    asm(WIDEN "vpbroadcastd (%[x0]), %%ymm10\n\t"                                                                   \
              "vpbroadcastd (%[x1]), %%ymm11\n\t"                                                                  \
              "vpbroadcastd (%[x2]), %%ymm12\n\t"                                                                  \
              "vpbroadcastd (%[x3]), %%ymm13\n\t"                                                                  \
              "vpmaddwd %%ymm10, %%ymm8, %%ymm14\n\t"                                                              \
              "vpmaddwd %%ymm10, %%ymm9, %%ymm15\n\t"                                                              \
              "vpaddd %%ymm14, %[a00], %[a00]\n\t"                                                                 \
              "vpaddd %%ymm15, %[a01], %[a01]\n\t"                                                                 \
              "vpmaddwd %%ymm11, %%ymm8, %%ymm14\n\t"                                                              \
              "vpmaddwd %%ymm11, %%ymm9, %%ymm15\n\t"                                                              \
              "vpaddd %%ymm14, %[a10], %[a10]\n\t"                                                                 \
              "vpaddd %%ymm15, %[a11], %[a11]\n\t"                                                                 \
              "vpmaddwd %%ymm12, %%ymm8, %%ymm14\n\t"                                                              \
              "vpmaddwd %%ymm12, %%ymm9, %%ymm15\n\t"                                                              \
              "vpaddd %%ymm14, %[a20], %[a20]\n\t"                                                                 \
              "vpaddd %%ymm15, %[a21], %[a21]\n\t"                                                                 \
              "vpmaddwd %%ymm13, %%ymm8, %%ymm14\n\t"                                                              \
              "vpmaddwd %%ymm13, %%ymm9, %%ymm15\n\t"                                                              \
              "vpaddd %%ymm14, %[a30], %[a30]\n\t"                                                                 \
              "vpaddd %%ymm15, %[a31], %[a31]"                                                                     \
        : [a00] "+x"(a[0][0]), [a01] "+x"(a[0][1]), [a10] "+x"(a[1][0]), [a11] "+x"(a[1][1]), [a20] "+x"(a[2][0]), \
          [a21] "+x"(a[2][1]), [a30] "+x"(a[3][0]), [a31] "+x"(a[3][1])                                            \
        : [w] "r"(wg + p * (STRIDE)), [x0] "r"(xg + 2 * p), [x1] "r"(xg + K + 2 * p),                             \
          [x2] "r"(xg + 2 * K + 2 * p), [x3] "r"(xg + 3 * K + 2 * p), [mask] "m"(low_nibbles)                     \
        : "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory");                         \
  }

template <int MR, bool Signed>
void i16_tile(const int16_t* x, int64_t K, const float* xsum, const float* xs, const uint8_t* w, const float* scale,
              const float* zero, int64_t G, float* out, int64_t N) {
  constexpr int64_t stride = pair_bytes<Signed>();
  alignas(32) static const int16_t low_nibbles[16] = {15, 15, 15, 15, 15, 15, 15, 15,
                                                      15, 15, 15, 15, 15, 15, 15, 15};
  __m256 f[MR][2];
  for (int m = 0; m < MR; ++m) f[m][0] = f[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i a[MR][2];
    for (int m = 0; m < MR; ++m) a[m][0] = a[m][1] = _mm256_setzero_si256();
    const uint8_t* wg = w + g * 16 * stride;
    const int16_t* xg = x + g * kGroup;
    if constexpr (MR == 4) {
      if constexpr (Signed) {
        TY_I16_GROUP("vpmovsxbw (%[w]), %%ymm8\n\tvpmovsxbw 16(%[w]), %%ymm9\n\t", stride)
      } else {
        TY_I16_GROUP("vpmovzxbw (%[w]), %%ymm8\n\tvpsrlw $4, %%ymm8, %%ymm9\n\tvpand %[mask], %%ymm8, %%ymm8\n\t",
                     stride)
      }
    } else {
      for (int p = 0; p < 16; ++p) {
        __m256i lo, hi;
        pair_operands<Signed>(wg + p * stride, lo, hi);
        for (int m = 0; m < MR; ++m) {
          int32_t pair;
          std::memcpy(&pair, xg + m * K + 2 * p, sizeof(pair));
          const __m256i xb = _mm256_set1_epi32(pair);
          a[m][0] = _mm256_add_epi32(a[m][0], _mm256_madd_epi16(lo, xb));
          a[m][1] = _mm256_add_epi32(a[m][1], _mm256_madd_epi16(hi, xb));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = _mm256_loadu_ps(scale + g * kOutBlock + 8 * h);
      for (int m = 0; m < MR; ++m) f[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][h]), s, f[m][h]);
      if (zero != nullptr) {
        const __m256 z = _mm256_loadu_ps(zero + g * kOutBlock + 8 * h);
        for (int m = 0; m < MR; ++m) f[m][h] = _mm256_fmadd_ps(z, _mm256_set1_ps(xsum[m * G + g]), f[m][h]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    const __m256 r = _mm256_set1_ps(xs[m]);
    _mm256_storeu_ps(out + m * N, _mm256_mul_ps(f[m][0], r));
    _mm256_storeu_ps(out + m * N + 8, _mm256_mul_ps(f[m][1], r));
  }
}
#undef TY_I16_GROUP

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TY_VNNI 1
// The same GEMM on AVX512-VNNI (a Zen 4 EPYC, Ice Lake and later Xeons), where the engine
// computes in bf16: vpdpwssd multiplies 16 pairs of int16 and adds them into int32 lanes in one
// instruction, 32 multiply-adds, one a cycle on a 2-core Zen 4, as many as vdpbf16ps. A block
// of 16 outputs is one zmm: a pair's two operands (outputs 0-7, then 8-15) side by side, the
// same packed layout as the AVX2 tile reads, and each row's activation pair is broadcast
// from memory into the instruction. Up to 16 rows share each widened weight vector (8: 16
// rows 11.8-13.1 ms, 24 rows 18.7 for SmolLM2's 30 layers; 16: 11.6 and 16.6).
constexpr int64_t kRowTileVnni = 16;

// A pair of inputs for 16 outputs as 32 words: int32 lane i holds output i's two weights.
template <bool Signed>
inline __m512i pair_vector(const uint8_t* p) {
  if constexpr (Signed) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {  // byte j: word j of the first operand in its low nibble, of the second in its high one
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(b, shift), _mm512_set1_epi16(0x0F));
  }
}

// acc += vpdpwssd(w, the int16 pair at p broadcast to every lane). In asm because GCC copied
// every accumulator to another register and back around the intrinsic (16 moves a pair).
inline void dpwssd_pair(__m512i& acc, __m512i w, const int16_t* p) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
}

template <int MR, bool Signed>
void i16_tile_vnni(const int16_t* x, int64_t K, const float* xsum, const float* xs, const uint8_t* w,
                   const float* scale, const float* zero, int64_t G, float* out, int64_t N) {
  constexpr int64_t stride = pair_bytes<Signed>();
  // Few rows: a second accumulator per row, so that the adds do not wait on each other's
  // latency (integer sums are exact: the order changes nothing).
  constexpr int C = MR <= 4 ? 2 : 1;
  // Above 8 rows the fp32 sums wait in L1 between groups: the int32 ones need the registers.
  constexpr bool kSpill = MR > 8;
  __m512 f[kSpill ? 1 : MR];
  alignas(64) float fm[kSpill ? MR : 1][kOutBlock];
  for (int m = 0; m < MR; ++m) {
    if constexpr (kSpill) _mm512_store_ps(fm[m], _mm512_setzero_ps());
    else f[m] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < G; ++g) {
    __m512i a[C][MR];
    for (int c = 0; c < C; ++c)
      for (int m = 0; m < MR; ++m) a[c][m] = _mm512_setzero_si512();
    const uint8_t* wg = w + g * 16 * stride;
    const int16_t* xg = x + g * kGroup;
    for (int p = 0; p < 16; p += C) {
      for (int c = 0; c < C; ++c) {
        const __m512i wv = pair_vector<Signed>(wg + (p + c) * stride);
        for (int m = 0; m < MR; ++m) dpwssd_pair(a[c][m], wv, xg + m * K + 2 * (p + c));
      }
    }
    const __m512 s = _mm512_loadu_ps(scale + g * kOutBlock);
    const __m512 z = zero != nullptr ? _mm512_loadu_ps(zero + g * kOutBlock) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      __m512i sum = a[0][m];
      if constexpr (C == 2) sum = _mm512_add_epi32(sum, a[1][m]);
      __m512 acc = kSpill ? _mm512_load_ps(fm[m]) : f[kSpill ? 0 : m];
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), s, acc);
      if (zero != nullptr) acc = _mm512_fmadd_ps(z, _mm512_set1_ps(xsum[m * G + g]), acc);
      if constexpr (kSpill) _mm512_store_ps(fm[m], acc);
      else f[m] = acc;
    }
  }
  for (int m = 0; m < MR; ++m) {
    const __m512 acc = kSpill ? _mm512_load_ps(fm[m]) : f[kSpill ? 0 : m];
    _mm512_storeu_ps(out + m * N, _mm512_mul_ps(acc, _mm512_set1_ps(xs[m])));
  }
}
#endif

// kW floats rounded to the nearest int16 (ties to even, as std::nearbyint), saturating.
inline void vstore_i16(int16_t* p, vf v) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(v)));
#else
  const __m256i i = _mm256_cvtps_epi32(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
#endif
}

// x fp32 [M, K] -> xi int16 [M, K], xs [M] (the row's scale), xsum [M, G] (group sums / xs).
// Vectorized: at 512 rows of SmolLM2's layers the scalar loop took a fifth of the GEMM's time.
void quantize_rows_i16(const float* x, int64_t M, int64_t K, int16_t* xi, float* xs, float* xsum) {
  const int64_t G = K / kGroup;
  static_assert(kGroup % kW == 0, "a group is whole vectors");
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
      vf vmx = vzero();
      for (int64_t k = 0; k < K; k += kW) vmx = vmax(vmx, vmax(vload(row + k), vsub(vzero(), vload(row + k))));
      const float amax = vhmax(vmx);
      const float s = amax > 0.f ? amax / 32767.f : 1.f;
      const float inv = 1.f / s;
      const vf vinv = vset(inv);
      xs[m] = s;
      for (int64_t g = 0; g < G; ++g) {
        vf sum = vzero();
        for (int64_t j = 0; j < kGroup; j += kW) {
          const vf v = vload(row + g * kGroup + j);
          sum = vadd(sum, v);
          vstore_i16(xi + m * K + g * kGroup + j, vmul(v, vinv));
        }
        xsum[m * G + g] = vsum(sum) * inv;
      }
    }
  });
}

template <bool Signed>
void gemm_i16(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* scale, const float* zero, float* out,
              int64_t N) {
  const int64_t G = K / kGroup, blocks = N / kOutBlock;
  std::vector<int16_t> xi(M * K);
  std::vector<float> xs(M), xsum(M * G);
  quantize_rows_i16(x, M, K, xi.data(), xs.data(), xsum.data());
#if defined(TY_VNNI)
  for_tiles<kRowTileVnni>(M, blocks, [&](auto rows, int64_t m0, int64_t b) {
    const float* zb = zero == nullptr ? nullptr : zero + b * G * kOutBlock;
    i16_tile_vnni<decltype(rows)::value, Signed>(xi.data() + m0 * K, K, xsum.data() + m0 * G, xs.data() + m0,
                                                 w + b * G * 16 * pair_bytes<Signed>(), scale + b * G * kOutBlock, zb,
                                                 G, out + m0 * N + b * kOutBlock, N);
  });
#else
  for_tiles(M, blocks, [&](auto rows, int64_t m0, int64_t b) {
    const float* zb = zero == nullptr ? nullptr : zero + b * G * kOutBlock;
    i16_tile<decltype(rows)::value, Signed>(xi.data() + m0 * K, K, xsum.data() + m0 * G, xs.data() + m0,
                                            w + b * G * 16 * pair_bytes<Signed>(), scale + b * G * kOutBlock, zb, G,
                                            out + m0 * N + b * kOutBlock, N);
  });
#endif
}

// int4 weights against int8 activations quantized per group of 32 (one fp32 scale per row and
// group: absmax / 127), as llama.cpp pairs Q4_1 weights with Q8_1 activations on x86.
// vpmaddubsw multiplies the weights' unsigned nibbles by the activations' signed bytes, 32
// products an instruction summed in pairs into int16 (at most 2 * 15 * 127 each: a group's
// 8 such sums stay below 2^15); one vpmaddwd by ones per group widens them to int32. About
// half the instructions of the int16 path per multiply-add, at 8 bits of activation.
//   y[m, n] = sum_g (scale[n, g] * xs[m, g] * sum_j q[n, g, j] * xq[m, g, j] + zero[n, g] * xsum[m, g])
// Weights as [N / 16, G, 8 quads of inputs, 64] (quantize.pack_i8): byte 4i + t of quad p's
// first 32 holds q[n0 + i, 4p + t], of its second 32 q[n0 + 8 + i, 4p + t]; a byte per weight.
#define TY_I8_QUAD                                                                                               \
  asm("vmovdqu (%[w]), %%ymm8\n\t"                                                                               \
      "vmovdqu 32(%[w]), %%ymm9\n\t"                                                                             \
      "vpbroadcastd (%[x0]), %%ymm10\n\t"                                                                        \
      "vpbroadcastd (%[x1]), %%ymm11\n\t"                                                                        \
      "vpbroadcastd (%[x2]), %%ymm12\n\t"                                                                        \
      "vpbroadcastd (%[x3]), %%ymm13\n\t"                                                                        \
      "vpmaddubsw %%ymm10, %%ymm8, %%ymm14\n\t"                                                                  \
      "vpmaddubsw %%ymm10, %%ymm9, %%ymm15\n\t"                                                                  \
      "vpaddw %%ymm14, %[a00], %[a00]\n\t"                                                                       \
      "vpaddw %%ymm15, %[a01], %[a01]\n\t"                                                                       \
      "vpmaddubsw %%ymm11, %%ymm8, %%ymm14\n\t"                                                                  \
      "vpmaddubsw %%ymm11, %%ymm9, %%ymm15\n\t"                                                                  \
      "vpaddw %%ymm14, %[a10], %[a10]\n\t"                                                                       \
      "vpaddw %%ymm15, %[a11], %[a11]\n\t"                                                                       \
      "vpmaddubsw %%ymm12, %%ymm8, %%ymm14\n\t"                                                                  \
      "vpmaddubsw %%ymm12, %%ymm9, %%ymm15\n\t"                                                                  \
      "vpaddw %%ymm14, %[a20], %[a20]\n\t"                                                                       \
      "vpaddw %%ymm15, %[a21], %[a21]\n\t"                                                                       \
      "vpmaddubsw %%ymm13, %%ymm8, %%ymm14\n\t"                                                                  \
      "vpmaddubsw %%ymm13, %%ymm9, %%ymm15\n\t"                                                                  \
      "vpaddw %%ymm14, %[a30], %[a30]\n\t"                                                                       \
      "vpaddw %%ymm15, %[a31], %[a31]"                                                                           \
      : [a00] "+x"(a[0][0]), [a01] "+x"(a[0][1]), [a10] "+x"(a[1][0]), [a11] "+x"(a[1][1]), [a20] "+x"(a[2][0]), \
        [a21] "+x"(a[2][1]), [a30] "+x"(a[3][0]), [a31] "+x"(a[3][1])                                            \
      : [w] "r"(wg + p * 64), [x0] "r"(xg + 4 * p), [x1] "r"(xg + K + 4 * p), [x2] "r"(xg + 2 * K + 4 * p),      \
        [x3] "r"(xg + 3 * K + 4 * p)                                                                             \
      : "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory")

template <int MR>
void i8_tile(const int8_t* x, int64_t K, const float* xsc, const float* xsum, const uint8_t* w, const float* scale,
             const float* zero, int64_t G, float* out, int64_t N) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 f[MR][2];
  for (int m = 0; m < MR; ++m) f[m][0] = f[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i a[MR][2];
    for (int m = 0; m < MR; ++m) a[m][0] = a[m][1] = _mm256_setzero_si256();
    const uint8_t* wg = w + g * 512;
    const int8_t* xg = x + g * kGroup;
    if constexpr (MR == 4) {
      for (int p = 0; p < 8; ++p) TY_I8_QUAD;
    } else {
      for (int p = 0; p < 8; ++p) {
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + p * 64));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + p * 64 + 32));
        for (int m = 0; m < MR; ++m) {
          int32_t quad;
          std::memcpy(&quad, xg + m * K + 4 * p, sizeof(quad));
          const __m256i xb = _mm256_set1_epi32(quad);
          a[m][0] = _mm256_add_epi16(a[m][0], _mm256_maddubs_epi16(lo, xb));
          a[m][1] = _mm256_add_epi16(a[m][1], _mm256_maddubs_epi16(hi, xb));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = _mm256_loadu_ps(scale + g * kOutBlock + 8 * h);
      const __m256 z = _mm256_loadu_ps(zero + g * kOutBlock + 8 * h);
      for (int m = 0; m < MR; ++m) {
        const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(a[m][h], ones));
        f[m][h] = _mm256_fmadd_ps(sum, _mm256_mul_ps(s, _mm256_set1_ps(xsc[m * G + g])), f[m][h]);
        f[m][h] = _mm256_fmadd_ps(z, _mm256_set1_ps(xsum[m * G + g]), f[m][h]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(out + m * N, f[m][0]);
    _mm256_storeu_ps(out + m * N + 8, f[m][1]);
  }
}
#undef TY_I8_QUAD

// x fp32 [M, K] -> xq int8 [M, K], xsc [M, G] (each group's scale), xsum [M, G] (fp32 group sums).
void quantize_rows_i8(const float* x, int64_t M, int64_t K, int8_t* xq, float* xsc, float* xsum) {
  const int64_t G = K / kGroup;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t g = 0; g < G; ++g) {
        const float* v = x + m * K + g * kGroup;
        float amax = 0.f, sum = 0.f;
        for (int64_t j = 0; j < kGroup; ++j) {
          amax = std::max(amax, std::fabs(v[j]));
          sum += v[j];
        }
        const float s = amax > 0.f ? amax / 127.f : 1.f;
        const float inv = 1.f / s;
        for (int64_t j = 0; j < kGroup; ++j) xq[m * K + g * kGroup + j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
        xsc[m * G + g] = s;
        xsum[m * G + g] = sum;
      }
    }
  });
}

void gemm_i8(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* scale, const float* zero, float* out,
             int64_t N) {
  const int64_t G = K / kGroup, blocks = N / kOutBlock;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xsc(M * G), xsum(M * G);
  quantize_rows_i8(x, M, K, xq.data(), xsc.data(), xsum.data());
  for_tiles(M, blocks, [&](auto rows, int64_t m0, int64_t b) {
    i8_tile<decltype(rows)::value>(xq.data() + m0 * K, K, xsc.data() + m0 * G, xsum.data() + m0 * G,
                                   w + b * G * 512, scale + b * G * kOutBlock, zero + b * G * kOutBlock, G,
                                   out + m0 * N + b * kOutBlock, N);
  });
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TY_AMX 1
// The int4 and int8 GEMMs on AMX (Sapphire Rapids and later Xeons), where the engine computes
// in bf16 and oneDNN's bf16 matmul runs on the same tiles: its decode steps read two bytes per
// weight, these read half a byte (int4) or one (int8). Weights in linear_i16's layout
// (quantize.pack_i16), since a pair of inputs for 16 outputs is exactly one row of an AMX B
// tile: per block of 16 outputs and group of 32 inputs, each of the 16 pairs becomes 32 bf16
// (int4: q * scale + zero in fp32, rounded once to bf16, as a dense bf16 copy of those
// weights holds them; int8: q itself, exact in bf16, with the output's scale applied to the
// fp32 sums), one 1 KiB tile. The activations are the A tiles as they lie in memory (16 rows
// of 32 bf16), the fp32 sums the C tiles: y[m, n0:n0+16] for 16 rows at a time, two blocks
// of rows a pass sharing each weight tile. A block's weights are widened during the first
// pass and kept (K / 32 KiB) for the passes of later rows, so a prefill step widens each
// weight once however many rows it has.
constexpr int kAmxRows = 16;  // rows of a C tile

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux gives a process the tiles' 8 KiB of state only once it asks (arch_prctl, once per
// process); oneDNN asks too when it first runs an AMX kernel.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// A pass takes up to 32 rows (two blocks of rows, r0 and r1 of them) against one block of 16
// outputs, or two in steps of more than 32 rows (see gemm_amx): tiles 0 and 1 hold the sums
// of the first rows against each block of outputs, 2 and 3 of the second rows; 4 and 5 the
// two blocks of rows' activations; 6 and 7 the two blocks' weights. Each activation tile is
// loaded once for the pass's blocks of outputs and each weight tile once for both blocks of
// rows.
void amx_configure(int r0, int r1) {
  TileConfig cfg;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = static_cast<uint8_t>(r0);
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = static_cast<uint8_t>(r1);
  cfg.rows[6] = cfg.rows[7] = 16;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = cfg.rows[t] > 0 ? 64 : 0;
  _tile_loadconfig(&cfg);
}

// One group of a block's weights as a B tile: 16 rows of 32 bf16.
template <bool Signed>
inline void widen_tile(const uint8_t* w, const float* scale, const float* zero, at::BFloat16* tile) {
  if constexpr (Signed) {
    for (int p = 0; p < 16; ++p) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
      _mm512_storeu_si512(tile + p * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  } else {
    // lane 2i + t of the first half is output i's input t, of the second half output 8 + i's
    const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    const __m512 s = _mm512_loadu_ps(scale), z = _mm512_loadu_ps(zero);
    const __m512 s_lo = _mm512_permutexvar_ps(first, s), s_hi = _mm512_permutexvar_ps(second, s);
    const __m512 z_lo = _mm512_permutexvar_ps(first, z), z_hi = _mm512_permutexvar_ps(second, z);
    const __m512i mask = _mm512_set1_epi32(15);
    for (int p = 0; p < 16; ++p) {
      const __m512i nib = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + p * 16)));
      const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(nib, mask)), s_lo, z_lo);
      const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(nib, 4)), s_hi, z_hi);
      _mm512_storeu_si512(tile + p * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// y[0:rows, 0:16] = a C tile's sums (16 fp32 a row) * scale (int8's per-output scales; none
// for int4).
template <typename out_t>
inline void store_sums(const float* sums, int rows, const float* scale, out_t* y, int64_t N) {
  const __m512 s = scale != nullptr ? _mm512_loadu_ps(scale) : _mm512_set1_ps(1.0f);
  for (int r = 0; r < rows; ++r) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sums + r * 16), s);
    if constexpr (std::is_same_v<out_t, float>) {
      _mm512_storeu_ps(y + r * N, v);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// silu_and_mul's rows from the sums of a block of gate outputs and the block of up outputs
// with the same columns: y[0:rows, 0:16] = silu(gate) * up, each rounded where the GEMM's
// bf16 output and silu_and_mul round them (the gate and up values, silu's result, the
// product), so equal to the bit to silu_and_mul(linear_amx(x)).
inline void store_silu(const float* gate, const float* up, int rows, const float* gate_scale, const float* up_scale,
                       at::BFloat16* y, int64_t N) {
  const vf gs = gate_scale != nullptr ? vload(gate_scale) : vset(1.f);
  const vf us = up_scale != nullptr ? vload(up_scale) : vset(1.f);
  for (int r = 0; r < rows; ++r) {
    const vf g = round_as<at::BFloat16>(vmul(vload(gate + r * 16), gs));
    const vf u = round_as<at::BFloat16>(vmul(vload(up + r * 16), us));
    const vf act = round_as<at::BFloat16>(vmul(g, vrcp(vadd(vset(1.f), vexp(vsub(vzero(), g))))));
    vstore(y + r * N, vmul(act, u));
  }
}

// Silu: the weights are a gate/up projection (gate outputs, then as many up outputs), and y
// gets silu_and_mul's [M, N / 2] instead of the [M, N] sums. Each unit pairs a block of gate
// outputs with the up block of the same columns, so that the epilogue holds both.
template <bool Signed, typename out_t, bool Silu = false>
void gemm_amx(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* w, const float* scale, const float* zero,
              out_t* y, int64_t N) {
  const int64_t G = K / kGroup, blocks = N / kOutBlock, tile_bytes = 16 * pair_bytes<Signed>();
  const int64_t stride = K * static_cast<int64_t>(sizeof(at::BFloat16));
  // Steps of up to 32 rows (decode) take one block of outputs at a time: widening is most of
  // their time, and with two blocks it ran slower (SmolLM2's 30 layers at 8 rows: 8.3-8.8 ms
  // against 6.5-6.9); bigger steps pair the blocks (512 rows: 54-58 ms against 60-74).
  const bool paired = Silu || M > 2 * kAmxRows;
  // A unit's second block: the next one, or (Silu) the up block of the gate block's columns.
  const int64_t partner = Silu ? blocks / 2 : 1, y_width = Silu ? N / 2 : N;
  const int64_t units = Silu ? blocks / 2 : paired ? (blocks + 1) / 2 : blocks;
  // A unit's passes of up to 32 rows, and the group iterations it spreads the next unit's
  // prefetches over: those of its later passes, or of its one pass.
  const int64_t passes = (M + 2 * kAmxRows - 1) / (2 * kAmxRows);
  const int64_t later = (passes > 1 ? passes - 1 : 1) * G;
  parallel_items(units, [&](int64_t begin, int64_t end, int64_t after) {
    // Each thread's widened tiles live from call to call: a fresh vector per call zeroed up to
    // 96 KiB, 120 calls a step.
    thread_local std::vector<at::BFloat16> widened;
    if (widened.size() < static_cast<size_t>((paired ? 2 : 1) * G * 16 * 32)) {
      widened.resize((paired ? 2 : 1) * G * 16 * 32);
    }
    alignas(64) float sums[kAmxRows * 16];
    int configured = -1;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b0 = Silu ? unit : paired ? 2 * unit : unit;
      const int64_t b1 = b0 + partner;
      const bool two = paired && b1 < blocks;  // N / 16 odd: the last block goes alone
      at::BFloat16* wide[2] = {widened.data(), widened.data() + (two ? G * 16 * 32 : 0)};
      auto widen = [&](int64_t b, int t, int64_t g) {
        const float* zb = zero == nullptr ? nullptr : zero + (b * G + g) * kOutBlock;
        widen_tile<Signed>(w + (b * G + g) * tile_bytes, scale + (b * G + g) * kOutBlock, zb,
                           wide[t] + g * 16 * 32);
      };
      // The next unit's weights (its blocks' packed bytes, scales and zeros each lie
      // contiguous) are asked for into L2 a share per group while this unit runs: during
      // its later passes, which read only tiles already widened, or during its one pass in
      // steps of up to 32 rows. The next unit then widens from the cache, not from memory.
      // SmolLM2's 30 layers, int4, in the model: 174 rows 28.0-28.4 ms against 29.5-30.2,
      // 64 rows 12.5-12.8 against 13.5-13.9, 32 rows 12.6-13.1 against 14.0-14.4, 8 rows
      // 8.8-9.3 against 10.3-10.6 (the output projection included). Widening the next
      // unit's tiles ahead instead, during the later passes, was 10-15% faster with the
      // weights in cache and 15-20% slower in the model.
      const int64_t nu = unit + 1 < end ? unit + 1 : after;  // the thread's next unit
      const bool ahead = nu >= 0;
      // (Silu: its gate block here, its up block, `partner` blocks on, through the *_up's.)
      const int64_t nb0 = !ahead ? b0 : Silu ? nu : paired ? 2 * nu : nu;
      const int64_t nblocks = Silu ? 1 : std::min<int64_t>(paired ? 2 : 1, blocks - nb0);
      const char* next_w = reinterpret_cast<const char*>(w + nb0 * G * tile_bytes);
      const char* next_s = reinterpret_cast<const char*>(scale + nb0 * G * kOutBlock);
      const char* next_z = zero == nullptr ? nullptr : reinterpret_cast<const char*>(zero + nb0 * G * kOutBlock);
      const int64_t up_w = partner * G * tile_bytes, up_s = partner * G * kOutBlock * 4;
      const int64_t w_lines = ahead ? nblocks * G * tile_bytes / 64 : 0;
      const int64_t s_lines = ahead ? nblocks * G * kOutBlock * 4 / 64 : 0;
      for (int64_t m0 = 0; m0 < M; m0 += 2 * kAmxRows) {
        const int r0 = static_cast<int>(std::min<int64_t>(kAmxRows, M - m0));
        const int r1 = static_cast<int>(std::clamp<int64_t>(M - m0 - kAmxRows, 0, kAmxRows));
        if (configured != r0 * 32 + r1) {
          amx_configure(r0, r1);
          configured = r0 * 32 + r1;
        }
        _tile_zero(0);
        _tile_zero(1);
        if (r1 > 0) {
          _tile_zero(2);
          _tile_zero(3);
        }
        const at::BFloat16* x0 = x + m0 * K;
        const at::BFloat16* x1 = x0 + kAmxRows * K;
        // The first pass widens each group as it goes; later passes (steps of more than 32
        // rows) reuse the widened tiles.
        for (int64_t g = 0; g < G; ++g) {
          if (m0 == 0) {
            widen(b0, 0, g);
            if (two) widen(b1, 1, g);
          }
          _tile_loadd(6, wide[0] + g * 16 * 32, 64);
          _tile_loadd(4, x0 + g * kGroup, stride);
          _tile_dpbf16ps(0, 4, 6);
          if (two) {
            _tile_loadd(7, wide[1] + g * 16 * 32, 64);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (r1 > 0) {
            _tile_loadd(5, x1 + g * kGroup, stride);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
          }
          if (ahead && (m0 > 0 || passes == 1)) {  // iteration i of `later`: its share of the lines
            const int64_t i = (passes > 1 ? m0 / (2 * kAmxRows) - 1 : 0) * G + g;
            for (int64_t l = i * w_lines / later; l < (i + 1) * w_lines / later; ++l) {
              _mm_prefetch(next_w + l * 64, _MM_HINT_T1);
              if constexpr (Silu) _mm_prefetch(next_w + up_w + l * 64, _MM_HINT_T1);
            }
            for (int64_t l = i * s_lines / later; l < (i + 1) * s_lines / later; ++l) {
              _mm_prefetch(next_s + l * 64, _MM_HINT_T1);
              if (next_z != nullptr) _mm_prefetch(next_z + l * 64, _MM_HINT_T1);
              if constexpr (Silu) {
                _mm_prefetch(next_s + up_s + l * 64, _MM_HINT_T1);
                if (next_z != nullptr) _mm_prefetch(next_z + up_s + l * 64, _MM_HINT_T1);
              }
            }
          }
        }
        if constexpr (Silu) {
          static_assert(std::is_same_v<out_t, at::BFloat16>, "silu_and_mul's output is bf16");
          alignas(64) float up[kAmxRows * 16];
          const float* s_gate = Signed ? scale + b0 * G * kOutBlock : nullptr;
          const float* s_up = Signed ? scale + b1 * G * kOutBlock : nullptr;
          out_t* yb = y + m0 * y_width + b0 * kOutBlock;
          _tile_stored(0, sums, 64);
          _tile_stored(1, up, 64);
          store_silu(sums, up, r0, s_gate, s_up, yb, y_width);
          if (r1 > 0) {
            _tile_stored(2, sums, 64);
            _tile_stored(3, up, 64);
            store_silu(sums, up, r1, s_gate, s_up, yb + kAmxRows * y_width, y_width);
          }
          continue;
        }
        for (int t = 0; t < (two ? 2 : 1); ++t) {
          const float* s_out = Signed ? scale + (b0 + t) * G * kOutBlock : nullptr;
          out_t* yb = y + m0 * N + (b0 + t) * kOutBlock;
          if (t == 0) _tile_stored(0, sums, 64); else _tile_stored(1, sums, 64);
          store_sums(sums, r0, s_out, yb, N);
          if (r1 > 0) {
            if (t == 0) _tile_stored(2, sums, 64); else _tile_stored(3, sums, 64);
            store_sums(sums, r1, s_out, yb + kAmxRows * N, N);
          }
        }
      }
    }
    if (configured >= 0) _tile_release();
  });
}
#endif

#if defined(TY_DOT_BF16) && defined(__AVX512BW__)
#define TY_PAIRS 1
// A bf16 GEMM for the dense copies of bf16 layers on AVX512-BF16 CPUs without AMX (a Zen 4
// EPYC), where oneDNN's bf16 matmul reached 60-140 G multiply-adds a second at decode sizes
// (8 to 32 rows) of the 230 that vdpbf16ps gives two cores. Weights as [N / 16, K / 2, 16, 2]
// (quantize.pack_pairs): per block of 16 outputs and pair of inputs, one zmm whose lane i holds
// output i's two weights, the operand vdpbf16ps multiplies against a row's pair of activations
// broadcast from memory. A tile keeps kPairRows rows by kPairBlocks blocks of fp32 sums in
// registers (24 of the 32 zmm) across the whole of K, reading each weight vector once for
// its rows; while a block's later tiles run from L2, the next block's weights are fetched
// into L2 a line per pair (the first tile reads memory at about the rate the others compute).
// Each row's sums run over K in one order whatever the step holds, so a row's result never
// depends on the other rows. SmolLM2's projection shapes as 210 distinct layers (cold), 2
// threads, against oneDNN's packed bf16 matmul: 8 rows 6.9 against 13.6 ms, 16 rows 9.8
// against 16.6, 32 rows 17.1 against 25.0, 150 rows 71.6 against 81.1, 512 rows 238 against
// 254.
constexpr int kPairRows = 8;
constexpr int kPairBlocks = 3;
constexpr int64_t kPairPanel = 192;  // rows whose activations stay in L2 while the blocks go by

// acc += vdpbf16ps(w, the bf16 pair at p broadcast to every lane). In asm, as dpwssd_pair.
inline void dpbf16_pair(__m512& acc, __m512 w, const at::BFloat16* p) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
}

// y[0:MR, 0:16 NB] = x[0:MR] @ the NB blocks from w (wstride elements apart)^T; pf: the next
// blocks' weights to fetch into L2 (a line per block and pair), or null. Out of line: inlined
// into gemm_pairs, the tiles of 4 to 6 rows ran at half the rate of those of 8.
template <int MR, int NB, typename out_t>
__attribute__((noinline)) void pairs_tile(const at::BFloat16* x, int64_t K, const at::BFloat16* w,
                                          int64_t wstride, out_t* y, int64_t N, const at::BFloat16* pf) {
  __m512 acc[NB][MR];
#pragma GCC unroll 4
  for (int nb = 0; nb < NB; ++nb)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) acc[nb][m] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    __m512 wv[NB];
#pragma GCC unroll 4
    for (int nb = 0; nb < NB; ++nb) {
      if (pf != nullptr) _mm_prefetch(reinterpret_cast<const char*>(pf + nb * wstride + p * 32), _MM_HINT_T1);
      wv[nb] = _mm512_loadu_ps(reinterpret_cast<const float*>(w + nb * wstride + p * 32));
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int nb = 0; nb < NB; ++nb) dpbf16_pair(acc[nb][m], wv[nb], x + m * K + 2 * p);
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int nb = 0; nb < NB; ++nb) {
      if constexpr (std::is_same_v<out_t, float>) {
        _mm512_storeu_ps(y + m * N + nb * kOutBlock, acc[nb][m]);
      } else {
        vstore<out_t>(y + m * N + nb * kOutBlock, acc[nb][m]);
      }
    }
}

// y [M, N] = x [M, K] @ W^T, W in pack_pairs' layout. Threads take runs of kPairBlocks blocks
// (parallel_items hands out ranges of runs); within a panel of rows, each run's tiles split
// the panel's rows evenly (8 rows or fewer a tile: 20 rows are 7 + 7 + 6, not 8 + 8 + 4).
template <typename out_t>
void gemm_pairs(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* w, out_t* y, int64_t N) {
  const int64_t blocks = N / kOutBlock, runs = (blocks + kPairBlocks - 1) / kPairBlocks, wstride = K * kOutBlock;
  parallel_items(runs, [&](int64_t begin, int64_t end, int64_t after) {
    for (int64_t p0 = 0; p0 < M; p0 += kPairPanel) {
      const int64_t rows = std::min(M - p0, kPairPanel), tiles = (rows + kPairRows - 1) / kPairRows;
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = r * kPairBlocks, nb = std::min<int64_t>(kPairBlocks, blocks - b);
        // The next run's weights (the thread's next one: in this range, then the next panel's
        // first, then the range parallel_items hands it next), during the second tile (the
        // first reads this run's from memory), or the only one.
        const int64_t nr = r + 1 < end ? r + 1 : p0 + kPairPanel < M ? begin : after;
        const bool ahead = nr >= 0 && (nr + 1) * kPairBlocks <= blocks;
        const int64_t fetch_tile = tiles > 1 ? 1 : 0;
        int64_t m0 = p0;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t mr = rows / tiles + (t < rows % tiles ? 1 : 0);
          const at::BFloat16* pf = ahead && t == fetch_tile ? w + nr * kPairBlocks * wstride : nullptr;
          with_rows<kPairRows>(mr, [&](auto r_) {
            constexpr int R = decltype(r_)::value;
            const at::BFloat16* wb = w + b * wstride;
            out_t* yb = y + m0 * N + b * kOutBlock;
            if (nb == kPairBlocks) {
              pairs_tile<R, kPairBlocks>(x + m0 * K, K, wb, wstride, yb, N, pf);
            } else if (nb == 2) {
              pairs_tile<R, 2>(x + m0 * K, K, wb, wstride, yb, N, nullptr);
            } else {
              pairs_tile<R, 1>(x + m0 * K, K, wb, wstride, yb, N, nullptr);
            }
          });
          m0 += mr;
        }
      }
    }
  });
}
#endif

#if defined(__AVX2__)
// The integer GEMMs' operands: scale (and zero, where given) fp32 [N / 16, K / 32, 16] as
// qweight's first two dimensions say, x floating point [M, K].
void check_blocked(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                   const c10::optional<at::Tensor>& zero) {
  const int64_t G = qweight.size(1), K = G * kGroup;
  std::vector<const at::Tensor*> params{&scale};
  if (zero) params.push_back(&*zero);
  for (const auto* t : params) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == qweight.size(0) && t->size(1) == G && t->size(2) == kOutBlock,
                "scale and zero must be contiguous fp32 [N / 16, K / 32, 16]");
  }
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "]");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x must be floating point");
}

// pack_i16's layout: int8 q a byte per weight (no zero) or uint8 nibbles (with a zero); scale
// and zero as check_blocked says. Returns whether the weights are int8.
bool check_i16_layout(const at::Tensor& qweight, const c10::optional<at::Tensor>& zero) {
  const bool is_signed = qweight.scalar_type() == at::kChar;
  TORCH_CHECK((is_signed || qweight.scalar_type() == at::kByte) && qweight.dim() == 4 && qweight.is_contiguous() &&
                  qweight.size(2) == 16 && qweight.size(3) == (is_signed ? 32 : 16),
              "qweight must be contiguous int8 [N / 16, K / 32, 16, 32] or uint8 nibbles [N / 16, K / 32, 16, 16]");
  TORCH_CHECK(is_signed != zero.has_value(), "int4 (uint8) weights take a zero, int8 weights none");
  return is_signed;
}
#endif

void check_rows(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "]");
  TORCH_CHECK(x.size(0) <= kMaxRows, "at most ", kMaxRows, " rows per call, got ", x.size(0));
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x must be floating point");
}

}  // namespace

// Weight-only int8: x [M, K] (M <= 16) @ (qweight int8 [N, K] * scale fp32 [N])^T -> [M, N] in x's dtype.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale) {
  NoGil nogil;
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2 && qweight.is_contiguous(),
              "qweight must be contiguous int8 [N, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == qweight.size(0),
              "scale must be fp32 [N]");
  check_rows(x, qweight.size(1));
  const int64_t M = x.size(0), N = qweight.size(0), K = qweight.size(1);
  const auto xf = x.to(at::kFloat).contiguous();  // the inner loops read one format
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
  int8_gemv(xf.data_ptr<float>(), M, K, qweight.data_ptr<int8_t>(), scale.data_ptr<float>(), out.data_ptr<float>(), N);
  return out.to(x.scalar_type());
}

// Weight-only int4: x [M, K] @ W^T -> [M, N] in x's dtype, W dequantized from qweight uint8
// [N, K / 2] (Q4_1 nibbles, see int4_gemm_chunk), scale and zero fp32 [N, K / 32].
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                       const at::Tensor& zero) {
  NoGil nogil;
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "qweight must be contiguous uint8 [N, K / 2]");
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of ", kGroup);
  for (const auto* t : {&scale, &zero}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == K / kGroup,
                "scale and zero must be contiguous fp32 [N, K / 32]");
  }
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "]");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x must be floating point");
  const int64_t M = x.size(0);
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
#if defined(TY_DOT_BF16)
  if (x.scalar_type() == at::kBFloat16) {
    const auto xc = x.contiguous();
    int4_gemm_bf16(xc.data_ptr<at::BFloat16>(), M, K, qweight.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                   zero.data_ptr<float>(), out.data_ptr<float>(), N);
    return out.to(x.scalar_type());
  }
#endif
  const auto xf = x.to(at::kFloat).contiguous();
  int4_gemm(xf.data_ptr<float>(), M, K, qweight.data_ptr<uint8_t>(), scale.data_ptr<float>(), zero.data_ptr<float>(),
            out.data_ptr<float>(), N);
  return out.to(x.scalar_type());
}

// Weight-only int4 (uint8 nibbles, with zero) or int8 (int8 q, no zero) against int16
// activations (see gemm_i16): x [M, K] -> [M, N] in x's dtype, any M; qweight [N / 16, K / 32,
// 16, 16 or 32] as quantize.pack_i16 lays it out, scale and zero fp32 [N / 16, K / 32, 16]. Only
// where the kernels are built with AVX2 (i16_available).
static at::Tensor run_linear_i16(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& zero) {
#if defined(__AVX2__)
  const bool is_signed = check_i16_layout(qweight, zero);
  const int64_t N = qweight.size(0) * kOutBlock, G = qweight.size(1), K = G * kGroup;
  check_blocked(x, qweight, scale, zero);
  const int64_t M = x.size(0);
  const auto xf = x.to(at::kFloat).contiguous();
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const auto* w = static_cast<const uint8_t*>(qweight.data_ptr());
  if (is_signed) {
    gemm_i16<true>(xf.data_ptr<float>(), M, K, w, scale.data_ptr<float>(), nullptr, out.data_ptr<float>(), N);
  } else {
    gemm_i16<false>(xf.data_ptr<float>(), M, K, w, scale.data_ptr<float>(), zero->data_ptr<float>(),
                    out.data_ptr<float>(), N);
  }
  return out.to(x.scalar_type());
#else
  TORCH_CHECK(false, "linear_i16 needs a CPU with AVX2");
#endif
}

at::Tensor linear_i16(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& zero) {
  NoGil nogil;
  return run_linear_i16(x, qweight, scale, zero);
}

// int4 weights (uint8 q in [0, 16), quantize.pack_i8's layout [N / 16, K / 32, 8, 64]) against
// activations quantized to int8 per group of 32 (see gemm_i8); scale, zero fp32 [N / 16, K / 32, 16].
static at::Tensor run_linear_i8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale, const at::Tensor& zero) {
#if defined(__AVX2__)
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 4 && qweight.is_contiguous() &&
                  qweight.size(2) == 8 && qweight.size(3) == 64,
              "qweight must be contiguous uint8 [N / 16, K / 32, 8, 64]");
  const int64_t N = qweight.size(0) * kOutBlock, G = qweight.size(1), K = G * kGroup;
  check_blocked(x, qweight, scale, zero);
  const int64_t M = x.size(0);
  const auto xf = x.to(at::kFloat).contiguous();
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
  gemm_i8(xf.data_ptr<float>(), M, K, qweight.data_ptr<uint8_t>(), scale.data_ptr<float>(), zero.data_ptr<float>(),
          out.data_ptr<float>(), N);
  return out.to(x.scalar_type());
#else
  TORCH_CHECK(false, "linear_i8 needs a CPU with AVX2");
#endif
}

at::Tensor linear_i8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale, const at::Tensor& zero) {
  NoGil nogil;
  return run_linear_i8(x, qweight, scale, zero);
}

// Weight-only int4 (uint8 nibbles, with zero) or int8 (int8 q, no zero) in linear_i16's layout,
// on AMX tiles (see gemm_amx): x bf16 [M, K] -> [M, N] bf16, or fp32 (the sums as they are)
// where fp32_out. Only where the kernels are built with AMX and the kernel lets the process use
// the tiles (amx_available). With silu, the weights are a gate/up projection (N / 2 gate
// outputs, then N / 2 up) and the result is silu_and_mul's [M, N / 2] bf16, equal to the bit
// to silu_and_mul(linear_amx(x)): each unit pairs a gate block with its up block (two blocks
// a unit, as steps of more than 32 rows run anyway) and the [M, N] projection is never
// written out (the measurement is at quantize.SILU_FUSED_ABOVE).
static at::Tensor run_linear_amx(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                                 const c10::optional<at::Tensor>& zero, bool fp32_out, bool silu = false) {
#if defined(TY_AMX)
  TORCH_CHECK(amx_permitted(), "the kernel did not grant this process the AMX tiles");
  const bool is_signed = check_i16_layout(qweight, zero);
  check_blocked(x, qweight, scale, zero);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_amx takes bf16 activations");
  TORCH_CHECK(!silu || (!fp32_out && qweight.size(0) % 2 == 0),
              "linear_amx_silu needs as many up blocks of 16 outputs as gate blocks, and gives bf16");
  const int64_t N = qweight.size(0) * kOutBlock, K = qweight.size(1) * kGroup, M = x.size(0);
  const auto xc = x.contiguous();
  auto out = at::empty({M, silu ? N / 2 : N}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  const auto* xp = xc.data_ptr<at::BFloat16>();
  const auto* w = static_cast<const uint8_t*>(qweight.data_ptr());
  const float* sp = scale.data_ptr<float>();
  const float* zp = zero ? zero->data_ptr<float>() : nullptr;
  auto run = [&](auto* y, auto with_silu) {
    constexpr bool kSilu = decltype(with_silu)::value;
    using out_t = std::remove_pointer_t<decltype(y)>;
    if (is_signed) {
      gemm_amx<true, out_t, kSilu>(xp, M, K, w, sp, zp, y, N);
    } else {
      gemm_amx<false, out_t, kSilu>(xp, M, K, w, sp, zp, y, N);
    }
  };
  if (silu) {
    run(out.data_ptr<at::BFloat16>(), std::true_type{});
  } else if (fp32_out) {
    run(out.data_ptr<float>(), std::false_type{});
  } else {
    run(out.data_ptr<at::BFloat16>(), std::false_type{});
  }
  return out;
#else
  TORCH_CHECK(false, "linear_amx needs a CPU with AMX-BF16 (and kernels built there)");
#endif
}

at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& zero, bool fp32_out) {
  NoGil nogil;
  return run_linear_amx(x, qweight, scale, zero, fp32_out);
}

// linear_amx of a gate/up projection with silu_and_mul in its epilogue (run_linear_amx's silu).
at::Tensor linear_amx_silu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& zero) {
  NoGil nogil;
  return run_linear_amx(x, qweight, scale, zero, false, true);
}

// Whether linear_amx runs here: built with AMX and granted the tiles by the kernel.
bool amx_available() {
#if defined(TY_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

// bf16 weights in quantize.pack_pairs' layout [N / 16, K / 2, 16, 2] (see gemm_pairs): x bf16
// [M, K] -> [M, N] bf16, or fp32 (the sums as they are) where fp32_out. Only where the kernels
// are built with AVX512-BF16 (pairs_available).
static at::Tensor run_linear_bf16(const at::Tensor& x, const at::Tensor& weight, bool fp32_out) {
#if defined(TY_PAIRS)
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 4 && weight.is_contiguous() &&
                  weight.size(2) == kOutBlock && weight.size(3) == 2,
              "weight must be contiguous bf16 [N / 16, K / 2, 16, 2]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_bf16 takes bf16 activations");
  const int64_t N = weight.size(0) * kOutBlock, K = weight.size(1) * 2;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "]");
  const int64_t M = x.size(0);
  const auto xc = x.contiguous();
  auto out = at::empty({M, N}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  const auto* xp = xc.data_ptr<at::BFloat16>();
  const auto* wp = weight.data_ptr<at::BFloat16>();
  if (fp32_out) {
    gemm_pairs(xp, M, K, wp, out.data_ptr<float>(), N);
  } else {
    gemm_pairs(xp, M, K, wp, out.data_ptr<at::BFloat16>(), N);
  }
  return out;
#else
  TORCH_CHECK(false, "linear_bf16 needs a CPU with AVX512-BF16 (and kernels built there)");
#endif
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight, bool fp32_out) {
  NoGil nogil;
  return run_linear_bf16(x, weight, fp32_out);
}

// Whether linear_bf16 is built here.
bool pairs_available() {
#if defined(TY_PAIRS)
  return true;
#else
  return false;
#endif
}

// Whether linear_i16 is built here.
bool i16_available() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

// Whether linear_i16 runs its AVX512-VNNI tile here (vpdpwssd) rather than the AVX2 one.
bool i16_vnni() {
#if defined(TY_VNNI)
  return true;
#else
  return false;
#endif
}

// out = rms_norm(x + residual) * weight, and residual <- x + residual (in place); with no
// residual, out = rms_norm(x) * weight. x, residual: [T, dim] contiguous; weight: [dim].
at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [T, dim]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be [dim] in x's dtype");
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == x.scalar_type(),
                "residual must match x");
  }
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm",
                                  [&] { add_rms_norm_impl<scalar_t>(x, residual, weight, eps, out); });
  return out;
}

// Rotates, in place, the first num_heads heads of each row of qkv ([T, >= num_heads *
// head_dim], unit inner stride): the query and key heads of a fused q/k/v projection.
// cos, sin: fp32 [max_positions, head_dim] tables (rotate-half layout).
void rotary(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
            int64_t num_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= num_heads * head_dim && head_dim % 2 == 0,
              "qkv must be [T, >= num_heads * head_dim] with a unit inner stride");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.size(1) == head_dim &&
                  cos.stride(1) == 1 && sin.strides() == cos.strides() && sin.sizes() == cos.sizes(),
              "cos and sin must be fp32 [max_positions, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == qkv.size(0),
              "positions must be contiguous int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < positions.size(0); ++r) {
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "position ", pos[r], " outside the RoPE table");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary",
                                  [&] { rotary_impl<scalar_t>(qkv, positions, cos, sin, num_heads, head_dim); });
}

// silu(x[:, :I]) * x[:, I:] for x: [T, 2I] contiguous -> [T, I].
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "x must be contiguous [T, 2I]");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul",
                                  [&] { silu_and_mul_impl<scalar_t>(x, out); });
  return out;
}

// [T, heads, head_dim] whose rows each hold their heads side by side, the rows any distance
// apart (a row stride of at least a row): a view of a fused projection's output qualifies.
static bool rows_of_heads(const at::Tensor& t) {
  return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2) &&
         (t.size(0) <= 1 || t.stride(0) >= t.size(1) * t.size(2));
}

// Writes each row's key and value into the pool at (slot_blocks[r], slot_offsets[r]).
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor kv_layer, const at::Tensor& slot_blocks,
              const at::Tensor& slot_offsets) {
  check_pool(kv_layer);
  TORCH_CHECK(rows_of_heads(k) && rows_of_heads(v),
              "k and v must be [T, num_kv_heads, head_dim] with each row's heads contiguous");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && pool_pairs_with(k.scalar_type(), kv_layer.scalar_type()),
              "k and v must share a dtype with the pool, or be float32 beside a float16 pool, or "
              "bf16 or float32 beside a float8_e4m3fn pool");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == kv_layer.size(3) && k.size(2) == kv_layer.size(4),
              "k and v must be [T, num_kv_heads, head_dim] matching the pool");
  TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                  slot_blocks.is_contiguous() && slot_offsets.is_contiguous(),
              "slots must be contiguous int64");
  TORCH_CHECK(slot_blocks.numel() == k.size(0) && slot_offsets.numel() == k.size(0), "one slot per row");
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < k.size(0); ++r) {
    TORCH_CHECK(blocks[r] >= 0 && blocks[r] < kv_layer.size(0) && offsets[r] >= 0 && offsets[r] < kv_layer.size(2),
                "slot outside the pool");
  }
  with_pool_types(k.scalar_type(), kv_layer.scalar_type(), [&](auto act, auto kv) {
    write_kv_impl<decltype(act), decltype(kv)>(k, v, kv_layer, slot_blocks, slot_offsets);
  });
}

// Each row's index of its largest value, the first of equals, as torch's max(dim=-1) gives
// it (a NaN wins, the first one); logits: contiguous float32 [B, V]. One pass per row in
// vectors, rows split between threads: torch's max over 32 x 49,152 logits took 1.0 ms of
// a 28 ms decode step on a 2-core Xeon.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.size(1) > 0,
              "logits must be contiguous float32 [B, V] with V > 0");
  const int64_t rows = logits.size(0), V = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * V;
      int64_t best = 0, i = 0;
      float top = x[0];
      bool nan = false;
#if defined(__AVX512F__)
      if (V >= 16) {
        // Per lane: the largest value so far and the first index holding it (strictly
        // greater replaces, so the first of equals stays); NaNs only noted.
        __m512 vmax = _mm512_loadu_ps(x);
        __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i cur = vidx;
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 unordered = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= V; i += 16) {
          cur = _mm512_add_epi32(cur, step);
          const __m512 v = _mm512_loadu_ps(x + i);
          const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
          unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
          vmax = _mm512_mask_mov_ps(vmax, gt, v);
          vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
        }
        nan = unordered != 0;
        top = _mm512_reduce_max_ps(vmax);
        const __mmask16 at_top = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(top), _CMP_EQ_OQ);
        best = _mm512_mask_reduce_min_epi32(at_top, vidx);
      }
#elif defined(__AVX2__)
      if (V >= 8) {  // as above, 8 lanes
        __m256 vmax = _mm256_loadu_ps(x);
        __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i cur = vidx;
        const __m256i step = _mm256_set1_epi32(8);
        __m256 unordered = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
        for (i = 8; i + 8 <= V; i += 8) {
          cur = _mm256_add_epi32(cur, step);
          const __m256 v = _mm256_loadu_ps(x + i);
          const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
          unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
          vmax = _mm256_blendv_ps(vmax, v, gt);
          vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), gt));
        }
        nan = _mm256_movemask_ps(unordered) != 0;
        alignas(32) float vals[8];
        alignas(32) int32_t idxs[8];
        _mm256_store_ps(vals, vmax);
        _mm256_store_si256(reinterpret_cast<__m256i*>(idxs), vidx);
        top = vals[0];
        best = idxs[0];
        for (int l = 1; l < 8; ++l) {
          if (vals[l] > top || (vals[l] == top && idxs[l] < best)) {
            top = vals[l];
            best = idxs[l];
          }
        }
      }
#endif
      for (; i < V && !nan; ++i) {  // the tail (or all of a row without AVX2)
        if (x[i] > top) {  // later equals never replace: the first of them stays
          top = x[i];
          best = i;
        } else if (std::isnan(x[i])) {
          nan = true;
        }
      }
      if (nan) {  // torch's max propagates the first NaN
        for (int64_t j = 0; j < V; ++j) {
          if (std::isnan(x[j])) {
            best = j;
            break;
          }
        }
      }
      op[r] = best;
    }
  });
  return out;
}

// A prefill span's first n keys and values from the pool, widened to `like`'s dtype: [2, n,
// num_kv_heads, head_dim], for torch's fused attention beside a pool narrower than the
// activations (fp8: torch's own float8 -> bf16 conversion cost 116 us for 128 rows of the
// default model, 34 ms of a 512-token prefill step).
static at::Tensor gather_kv_rows(const at::Tensor& kv_layer, const at::Tensor& block_ids, int64_t n,
                                 const at::Tensor& like) {
  check_pool(kv_layer);
  TORCH_CHECK(pool_pairs_with(like.scalar_type(), kv_layer.scalar_type()),
              "the pool's dtype does not pair with ", like.scalar_type());
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.dim() == 1 && block_ids.is_contiguous(),
              "block_ids must be contiguous int64 [num_blocks]");
  const int64_t block_size = kv_layer.size(2), heads = kv_layer.size(3), head_dim = kv_layer.size(4);
  TORCH_CHECK(n >= 0 && n <= block_ids.numel() * block_size, "n = ", n, " is more than the blocks hold");
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t j = 0; j < (n + block_size - 1) / block_size; ++j)
    TORCH_CHECK(ids[j] >= 0 && ids[j] < kv_layer.size(0), "block id ", ids[j], " outside the pool");
  TORCH_CHECK(kv_layer.stride(3) == head_dim, "kv_layer's heads must lie side by side");
  auto out = at::empty({2, n, heads, head_dim}, like.options());
  with_pool_types(like.scalar_type(), kv_layer.scalar_type(), [&](auto act, auto kv) {
    using act_t = decltype(act);
    using kv_t = decltype(kv);
    const kv_t* pool = kv_layer.data_ptr<kv_t>();
    act_t* dst = out.data_ptr<act_t>();
    const int64_t row_len = heads * head_dim;
    at::parallel_for(0, 2 * n, 256, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t which = r / n, t = r % n;  // keys, then values (n > 0 here)
        const kv_t* src = pool + ids[t / block_size] * kv_layer.stride(0) + which * kv_layer.stride(1) +
                          (t % block_size) * kv_layer.stride(2);
        copy_row(src, dst + r * row_len, row_len);
      }
    });
  });
  return out;
}

at::Tensor gather_kv(const at::Tensor& kv_layer, const at::Tensor& block_ids, int64_t n, const at::Tensor& like) {
  NoGil nogil;
  return gather_kv_rows(kv_layer, block_ids, n, like);
}

// q: [B, num_heads, head_dim], each row's heads contiguous (rows may be apart: q as a view
// of a fused q/k/v); block_tables: [B, max_blocks] int64; context_lens: [B] int64 (>= 1).
// Returns a contiguous [B, num_heads, head_dim] in q's dtype.
static at::Tensor run_decode_attention(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale) {
  check_pool(kv_layer);
  TORCH_CHECK(q.dim() == 3 && rows_of_heads(q), "q must be [B, num_heads, head_dim] with each row's heads contiguous");
  TORCH_CHECK(pool_pairs_with(q.scalar_type(), kv_layer.scalar_type()),
              "q must share the pool's dtype, or be float32 beside a float16 pool, or bf16 or "
              "float32 beside a float8_e4m3fn pool");
  TORCH_CHECK(q.size(2) == kv_layer.size(4) && q.size(1) % kv_layer.size(3) == 0,
              "q's heads do not match the pool's KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables must be int64 [B, max_blocks] with contiguous rows");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.size(0) == q.size(0) && block_tables.size(0) == q.size(0),
              "context_lens must be contiguous int64 [B]");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t capacity = block_tables.size(1) * kv_layer.size(2), num_blocks = kv_layer.size(0);
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= capacity, "context length ", lens[b], " outside [1, ", capacity, "]");
    for (int64_t j = 0; j < (lens[b] + kv_layer.size(2) - 1) / kv_layer.size(2); ++j) {
      const int64_t blk = tables[b * block_tables.stride(0) + j];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id ", blk, " outside the pool");
    }
  }
  auto out = at::empty(q.sizes(), q.options());
  with_pool_types(q.scalar_type(), kv_layer.scalar_type(), [&](auto act, auto kv) {
    decode_attention_impl<decltype(act), decltype(kv)>(q, kv_layer, block_tables, context_lens, scale, out);
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale) {
  NoGil nogil;
  return run_decode_attention(q, kv_layer, block_tables, context_lens, scale);
}

// Whether span_attention is built here: AVX512-BF16 (vdpbf16ps) with 16-lane vectors.
bool span_available() {
#if defined(TY_DOT_BF16)
  return true;
#else
  return false;
#endif
}

// The heads span_attention takes (tokenyard.models.attention.span_fits says the same).
static bool span_fits(int64_t heads, int64_t kv_heads, int64_t head_dim) {
  return (head_dim == 64 || head_dim == 128) && kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= 8;
}

// A prefill span's causal attention, bf16: q [n, heads, head_dim] (rows may be apart), k and v
// [ctx, kv_heads, head_dim] with ctx >= n (the span's rows are the last n positions); head_dim
// 64 or 128, up to 8 query heads per KV head. Returns [n, heads, head_dim].
static at::Tensor run_span_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
#if defined(TY_DOT_BF16)
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "span_attention takes [rows, heads, head_dim] tensors");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "span_attention takes bf16");
  const int64_t d = q.size(2), heads = q.size(1), hkv = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == d && k.size(0) >= q.size(0), "k and v must be [ctx >= rows, kv_heads, head_dim]");
  TORCH_CHECK(hkv > 0 && heads % hkv == 0 && heads / hkv <= 8, "up to 8 query heads per KV head");
  TORCH_CHECK(d == 64 || d == 128, "span_attention takes head_dim 64 or 128");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && k.stride(2) == 1 && k.stride(1) == d && v.stride(2) == 1 &&
                  v.stride(1) == d,
              "each row's heads must lie side by side");
  auto out = at::empty(q.sizes(), q.options());
  if (q.size(0) == 0) return out;
  auto run = [&](auto nd) {
    constexpr int ND = decltype(nd)::value;
    switch (heads / hkv) {
      case 1: span_attention_impl<ND, 1>(q, k, v, scale, out); break;
      case 2: span_attention_impl<ND, 2>(q, k, v, scale, out); break;
      case 3: span_attention_impl<ND, 3>(q, k, v, scale, out); break;
      case 4: span_attention_impl<ND, 4>(q, k, v, scale, out); break;
      case 5: span_attention_impl<ND, 5>(q, k, v, scale, out); break;
      case 6: span_attention_impl<ND, 6>(q, k, v, scale, out); break;
      case 7: span_attention_impl<ND, 7>(q, k, v, scale, out); break;
      default: span_attention_impl<ND, 8>(q, k, v, scale, out); break;
    }
  };
  if (d == 64) {
    run(std::integral_constant<int, 4>{});
  } else {
    run(std::integral_constant<int, 8>{});
  }
  return out;
#else
  TORCH_CHECK(false, "span_attention needs a CPU with AVX512-BF16 (and kernels built there)");
#endif
}

at::Tensor span_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  NoGil nogil;
  return run_span_attention(q, k, v, scale);
}

// A step's pass through a stack of Llama decoder layers, in one call: per layer
// add_rms_norm, the q/k/v projection, rotary, write_kv, the attention (attend_layer), the
// output projection, add_rms_norm, gate/up, silu_and_mul and down, then the final norm; the
// same kernels in the same order as tokenyard.models.llama's layers call them one by one
// (its twin, equal to the bit), without the Python between them. Between one step's 330
// kernel calls the layers' Python cost 5.7 ms of a 32-row decode step of SmolLM2 (31.9 ms)
// on a 2-core Xeon with AMX.
//
// x: [T, hidden], the embedded rows; slots as write_kv takes them; block_tables,
// context_lens, kernel_rows, span_blocks and spans: the step's attention as attend_layer
// takes it. kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim].
// weights: per layer its two norms' weights, then four projections (q/k/v, o, gate/up, down)
// of three tensors each, then the final norm's weight; kinds: per layer the four
// projections' kernels (kKernel*), whose three tensors are the layer's weights as that
// kernel takes them (an unused or absent one: an empty tensor).
constexpr int64_t kKernelAmx = 0, kKernelI16 = 1, kKernelI8 = 2, kKernelPairs = 3;
constexpr int64_t kLayerWeights = 2 + 4 * 3;

static at::Tensor run_projection(int64_t kind, const at::Tensor& x, const at::Tensor* w) {
  const c10::optional<at::Tensor> zero = w[2].numel() ? c10::optional<at::Tensor>(w[2]) : c10::nullopt;
  switch (kind) {
    case kKernelAmx:
      return run_linear_amx(x.to(at::kBFloat16), w[0], w[1], zero, false);
    case kKernelI16:
      return run_linear_i16(x, w[0], w[1], zero);
    case kKernelI8:
      TORCH_CHECK(zero, "linear_i8 takes int4 weights, with zeros");
      return run_linear_i8(x, w[0], w[1], *zero);
    case kKernelPairs:
      return run_linear_bf16(x, w[0], false);
  }
  TORCH_CHECK(false, "unknown projection kernel ", kind);
}

// The MLP's gate/up projection and silu_and_mul: in one pass where the projection runs on AMX
// tiles in a step of more than kSiluFusedAbove rows (run_linear_amx with silu, equal to the bit),
// else one after the other; as tokenyard.models.mlp chooses.
constexpr int64_t kSiluFusedAbove = 32;

static at::Tensor gate_up_silu(int64_t kind, const at::Tensor& x, const at::Tensor* w) {
  if (kind == kKernelAmx && x.size(0) > kSiluFusedAbove) {
    const c10::optional<at::Tensor> zero = w[2].numel() ? c10::optional<at::Tensor>(w[2]) : c10::nullopt;
    return run_linear_amx(x.to(at::kBFloat16), w[0], w[1], zero, false, true);
  }
  return silu_and_mul(run_projection(kind, x, w));
}

// A step's attention for one layer, as tokenyard.models.attention splits it on a CPU
// (AttnMetadata.cpu_split): with no spans, every row through decode_attention; else the rows
// `kernel_rows` through it (none: an empty tensor) and each span (start, rows, context) in
// torch's fused attention (on AMX; span_attention on bf16 elsewhere) over its own rows (a
// fresh prompt) or the keys and values gathered from its blocks, widened where the pool is
// narrower than q (gather_kv).
static at::Tensor attend_layer(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& kv_layer, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, const at::Tensor& kernel_rows,
                               const std::vector<at::Tensor>& span_blocks, const std::vector<int64_t>& spans,
                               double scale) {
  if (span_blocks.empty()) return run_decode_attention(q, kv_layer, block_tables, context_lens, scale);
  auto out = at::empty(q.sizes(), q.options());
  if (kernel_rows.numel()) {
    out.index_put_({kernel_rows}, run_decode_attention(q.index_select(0, kernel_rows), kv_layer, block_tables,
                                                       context_lens, scale));
  }
  for (size_t i = 0; i < span_blocks.size(); ++i) {
    const int64_t start = spans[3 * i], n = spans[3 * i + 1], ctx = spans[3 * i + 2];
    at::Tensor keys, values;
    if (kv_layer.scalar_type() == q.scalar_type()) {
      if (ctx == n) {
        keys = k.narrow(0, start, n);
        values = v.narrow(0, start, n);
      } else {
        const auto kv_shape = std::vector<int64_t>{-1, k.size(1), k.size(2)};
        keys = kv_layer.select(1, 0).index_select(0, span_blocks[i]).view(kv_shape).narrow(0, 0, ctx);
        values = kv_layer.select(1, 1).index_select(0, span_blocks[i]).view(kv_shape).narrow(0, 0, ctx);
      }
    } else {
      const auto kv = gather_kv_rows(kv_layer, span_blocks[i], ctx, q);
      keys = kv[0];
      values = kv[1];
    }
#if defined(TY_DOT_BF16) && !defined(TY_AMX)
    if (q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
        span_fits(q.size(1), keys.size(1), q.size(2))) {  // span_kernel
      out.narrow(0, start, n).copy_(run_span_attention(q.narrow(0, start, n), keys, values, scale));
      continue;
    }
#endif
    c10::optional<at::Tensor> mask;
    if (ctx != n) {  // row j (position ctx - n + j) sees keys 0..its own position
      mask = (at::arange(ctx, block_tables.options()).unsqueeze(0) <=
              at::arange(ctx - n, ctx, block_tables.options()).unsqueeze(1))
                 .unsqueeze(0)
                 .unsqueeze(0);
    }
    const auto o = at::scaled_dot_product_attention(q.narrow(0, start, n).transpose(0, 1).unsqueeze(0),
                                                    keys.transpose(0, 1).unsqueeze(0),
                                                    values.transpose(0, 1).unsqueeze(0), mask, 0.0, ctx == n, scale,
                                                    /*enable_gqa=*/true);
    out.narrow(0, start, n).copy_(o[0].transpose(0, 1));
  }
  return out;
}

at::Tensor decoder_layers(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& slot_blocks,
                          const at::Tensor& slot_offsets, const at::Tensor& block_tables,
                          const at::Tensor& context_lens, const at::Tensor& kernel_rows,
                          const std::vector<at::Tensor>& span_blocks, const std::vector<int64_t>& spans,
                          const std::vector<at::Tensor>& weights, const std::vector<int64_t>& kinds,
                          int64_t num_heads, int64_t num_kv_heads, double scale, double eps) {
  TORCH_CHECK(kv_cache.dim() == 6, "kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]");
  const int64_t layers = kv_cache.size(1), head_dim = kv_cache.size(5), rows = x.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kLayerWeights + 1 &&
                  static_cast<int64_t>(kinds.size()) == layers * 4,
              "weights and kinds must describe every one of the pool's ", layers, " layers");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [T, hidden]");
  TORCH_CHECK(spans.size() == 3 * span_blocks.size(), "spans must hold (start, rows, context) per span's blocks");
  for (size_t i = 0; i < span_blocks.size(); ++i) {
    const int64_t start = spans[3 * i], n = spans[3 * i + 1], ctx = spans[3 * i + 2];
    TORCH_CHECK(start >= 0 && n >= 1 && start + n <= x.size(0) && ctx >= n &&
                    ctx <= span_blocks[i].numel() * kv_cache.size(3) && span_blocks[i].scalar_type() == at::kLong,
                "span ", i, " does not fit the step's rows or its blocks");
  }
  TORCH_CHECK(kernel_rows.scalar_type() == at::kLong && kernel_rows.dim() == 1, "kernel_rows must be int64 [R]");
  NoGil nogil;
  const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  at::Tensor h = x, residual;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kLayerWeights;
    const int64_t* kind = kinds.data() + l * 4;
    at::Tensor normed;
    if (l == 0) {
      normed = add_rms_norm(h, c10::nullopt, w[0], eps);
      residual = h;
    } else {
      normed = add_rms_norm(h, residual, w[0], eps);
    }
    at::Tensor qkv = run_projection(kind[0], normed, w + 2);
    TORCH_CHECK(qkv.size(1) == q_width + 2 * kv_width, "the q/k/v projection's width does not match the heads");
    rotary(qkv, positions, cos, sin, num_heads + num_kv_heads, head_dim);
    const auto q = qkv.narrow(1, 0, q_width).view({rows, num_heads, head_dim});
    const auto k = qkv.narrow(1, q_width, kv_width).view({rows, num_kv_heads, head_dim});
    const auto v = qkv.narrow(1, q_width + kv_width, kv_width).view({rows, num_kv_heads, head_dim});
    const at::Tensor kv_layer = kv_cache.select(1, l);
    write_kv(k, v, kv_layer, slot_blocks, slot_offsets);
    const at::Tensor o =
        attend_layer(q, k, v, kv_layer, block_tables, context_lens, kernel_rows, span_blocks, spans, scale);
    h = run_projection(kind[1], o.view({rows, q_width}), w + 5);
    normed = add_rms_norm(h, residual, w[1], eps);
    h = run_projection(kind[3], gate_up_silu(kind[2], normed, w + 8), w + 11);
  }
  return add_rms_norm(h, residual, weights.back(), eps);
}
