// Native kernels for one decode token on the CPU (positronic_brain/native.py): a layer's
// weight products and everything between them, each a loop over raw rows. Between two
// products that stream megabytes of weights, torch's small operators find their code and
// data evicted from the caches and cost several times their warm time; these loops touch
// little of either, and the products read their weights ahead of use. Two more serve a
// native model's stages 2-3: recall's scan of the cold keys and fold's target search; one
// the sampler: torch.multinomial's draw of one token, the same bits, faster (``draw``).
// Each rounds where the plain path's operators round (bfloat16: every elementwise result;
// a product accumulates in float32 and rounds once); only the order of a sum may differ
// from the plain path's kernels (and AVX512_BF16's pair products flush denormals to zero),
// so results agree to float rounding.
#include <torch/extension.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

using bf16 = uint16_t;

inline float from_bf16(bf16 h) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(h) << 16);
}

inline bf16 to_bf16(float f) {  // round to nearest even, as c10::BFloat16
  if (std::isnan(f)) return 0x7fc0;
  uint32_t u = __builtin_bit_cast(uint32_t, f);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<bf16>(u >> 16);
}

// a value of the model's dtype: float, or bfloat16 held as its bits
template <typename T> inline float load(const T* p, int64_t i);
template <> inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float load<bf16>(const bf16* p, int64_t i) { return from_bf16(p[i]); }
template <> inline float load<int8_t>(const int8_t* p, int64_t i) {  // an int8 weight
  return static_cast<float>(p[i]);
}
template <typename T> inline T store(float f);
template <> inline float store<float>(float f) { return f; }
template <> inline bf16 store<bf16>(float f) { return to_bf16(f); }
// a float rounded to the model's dtype and back: what an operator's output holds
template <typename T> inline float round_to(float f);
template <> inline float round_to<float>(float f) { return f; }
template <> inline float round_to<bf16>(float f) { return from_bf16(to_bf16(f)); }

// exp in float32, within about an ulp of the library's, as plain arithmetic the compiler
// vectorizes (Cephes' expf: exp(r) on |r| <= ln 2 / 2 by a polynomial, times 2^k); 0 below
// the smallest normal result, so exp(-inf) = 0 as a masked score needs
inline float vexp(float x) {
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - k * 0.693359375f;
  r = r + k * 2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const float kc = k < -126.f ? -126.f : (k > 127.f ? 127.f : k);
  const int32_t e = (static_cast<int32_t>(kc) + 127) << 23;
  const float scale = __builtin_bit_cast(float, e);
  const float out = k > 127.f ? y * scale * 2.f : y * scale;  // 2^128 = 2^127 * 2
  return x < -87.3f ? 0.f : (x > 88.7f ? INFINITY : out);
}

template <typename T> T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

void check_row(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

// y = w * round(x * rsqrt(mean(x^2) + eps)), the normalised row rounded to the dtype before
// the weight scales it (Llama's RMSNorm, as torch's fused CPU kernel computes it)
template <typename T>
void rms_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float s = 0.f;
  for (int64_t i = 0; i < n; i++) {
    float v = load<T>(x, i);
    s += v * v;
  }
  float r = 1.f / std::sqrt(s / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; i++)
    out[i] = store<T>(load<T>(w, i) * round_to<T>(load<T>(x, i) * r));
}

template <typename T>
void add_rms(T* x, const T* y, const T* w, T* h, int64_t n, float eps) {
  for (int64_t i = 0; i < n; i++) x[i] = store<T>(load<T>(x, i) + load<T>(y, i));
  rms_row<T>(x, w, h, n, eps);
}

// x += y (the residual, in place), then h = rms_norm(x) * w: the two returned
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor y, torch::Tensor w,
                                        double eps) {
  check_row(x, "x");
  check_row(y, "y");
  check_row(w, "w");
  TORCH_CHECK(x.numel() == y.numel() && x.size(-1) == w.numel(), "shapes do not match");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && w.scalar_type() == x.scalar_type(),
              "dtypes differ");
  auto h = torch::empty_like(x);
  int64_t n = x.size(-1);
  for (int64_t r = 0; r < x.numel() / n; r++) {
    if (x.scalar_type() == at::kFloat)
      add_rms<float>(ptr<float>(x) + r * n, ptr<float>(y) + r * n, ptr<float>(w),
                     ptr<float>(h) + r * n, n, static_cast<float>(eps));
    else
      add_rms<bf16>(ptr<bf16>(x) + r * n, ptr<bf16>(y) + r * n, ptr<bf16>(w),
                    ptr<bf16>(h) + r * n, n, static_cast<float>(eps));
  }
  return {x, h};
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_row(x, "x");
  check_row(w, "w");
  TORCH_CHECK(x.size(-1) == w.numel(), "shapes do not match");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "dtypes differ");
  auto h = torch::empty_like(x);
  int64_t n = x.size(-1);
  for (int64_t r = 0; r < x.numel() / n; r++) {
    if (x.scalar_type() == at::kFloat)
      rms_row<float>(ptr<float>(x) + r * n, ptr<float>(w), ptr<float>(h) + r * n, n,
                     static_cast<float>(eps));
    else
      rms_row<bf16>(ptr<bf16>(x) + r * n, ptr<bf16>(w), ptr<bf16>(h) + r * n, n,
                    static_cast<float>(eps));
  }
  return h;
}

#ifdef __AVX512F__
// 16 values of the dtype as floats
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// ``vexp`` of 16 floats at once, the same arithmetic
inline __m512 vexp16(__m512 x) {
  const __m512 k = _mm512_roundscale_ps(
      _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(k, _mm512_set1_ps(0.693359375f)));
  r = _mm512_add_ps(r, _mm512_mul_ps(k, _mm512_set1_ps(2.12194440e-4f)));
  const __m512 z = _mm512_mul_ps(r, r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(y, z), r), _mm512_set1_ps(1.0f));
  const __m512 kc = _mm512_min_ps(_mm512_max_ps(k, _mm512_set1_ps(-126.f)), _mm512_set1_ps(127.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(kc), _mm512_set1_epi32(127)), 23);
  __m512 out = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  out = _mm512_mask_mul_ps(out, _mm512_cmp_ps_mask(k, _mm512_set1_ps(127.f), _CMP_GT_OQ), out,
                           _mm512_set1_ps(2.f));  // 2^128 = 2^127 * 2
  out = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(88.7f), _CMP_GT_OQ), out,
                             _mm512_set1_ps(INFINITY));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ), out);
}

template <typename T> inline __m512 round16(__m512 x);  // round_to<T> of 16 floats
template <> inline __m512 round16<float>(__m512 x) { return x; }
template <> inline __m512 round16<bf16>(__m512 x) {
  __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  u = _mm512_and_si512(u, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u)));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_castsi512_ps(u),
                              _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}

// 16 floats stored in the dtype (bfloat16: rounded as to_bf16)
inline void store16(float* p, __m512 f) { _mm512_storeu_ps(p, f); }
inline void store16(bf16* p, __m512 f) {
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round16<bf16>(f)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
}
#endif

// silu(gate) * up of a [gate | up] row, each result rounded as its operator's; 16 at a
// time where the CPU has AVX-512 (the same arithmetic: vexp16, an IEEE division, the
// same round to nearest even)
template <typename T>
void silu_mul_row(const T* gu, T* out, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  for (; i + 16 <= n; i += 16) {
    const __m512 g = load16(gu + i);
    const __m512 e = vexp16(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign)));
    const __m512 a = round16<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    store16(out + i, _mm512_mul_ps(a, load16(gu + n + i)));
  }
#endif
  for (; i < n; i++) {
    float g = load<T>(gu, i);
    float a = round_to<T>(g / (1.f + vexp(-g)));
    out[i] = store<T>(a * load<T>(gu, n + i));
  }
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_row(gate_up, "gate_up");
  int64_t n = gate_up.size(-1) / 2;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = n;
  auto out = torch::empty(sizes, gate_up.options());
  const int64_t rows = gate_up.numel() / (2 * n);
  at::parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {  // a batch's rows over the threads
    for (int64_t r = lo; r < hi; r++) {
      if (gate_up.scalar_type() == at::kFloat)
        silu_mul_row<float>(ptr<float>(gate_up) + 2 * r * n, ptr<float>(out) + r * n, n);
      else
        silu_mul_row<bf16>(ptr<bf16>(gate_up) + 2 * r * n, ptr<bf16>(out) + r * n, n);
    }
  });
  return out;
}


// ---- attention for one new token ------------------------------------------------------
// The live slots are taken in chunks of kChunk: each chunk's scores, and its share of each
// head's weighted sum of values, are one work item over the threads, all of a KV head's
// query heads at once (its keys and values are read once, not once per query head). The
// chunks' shares add in chunk order, so the result does not depend on the threads.
constexpr int64_t kChunk = 256;
constexpr int kQueries = 4;  // query heads taken at once (a group of more runs in parts)
constexpr int64_t kKeysAhead = 128;  // each key dimension's slots read this far ahead (<= kChunk)
constexpr int64_t kValuesAhead = 8;  // value rows read this far ahead
static_assert(kKeysAhead <= kChunk, "the keys prefetched lie in this chunk or the next");

#ifdef __AVX512F__
// rows[i][0:64] = qs[i] . k over 64 slots, for Q query heads (``qs`` Q x D floats): each
// key dimension d is a run of slots at kt + d * kt_d; where ``pre`` is given, the 64 slots
// of each of its runs (``pre_d`` apart) are prefetched into L2, the keys read next (64 runs
// at once are more than the hardware follows)
template <int Q, typename T>
inline void scores64(const float* qs, const T* kt, int64_t kt_d, int64_t D, float* const* rows,
                     const T* pre, int64_t pre_d) {
  __m512 a[Q][4];
  for (int i = 0; i < Q; i++) a[i][0] = a[i][1] = a[i][2] = a[i][3] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d++) {
    const T* kd = kt + d * kt_d;
    if (pre != nullptr)
      for (int64_t l = 0; l < 64 * static_cast<int64_t>(sizeof(T)); l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(pre + d * pre_d) + l, _MM_HINT_T1);
    const __m512 k0 = load16(kd), k1 = load16(kd + 16), k2 = load16(kd + 32), k3 = load16(kd + 48);
    for (int i = 0; i < Q; i++) {
      const __m512 c = _mm512_set1_ps(qs[i * D + d]);
      a[i][0] = _mm512_fmadd_ps(c, k0, a[i][0]);
      a[i][1] = _mm512_fmadd_ps(c, k1, a[i][1]);
      a[i][2] = _mm512_fmadd_ps(c, k2, a[i][2]);
      a[i][3] = _mm512_fmadd_ps(c, k3, a[i][3]);
    }
  }
  for (int i = 0; i < Q; i++)
    for (int m = 0; m < 4; m++) _mm512_storeu_ps(rows[i] + 16 * m, a[i][m]);
}

// acc[i][0:64] = the sum over slots j in [j0, j1) of round(rows[i][j]) * v_j[0:64], for Q
// query heads: the values' rows (``v_j`` apart, from ``v``) are read once for all Q, each
// prefetched kValuesAhead rows before
template <int Q, typename T>
inline void weighted64(const float* const* rows, const T* v, int64_t v_j, int64_t j0,
                       int64_t j1, float* acc, int64_t acc_i) {
  __m512 a[Q][4];
  for (int i = 0; i < Q; i++) a[i][0] = a[i][1] = a[i][2] = a[i][3] = _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; j++) {
    const T* vj = v + j * v_j;
    if (j + kValuesAhead < j1)
      for (int64_t l = 0; l < 64 * static_cast<int64_t>(sizeof(T)); l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(vj + kValuesAhead * v_j) + l, _MM_HINT_T0);
    const __m512 x0 = load16(vj), x1 = load16(vj + 16), x2 = load16(vj + 32), x3 = load16(vj + 48);
    for (int i = 0; i < Q; i++) {
      const __m512 c = _mm512_set1_ps(round_to<T>(rows[i][j]));
      a[i][0] = _mm512_fmadd_ps(c, x0, a[i][0]);
      a[i][1] = _mm512_fmadd_ps(c, x1, a[i][1]);
      a[i][2] = _mm512_fmadd_ps(c, x2, a[i][2]);
      a[i][3] = _mm512_fmadd_ps(c, x3, a[i][3]);
    }
  }
  for (int i = 0; i < Q; i++)
    for (int m = 0; m < 4; m++) _mm512_storeu_ps(acc + i * acc_i + 16 * m, a[i][m]);
}
#endif

// Q query heads' scores over the slots [j0, j1) of one KV head (rows[i] indexed by slot),
// each 64 slots' keys prefetching those kKeysAhead slots on: past j1, in the keys the thread
// reads next, ``after`` (its runs ``after_d`` apart, ``after_n`` slots), where given
template <int Q, typename T>
void chunk_scores(const float* qs, const T* kt, int64_t kt_d, int64_t D, int64_t j0,
                  int64_t j1, float* const* rows, const T* after = nullptr,
                  int64_t after_d = 0, int64_t after_n = 0) {
  int64_t j = j0;
#ifdef __AVX512F__
  for (; j + 64 <= j1; j += 64) {
    float* at[Q];
    for (int i = 0; i < Q; i++) at[i] = rows[i] + j;
    // past the chunk's whole blocks, the next item's blocks in order
    const int64_t t = j + kKeysAhead, o = t - (j0 + (j1 - j0) / 64 * 64);
    if (t + 64 <= j1)
      scores64<Q, T>(qs, kt + j, kt_d, D, at, kt + t, kt_d);
    else
      scores64<Q, T>(qs, kt + j, kt_d, D, at,
                     after != nullptr && o >= 0 && o + 64 <= after_n ? after + o : nullptr,
                     after_d);
  }
#else
  (void)after;
  (void)after_d;
  (void)after_n;
#endif
  for (int i = 0; i < Q; i++)
    for (int64_t s = j; s < j1; s++) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; d++) acc += qs[i * D + d] * load<T>(kt + d * kt_d, s);
      rows[i][s] = acc;
    }
}

// Q query heads' weighted values over the slots [j0, j1): acc[i * D + d]
template <int Q, typename T>
void chunk_values(const float* const* rows, const T* v, int64_t v_j, int64_t D, int64_t j0,
                  int64_t j1, float* acc) {
  int64_t d0 = 0;
#ifdef __AVX512F__
  for (; d0 + 64 <= D; d0 += 64) weighted64<Q, T>(rows, v + d0, v_j, j0, j1, acc + d0, D);
#endif
  for (int i = 0; i < Q; i++)
    for (int64_t d = d0; d < D; d++) {
      float s = 0.f;
      for (int64_t j = j0; j < j1; j++) s += round_to<T>(rows[i][j]) * load<T>(v + j * v_j, d);
      acc[i * D + d] = s;
    }
}

// ``f<Q>(first)`` over a group's query heads, kQueries at a time
template <typename F>
inline void in_parts(int64_t g, F f) {
  for (int64_t i0 = 0; i0 < g; i0 += kQueries) {
    const int64_t q = std::min<int64_t>(kQueries, g - i0);
    if (q == 4) f(std::integral_constant<int, 4>(), i0);
    else if (q == 3) f(std::integral_constant<int, 3>(), i0);
    else if (q == 2) f(std::integral_constant<int, 2>(), i0);
    else f(std::integral_constant<int, 1>(), i0);
  }
}


// the softmax of ``row`` (n) in place, in float32; returns its log-sum-exp. Its maximum
// and sum run in 16 lanes, combined in a fixed order
inline float softmax(float* __restrict__ row, int64_t n) {
  constexpr int64_t W = 16;
  const int64_t body = n - n % W;
  float lane[W];
  for (int64_t l = 0; l < W; l++) lane[l] = row[0];
  for (int64_t j = 0; j < body; j += W)
    for (int64_t l = 0; l < W; l++) lane[l] = row[j + l] > lane[l] ? row[j + l] : lane[l];
  float m = row[0];
  for (int64_t l = 0; l < W; l++) m = lane[l] > m ? lane[l] : m;
  for (int64_t j = body; j < n; j++) m = row[j] > m ? row[j] : m;
  for (int64_t l = 0; l < W; l++) lane[l] = 0.f;
  int64_t j0 = 0;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; j0 < body; j0 += W) {
    const __m512 e = vexp16(_mm512_sub_ps(_mm512_loadu_ps(row + j0), _mm512_set1_ps(m)));
    _mm512_storeu_ps(row + j0, e);
    acc = _mm512_add_ps(acc, e);
  }
  _mm512_storeu_ps(lane, acc);
#endif
  for (; j0 < body; j0 += W)
    for (int64_t l = 0; l < W; l++) {
      row[j0 + l] = vexp(row[j0 + l] - m);
      lane[l] += row[j0 + l];
    }
  float sum = 0.f;
  for (int64_t l = 0; l < W; l++) sum += lane[l];
  for (int64_t j = body; j < n; j++) {
    row[j] = vexp(row[j] - m);
    sum += row[j];
  }
  const float inv = 1.f / sum;
  for (int64_t j = 0; j < n; j++) row[j] *= inv;
  return m + std::log(sum);
}


// One new token's attention in one layer, for each of B rows: where a row's inputs and
// outputs lie. ``qkv`` ((H + 2 KVH) D): its q, k, v heads; ``cos``/``sin`` its (H + KVH) x D
// tables (``cs_r`` apart), sin signed and q's rows scaled, so that the roped heads are
// qk * cos + roll(qk, D/2) * sin; ``kt`` (KVH, D, n) the live keys transposed, ``vv``
// (KVH, n, D) the live values (strided views of the arena); ``lm`` (KVH, n) float32 or
// null. Writes the softmax rows into ``p`` (H, n + 1) (a head's row: the live slots, then
// the new token), the attention output into ``out`` (H D), the roped q/k heads into ``qk``
// (H + KVH, D) and, where ``lse`` is not null, each head's log-sum-exp.
template <typename T>
struct AttnRow {
  const T *qkv, *cos, *sin, *kt, *vv;
  const float* lm;
  int64_t n, kt_h, kt_d, v_h, v_j, lm_h;
  T *out, *qk;
  float *p, *lse;
  int64_t chunks = 1;  // of its slots (below)
  std::vector<float> qf, part;  // q as floats; each chunk's share of the weighted values
  std::vector<float*> row;      // each query head's softmax row
};

// The rows' attention, each phase one work list over the threads for all the rows (a row's
// KV heads' chunks, its query heads), so B rows cost one pass, not B. A row's every result
// is what it gets alone: the same items, each summed in the same order.
template <typename T>
void attend_kernel(std::vector<AttnRow<T>>& rs, int64_t H, int64_t KVH, int64_t D, int64_t cs_r) {
  const int64_t g = H / KVH, half = D / 2, B = static_cast<int64_t>(rs.size());
  std::vector<int64_t> first(B + 1, 0);  // row b's chunk items: [first[b], first[b + 1])
  for (int64_t b = 0; b < B; b++) {
    AttnRow<T>& a = rs[b];
    a.chunks = std::max<int64_t>(1, (a.n + kChunk - 1) / kChunk);
    first[b + 1] = first[b] + KVH * a.chunks;
  }
  struct Item { int64_t b, h, j0, j1; };  // a work item's row, KV head and slots [j0, j1)
  const auto where = [&](int64_t item) {
    const int64_t b = static_cast<int64_t>(
        std::upper_bound(first.begin(), first.end(), item) - first.begin()) - 1;
    const int64_t local = item - first[b], j0 = local % rs[b].chunks * kChunk;
    return Item{b, local / rs[b].chunks, j0, std::min(rs[b].n, j0 + kChunk)};
  };
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; b++) {  // RoPE: three rounded results, as three operators
      AttnRow<T>& a = rs[b];
      for (int64_t r = 0; r < H + KVH; r++) {
        const T* x = a.qkv + r * D;
        for (int64_t d = 0; d < D; d++) {
          float c = round_to<T>(load<T>(x, d) * load<T>(a.cos, r * cs_r + d));
          float s = round_to<T>(load<T>(x, (d + half) % D) * load<T>(a.sin, r * cs_r + d));
          a.qk[r * D + d] = store<T>(c + s);
        }
      }
      a.qf.resize(H * D);
      a.part.resize(a.chunks * H * D);
      a.row.resize(H);
      for (int64_t i = 0; i < H * D; i++) a.qf[i] = load<T>(a.qk, i);
      for (int64_t hq = 0; hq < H; hq++) a.row[hq] = a.p + hq * (a.n + 1);
    }
  });
  // each chunk of a KV head's slots: its query heads' scores, as the product rounds them
  at::parallel_for(0, first[B], 1, [&](int64_t lo, int64_t hi) {
    for (int64_t item = lo; item < hi; item++) {
      const Item it = where(item);
      const int64_t h = it.h, j0 = it.j0, j1 = it.j1;
      AttnRow<T>& a = rs[it.b];
      const T* after = nullptr;  // the keys this thread reads next: its next item's
      int64_t after_d = 0, after_n = 0;
      if (item + 1 < hi) {
        const Item next = where(item + 1);
        const AttnRow<T>& na = rs[next.b];
        after_n = next.j1 - next.j0;
        after = after_n > 0 ? na.kt + next.h * na.kt_h + next.j0 : nullptr;
        after_d = na.kt_d;
      }
      in_parts(g, [&](auto q, int64_t i0) {
        chunk_scores<decltype(q)::value, T>(a.qf.data() + (h * g + i0) * D, a.kt + h * a.kt_h,
                                            a.kt_d, D, j0, j1, a.row.data() + h * g + i0,
                                            after, after_d, after_n);
      });
      for (int64_t hq = h * g; hq < (h + 1) * g; hq++) {
        float* __restrict__ r = a.row[hq];
#pragma omp simd
        for (int64_t j = j0; j < j1; j++) r[j] = round_to<T>(r[j]);  // the product's output
        if (a.lm != nullptr) {  // a folded slot's log-mass adds after
          const float* __restrict__ l = a.lm + h * a.lm_h;
#pragma omp simd
          for (int64_t j = j0; j < j1; j++) r[j] += l[j];
        }
      }
    }
  });
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {  // the new token's score, softmax
    for (int64_t i = lo; i < hi; i++) {
      AttnRow<T>& a = rs[i / H];
      const int64_t hq = i % H, n = a.n;
      const T* knew = a.qk + H * D;
      float s_new = 0.f;
      for (int64_t d = 0; d < D; d++) s_new += a.qf[hq * D + d] * load<T>(knew, hq / g * D + d);
      a.row[hq][n] = round_to<T>(s_new);
      const float l = softmax(a.row[hq], n + 1);
      if (a.lse != nullptr) a.lse[hq] = l;
    }
  });
  at::parallel_for(0, first[B], 1, [&](int64_t lo, int64_t hi) {  // each chunk's values
    for (int64_t item = lo; item < hi; item++) {
      const Item it = where(item);
      const int64_t h = it.h, j0 = it.j0, j1 = it.j1;
      AttnRow<T>& a = rs[it.b];
      if (a.n == 0) continue;
      in_parts(g, [&](auto q, int64_t i0) {
        chunk_values<decltype(q)::value, T>(a.row.data() + h * g + i0, a.vv + h * a.v_h, a.v_j,
                                            D, j0, j1,
                                            a.part.data() + (j0 / kChunk * H + h * g + i0) * D);
      });
    }
  });
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {  // the chunks' shares in order
    for (int64_t b = lo; b < hi; b++) {
      AttnRow<T>& a = rs[b];
      const T* vnew = a.qkv + (H + KVH) * D;
      for (int64_t hq = 0; hq < H; hq++) {
        const int64_t h = hq / g;
        const float wn = round_to<T>(a.row[hq][a.n]);
        for (int64_t d = 0; d < D; d++) {
          float acc = 0.f;
          for (int64_t c = 0; c < (a.n > 0 ? a.chunks : 0); c++) acc += a.part[(c * H + hq) * D + d];
          const float nv = round_to<T>(wn * load<T>(vnew, h * D + d));
          a.out[hq * D + d] = store<T>(round_to<T>(acc) + nv);
        }
      }
    }
  });
}

// B rows' attention in one layer: ``qkv`` (B, (H + 2 KVH) D); ``cos``/``sin``
// (H + KVH, B, D); per row ``kts[b]`` (KVH, D, n_b), ``vs[b]`` (KVH, n_b, D),
// ``masses[b]`` (KVH, n_b) float32 or empty, ``ps[b]`` (H, n_b + 1) float32. Returns the
// outputs (B, H D), the roped q/k heads (B, H + KVH, 1, D) and, with ``want_lse``, each
// head's log-sum-exp (B, H) float32.
std::vector<torch::Tensor> attend_rows(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                       std::vector<torch::Tensor> kts,
                                       std::vector<torch::Tensor> vs,
                                       std::vector<torch::Tensor> masses,
                                       std::vector<torch::Tensor> ps, int64_t H, int64_t KVH,
                                       bool want_lse) {
  check_row(qkv, "qkv");
  const int64_t B = static_cast<int64_t>(kts.size()), D = cos.size(-1);
  TORCH_CHECK(B >= 1 && vs.size() == kts.size() && masses.size() == kts.size() &&
              ps.size() == kts.size(), "kts, vs, masses and ps must name the same rows");
  TORCH_CHECK(qkv.numel() == B * (H + 2 * KVH) * D, "qkv does not match the rows and heads");
  TORCH_CHECK(cos.is_cpu() && sin.is_cpu(), "cos/sin must be CPU tensors");
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) == H + KVH && cos.size(1) == B &&
              cos.stride(2) == 1 && cos.strides() == sin.strides() && cos.sizes() == sin.sizes(),
              "cos/sin must be (H + KVH, B, D) alike, each row's D contiguous");
  const auto dt = qkv.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dt && sin.scalar_type() == dt, "dtypes differ");
  auto out = torch::empty({B, H * D}, qkv.options());
  auto qk = torch::empty({B, H + KVH, 1, D}, qkv.options());
  auto lse = want_lse ? torch::empty({B, H}, qkv.options().dtype(at::kFloat))
                      : torch::empty({0}, qkv.options().dtype(at::kFloat));
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    std::vector<AttnRow<T>> rs(B);
    for (int64_t b = 0; b < B; b++) {
      const auto &kt = kts[b], &v = vs[b], &m = masses[b], &p = ps[b];
      const int64_t n = kt.size(2);
      TORCH_CHECK(kt.is_cpu() && v.is_cpu() && p.is_cpu() && m.is_cpu(),
                  "a row's keys, values, softmax rows and log-masses must be CPU tensors");
      TORCH_CHECK(kt.dim() == 3 && kt.size(0) == KVH && kt.size(1) == D && kt.stride(2) == 1,
                  "kt must be (KVH, D, n) with its slots contiguous");
      TORCH_CHECK(v.dim() == 3 && v.size(0) == KVH && v.size(1) == n && v.size(2) == D &&
                  v.stride(2) == 1, "v must be (KVH, n, D) with its rows contiguous");
      TORCH_CHECK(kt.scalar_type() == dt && v.scalar_type() == dt, "dtypes differ");
      TORCH_CHECK(p.is_contiguous() && p.scalar_type() == at::kFloat && p.dim() == 2 &&
                  p.size(0) == H && p.size(1) == n + 1, "p must be (H, n + 1) float32, contiguous");
      const bool mass = m.numel() > 0;
      TORCH_CHECK(!mass || (m.scalar_type() == at::kFloat && m.dim() == 2 && m.size(0) == KVH &&
                            m.size(1) == n && m.stride(1) == 1),
                  "log_mass must be (KVH, n) float32");
      AttnRow<T>& a = rs[b];
      a.qkv = ptr<T>(qkv) + b * (H + 2 * KVH) * D;
      a.cos = ptr<T>(cos) + b * cos.stride(1);
      a.sin = ptr<T>(sin) + b * sin.stride(1);
      a.kt = ptr<T>(kt);
      a.vv = ptr<T>(v);
      a.lm = mass ? m.data_ptr<float>() : nullptr;
      a.n = n;
      a.kt_h = kt.stride(0);
      a.kt_d = kt.stride(1);
      a.v_h = v.stride(0);
      a.v_j = v.stride(1);
      a.lm_h = mass ? m.stride(0) : 0;
      a.out = ptr<T>(out) + b * H * D;
      a.qk = ptr<T>(qk) + b * (H + KVH) * D;
      a.p = p.data_ptr<float>();
      a.lse = want_lse ? lse.data_ptr<float>() + b * H : nullptr;
    }
    attend_kernel<T>(rs, H, KVH, D, cos.stride(0));
  };
  if (dt == at::kFloat) run(0.f);
  else run(bf16{});
  return {out, qk, lse};
}

// ---- fold's targets ---------------------------------------------------------------------
// For each culled slot (``culls``, m) and each layer and KV head: the live slot whose key is
// most like its key, the highest round(k_c . k_s) / max(|k_s|, 1e-12) over the slots not
// culled (ties: the lowest slot), or -1 where that over max(|k_c|, 1e-12) is below
// ``min_cos``: stages/decide.py's fold_targets, the products summed in another order. Each
// layer and KV head is one work item: its live keys read once for all the culled ones.
template <typename T>
void fold_kernel(const T* kt, int64_t L, int64_t KVH, int64_t D, int64_t n, int64_t kt_l,
                 int64_t kt_h, int64_t kt_d, const float* knorm, int64_t kn_l, int64_t kn_h,
                 const int64_t* culls, int64_t m, float min_cos, int64_t* into) {
  std::vector<char> culled(n, 0);
  for (int64_t i = 0; i < m; i++) culled[culls[i]] = 1;
  at::parallel_for(0, L * KVH, 1, [&](int64_t b, int64_t e) {
    std::vector<float> qf(m * D), dots(m * n);
    std::vector<float*> rows(m);
    for (int64_t i = 0; i < m; i++) rows[i] = dots.data() + i * n;
    for (int64_t lh = b; lh < e; lh++) {
      const T* k = kt + lh / KVH * kt_l + lh % KVH * kt_h;
      const float* norm = knorm + lh / KVH * kn_l + lh % KVH * kn_h;
      for (int64_t i = 0; i < m; i++)
        for (int64_t d = 0; d < D; d++) qf[i * D + d] = load<T>(k + d * kt_d, culls[i]);
      in_parts(m, [&](auto q, int64_t i0) {
        chunk_scores<decltype(q)::value, T>(qf.data() + i0 * D, k, kt_d, D, 0, n,
                                            rows.data() + i0);
      });
      for (int64_t i = 0; i < m; i++) {
        float best = -INFINITY;
        int64_t at = -1;
        for (int64_t s = 0; s < n; s++) {
          if (culled[s]) continue;  // never into a slot that goes too
          const float sim = round_to<T>(rows[i][s]) / std::max(norm[s], 1e-12f);
          if (sim > best) {
            best = sim;
            at = s;
          }
        }
        const bool alike = at >= 0 && !(best / std::max(norm[culls[i]], 1e-12f) < min_cos);
        into[lh * m + i] = alike ? at : -1;
      }
    }
  });
}

// kt (L, KVH, D, n): the live keys transposed (each key dimension a run of slots); knorm
// (L, KVH, n) float32 their norms; culls (m,) int64 -> (L, KVH, m) int64
torch::Tensor fold_into(torch::Tensor kt, torch::Tensor knorm, torch::Tensor culls,
                        double min_cos) {
  TORCH_CHECK(kt.dim() == 4 && kt.is_cpu() && kt.stride(3) == 1 &&
              (kt.scalar_type() == at::kFloat || kt.scalar_type() == at::kBFloat16),
              "kt must be (L, KVH, D, n) float32 or bfloat16 on the CPU, its slots contiguous");
  const int64_t L = kt.size(0), KVH = kt.size(1), D = kt.size(2), n = kt.size(3);
  TORCH_CHECK(knorm.dim() == 3 && knorm.scalar_type() == at::kFloat && knorm.size(0) == L &&
              knorm.size(1) == KVH && knorm.size(2) == n && knorm.stride(2) == 1,
              "knorm must be (L, KVH, n) float32");
  TORCH_CHECK(culls.dim() == 1 && culls.scalar_type() == at::kLong && culls.is_contiguous(),
              "culls must be (m,) int64");
  const int64_t m = culls.numel();
  for (int64_t i = 0; i < m; i++)
    TORCH_CHECK(0 <= culls.data_ptr<int64_t>()[i] && culls.data_ptr<int64_t>()[i] < n,
                "culled slot ", culls.data_ptr<int64_t>()[i], " is not live");
  auto into = torch::empty({L, KVH, m}, culls.options());
  if (kt.scalar_type() == at::kFloat)
    fold_kernel<float>(ptr<float>(kt), L, KVH, D, n, kt.stride(0), kt.stride(1), kt.stride(2),
                       knorm.data_ptr<float>(), knorm.stride(0), knorm.stride(1),
                       culls.data_ptr<int64_t>(), m, static_cast<float>(min_cos),
                       into.data_ptr<int64_t>());
  else
    fold_kernel<bf16>(ptr<bf16>(kt), L, KVH, D, n, kt.stride(0), kt.stride(1), kt.stride(2),
                      knorm.data_ptr<float>(), knorm.stride(0), knorm.stride(1),
                      culls.data_ptr<int64_t>(), m, static_cast<float>(min_cos),
                      into.data_ptr<int64_t>());
  return into;
}

// ---- one row times a weight matrix (B rows: below) --------------------------------------
// y = x W^T (+ b) for one row x, W (out, in) stored row-major (each output's weights one
// run: bfloat16, float32, or int8 with a scale per output) or, float32 only, input-major
// (strides (1, out): each input's weights one run, as load_model stores float32 matrices).
// Each output's sum runs in float32 in a fixed order whatever the threads, and rounds once.
// The weights stream from memory: each block of outputs prefetches the next block's rows.


#ifdef __AVX512F__
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif

constexpr int64_t kRows = 8;  // outputs summed at once, in registers

// y[0:R] = the dot products of R consecutive rows of w with x (floats); ``next`` is
// prefetched over the loop (``next_bytes`` of it: the next block's rows)
template <int64_t R, typename W>
inline void dot_rows(const W* w, int64_t in, const float* x, float* y, const char* next,
                     int64_t next_bytes) {
  int64_t k = 0;
#ifdef __AVX512F__
  __m512 a[R][2];
  for (int64_t q = 0; q < R; q++) a[q][0] = a[q][1] = _mm512_setzero_ps();
  const int64_t steps = in / 32, lines = steps ? (next_bytes / 64 + steps) / steps : 0;
  int64_t fetched = 0;
  for (; k + 32 <= in; k += 32) {
    for (int64_t l = 0; l < lines && fetched < next_bytes; l++, fetched += 64)
      _mm_prefetch(next + fetched, _MM_HINT_T0);
    const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
    for (int64_t q = 0; q < R; q++) {
      a[q][0] = _mm512_fmadd_ps(load16(w + q * in + k), x0, a[q][0]);
      a[q][1] = _mm512_fmadd_ps(load16(w + q * in + k + 16), x1, a[q][1]);
    }
  }
  for (int64_t q = 0; q < R; q++) y[q] = _mm512_reduce_add_ps(_mm512_add_ps(a[q][0], a[q][1]));
#else
  (void)next;
  (void)next_bytes;
  for (int64_t q = 0; q < R; q++) y[q] = 0.f;
#endif
  for (int64_t q = 0; q < R; q++)
    for (int64_t j = k; j < in; j++) y[q] = std::fma(load<W>(w, q * in + j), x[j], y[q]);
}

// the outputs' sums of a row-major W, kRows at a time over the threads
template <typename W>
void rows_product(const W* w, int64_t out, int64_t in, const float* x, float* y) {
  const int64_t blocks = out / kRows;
  at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; r++) {
      const W* wr = w + r * kRows * in;
      const int64_t next = r + 1 < blocks ? kRows * in * static_cast<int64_t>(sizeof(W)) : 0;
      dot_rows<kRows>(wr, in, x, y + r * kRows, reinterpret_cast<const char*>(wr + kRows * in),
                      next);
    }
  });
  for (int64_t o = blocks * kRows; o < out; o++) dot_rows<1>(w + o * in, in, x, y + o, nullptr, 0);
}

// the sums of ``G`` x 16 consecutive outputs of an input-major float32 W (input i's weights
// at w + i * out), each over the inputs in order, with row i + 8's weights prefetched
template <int64_t G>
inline void cols_tile(const float* w, int64_t out, int64_t in, const float* x, float* y) {
#ifdef __AVX512F__
  __m512 a[G];
  for (auto& v : a) v = _mm512_setzero_ps();
  for (int64_t i = 0; i < in; i++) {
    const float* wi = w + i * out;
    if (i + 8 < in)
      for (int64_t q = 0; q < G; q++)
        _mm_prefetch(reinterpret_cast<const char*>(wi + 8 * out + 16 * q), _MM_HINT_T0);
    const __m512 xi = _mm512_set1_ps(x[i]);
    for (int64_t q = 0; q < G; q++) a[q] = _mm512_fmadd_ps(xi, _mm512_loadu_ps(wi + 16 * q), a[q]);
  }
  for (int64_t q = 0; q < G; q++) _mm512_storeu_ps(y + 16 * q, a[q]);
#else
  for (int64_t c = 0; c < 16 * G; c++) {
    float s = 0.f;
    for (int64_t i = 0; i < in; i++) s = std::fma(x[i], w[i * out + c], s);
    y[c] = s;
  }
#endif
}

template <int64_t G>
void cols_product(const float* w, int64_t out, int64_t in, const float* x, float* y) {
  const int64_t tiles = out / (16 * G), groups = out / 16;
  at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; t++) cols_tile<G>(w + t * 16 * G, out, in, x, y + t * 16 * G);
  });
  for (int64_t g = tiles * G; g < groups; g++) cols_tile<1>(w + g * 16, out, in, x, y + g * 16);
  for (int64_t c = groups * 16; c < out; c++) {
    float s = 0.f;
    for (int64_t i = 0; i < in; i++) s = std::fma(x[i], w[i * out + c], s);
    y[c] = s;
  }
}

// ---- B rows times a weight matrix: each weight read once for all of them ---------------
// The same sums as one row's (dot_rows, cols_tile): each output of each row summed in the
// same order, so a row of a batch gets the bits it gets alone. A row-major W's rows are
// converted to floats once and dotted with up to kBatch inputs held in registers; an
// input-major W's 16-output tiles are read once for them all.
constexpr int64_t kBatch = 8;  // inputs taken at once

// ys[b * ld] = w . xs[b * in] for NB inputs, each as dot_rows<1> sums it
template <int64_t NB, typename W>
inline void dot_row_b(const W* w, int64_t in, const float* xs, float* ys, int64_t ld) {
  int64_t k = 0;
  float y[NB];
#ifdef __AVX512F__
  __m512 a[NB][2];
  for (int64_t b = 0; b < NB; b++) a[b][0] = a[b][1] = _mm512_setzero_ps();
  for (; k + 32 <= in; k += 32) {
    const __m512 w0 = load16(w + k), w1 = load16(w + k + 16);
    for (int64_t b = 0; b < NB; b++) {
      a[b][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xs + b * in + k), a[b][0]);
      a[b][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xs + b * in + k + 16), a[b][1]);
    }
  }
  for (int64_t b = 0; b < NB; b++) y[b] = _mm512_reduce_add_ps(_mm512_add_ps(a[b][0], a[b][1]));
#else
  for (int64_t b = 0; b < NB; b++) y[b] = 0.f;
#endif
  for (int64_t b = 0; b < NB; b++) {
    for (int64_t j = k; j < in; j++) y[b] = std::fma(load<W>(w, j), xs[b * in + j], y[b]);
    ys[b * ld] = y[b];
  }
}

// one weight row's outputs for ``B`` inputs, kBatch at a time (the rest at once)
template <typename W>
inline void dot_row_all(const W* w, int64_t in, const float* x, int64_t B, float* y,
                        int64_t out) {
  int64_t b = 0;
  for (; b + kBatch <= B; b += kBatch) dot_row_b<kBatch>(w, in, x + b * in, y + b * out, out);
  switch (B - b) {
    case 7: dot_row_b<7>(w, in, x + b * in, y + b * out, out); break;
    case 6: dot_row_b<6>(w, in, x + b * in, y + b * out, out); break;
    case 5: dot_row_b<5>(w, in, x + b * in, y + b * out, out); break;
    case 4: dot_row_b<4>(w, in, x + b * in, y + b * out, out); break;
    case 3: dot_row_b<3>(w, in, x + b * in, y + b * out, out); break;
    case 2: dot_row_b<2>(w, in, x + b * in, y + b * out, out); break;
    case 1: dot_row_b<1>(w, in, x + b * in, y + b * out, out); break;
    default: break;
  }
}

// x (B, in) floats times a row-major W: y (B, out), the weight rows shared over the threads
// in blocks of kRows, the next block prefetched
template <typename W>
void rows_product_b(const W* w, int64_t out, int64_t in, const float* x, int64_t B, float* y) {
  const int64_t blocks = (out + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; r++) {
      const int64_t o0 = r * kRows, o1 = std::min(out, o0 + kRows);
#ifdef __AVX512F__
      if (o1 < out) {
        const char* next = reinterpret_cast<const char*>(w + o1 * in);
        const int64_t bytes = (std::min(out, o1 + kRows) - o1) * in * static_cast<int64_t>(sizeof(W));
        for (int64_t f = 0; f < bytes; f += 64) _mm_prefetch(next + f, _MM_HINT_T1);
      }
#endif
      for (int64_t o = o0; o < o1; o++) dot_row_all(w + o * in, in, x, B, y + o, out);
    }
  });
}

// the 16 outputs from ``c`` of an input-major float32 W for NB inputs, each as cols_tile sums
template <int64_t NB>
inline void cols_tile_b(const float* w, int64_t out, int64_t in, const float* xs, float* ys,
                        int64_t c) {
#ifdef __AVX512F__
  __m512 a[NB];
  for (auto& v : a) v = _mm512_setzero_ps();
  for (int64_t i = 0; i < in; i++) {
    const float* wi = w + i * out + c;
    if (i + 8 < in) _mm_prefetch(reinterpret_cast<const char*>(wi + 8 * out), _MM_HINT_T0);
    const __m512 wv = _mm512_loadu_ps(wi);
    for (int64_t b = 0; b < NB; b++)
      a[b] = _mm512_fmadd_ps(_mm512_set1_ps(xs[b * in + i]), wv, a[b]);
  }
  for (int64_t b = 0; b < NB; b++) _mm512_storeu_ps(ys + b * out + c, a[b]);
#else
  for (int64_t b = 0; b < NB; b++)
    for (int64_t q = 0; q < 16; q++) {
      float s = 0.f;
      for (int64_t i = 0; i < in; i++) s = std::fma(xs[b * in + i], w[i * out + c + q], s);
      ys[b * out + c + q] = s;
    }
#endif
}

void cols_product_b(const float* w, int64_t out, int64_t in, const float* x, int64_t B,
                    float* y) {
  const int64_t groups = out / 16;
  at::parallel_for(0, groups, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t g = lo; g < hi; g++) {
      int64_t b = 0;
      for (; b + kBatch <= B; b += kBatch)
        cols_tile_b<kBatch>(w, out, in, x + b * in, y + b * out, g * 16);
      const float* xb = x + b * in;
      float* yb = y + b * out;
      switch (B - b) {  // the rest at once too: each tile read once for every row
        case 7: cols_tile_b<7>(w, out, in, xb, yb, g * 16); break;
        case 6: cols_tile_b<6>(w, out, in, xb, yb, g * 16); break;
        case 5: cols_tile_b<5>(w, out, in, xb, yb, g * 16); break;
        case 4: cols_tile_b<4>(w, out, in, xb, yb, g * 16); break;
        case 3: cols_tile_b<3>(w, out, in, xb, yb, g * 16); break;
        case 2: cols_tile_b<2>(w, out, in, xb, yb, g * 16); break;
        case 1: cols_tile_b<1>(w, out, in, xb, yb, g * 16); break;
        default: break;
      }
    }
  });
  for (int64_t b = 0; b < B; b++)
    for (int64_t c = groups * 16; c < out; c++) {
      float s = 0.f;
      for (int64_t i = 0; i < in; i++) s = std::fma(x[b * in + i], w[i * out + c], s);
      y[b * out + c] = s;
    }
}

#ifdef __AVX512F__
// one vector whose lane j is the sum of the 16 lanes of v[j]
inline __m512 sum16x16(__m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; i++)  // pairs: [a0+a2, b0+b2, a1+a3, b1+b3] per 128-bit lane
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++)  // fours: [a, b, c, d] per 128-bit lane, each a lane's part
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; i++)  // eights: two 128-bit lanes' parts of each
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88),
                       _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}
#endif

// ---- bfloat16 rows times a bfloat16 matrix, with AVX512_BF16's pair products ----------
// Where the CPU has them (vdpbf16ps: 32 products of bfloat16 pairs a instruction, exact in
// float32, added into 16 float32 lanes, denormals flushed to zero), a bfloat16 row's sums
// take them: each output's lane j adds the products of inputs 32 s + 2 j + 1 and 32 s + 2 j
// at each step s (the instruction's own order), then the lanes are added (``sum16x16``'s
// tree), then the inputs past the last whole step one by one. One row or B,
// each row of each output is summed so (``dot_bf16``), whatever R and NB.
#ifdef __AVX512BF16__
template <int64_t R, int64_t NB, decltype(_MM_HINT_T0) Hint = _MM_HINT_T0>
inline void dot_bf16(const bf16* w, int64_t in, const bf16* xs, float* ys, int64_t ld,
                     const char* next = nullptr, int64_t next_bytes = 0) {
  __m512 a[R][NB];
  for (int64_t q = 0; q < R; q++)
    for (int64_t b = 0; b < NB; b++) a[q][b] = _mm512_setzero_ps();
  const int64_t steps = in / 32, lines = steps ? (next_bytes / 64 + steps) / steps : 0;
  int64_t k = 0, fetched = 0;
  for (; k + 32 <= in; k += 32) {
    for (int64_t l = 0; l < lines && fetched < next_bytes; l++, fetched += 64)
      _mm_prefetch(next + fetched, Hint);
    __m512bh xv[NB];
    for (int64_t b = 0; b < NB; b++)
      xv[b] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(xs + b * in + k));
    for (int64_t q = 0; q < R; q++) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + q * in + k));
      for (int64_t b = 0; b < NB; b++) a[q][b] = _mm512_dpbf16_ps(a[q][b], wv, xv[b]);
    }
  }
  static_assert(R * NB <= 16, "one sum16x16 for all of them");
  __m512 v[16];
  for (int64_t i = 0; i < 16; i++) v[i] = i < R * NB ? a[i / NB][i % NB] : _mm512_setzero_ps();
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum16x16(v));  // each accumulator's lanes in one fixed order
  for (int64_t q = 0; q < R; q++)
    for (int64_t b = 0; b < NB; b++) {
      float y = lanes[q * NB + b];
      for (int64_t j = k; j < in; j++)
        y = std::fma(from_bf16(w[q * in + j]), from_bf16(xs[b * in + j]), y);
      ys[b * ld + q] = y;
    }
}

// part ``k`` of ``parts`` of a prefetch of ``bytes``: its offset (from the line holding its
// first byte) and length
struct Share { int64_t from, bytes; };
inline Share share(int64_t bytes, int64_t k, int64_t parts) {
  const int64_t from = bytes * k / parts / 64 * 64;
  return {from, bytes * (k + 1) / parts - from};
}

// R weight rows for B inputs, 4 at a time (R x 4 accumulators: one sum16x16), with
// ``next``'s ``bytes`` (part of the next block's rows) prefetched into L2 a few lines a step
// over the calls' loops: asked for all at once at a block's start, they held the products up
template <int64_t R>
inline void dot_bf16_all(const bf16* w, int64_t in, const bf16* x, int64_t B, float* y,
                         int64_t out, const char* next = nullptr, int64_t bytes = 0) {
  const int64_t calls = (B + 3) / 4;
  for (int64_t b = 0, c = 0; b < B; b += 4, c++) {
    const Share p = share(bytes, c, calls);
    const bf16* xb = x + b * in;
    float* yb = y + b * out;
    switch (std::min<int64_t>(4, B - b)) {
      case 4: dot_bf16<R, 4, _MM_HINT_T1>(w, in, xb, yb, out, next + p.from, p.bytes); break;
      case 3: dot_bf16<R, 3, _MM_HINT_T1>(w, in, xb, yb, out, next + p.from, p.bytes); break;
      case 2: dot_bf16<R, 2, _MM_HINT_T1>(w, in, xb, yb, out, next + p.from, p.bytes); break;
      default: dot_bf16<R, 1, _MM_HINT_T1>(w, in, xb, yb, out, next + p.from, p.bytes); break;
    }
  }
}

// x (B, in) bfloat16 times a row-major bfloat16 W: y (B, out) float32 sums, the weight rows
// shared over the threads in blocks of kRows, the next block prefetched
void bf16_product(const bf16* w, int64_t out, int64_t in, const bf16* x, int64_t B, float* y) {
  const int64_t blocks = (out + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; r++) {
      const int64_t o0 = r * kRows, o1 = std::min(out, o0 + kRows);
      const char* next = reinterpret_cast<const char*>(w + o1 * in);  // the next block's rows
      const int64_t bytes = (std::min(out, o1 + kRows) - o1) * in * 2;  // spread over the loop
      int64_t o = o0;
      if (B == 1) {
        for (; o + kRows <= o1; o += kRows)
          dot_bf16<kRows, 1>(w + o * in, in, x, y + o, out, next, bytes);
      } else {  // the next block's rows spread over the row groups
        const int64_t groups = (o1 - o0) / 4;
        for (int64_t g = 0; o + 4 <= o1; o += 4, g++) {
          const Share p = share(bytes, g, groups);
          dot_bf16_all<4>(w + o * in, in, x, B, y + o, out, next + p.from, p.bytes);
        }
      }
      for (; o < o1; o++) dot_bf16_all<1>(w + o * in, in, x, B, y + o, out);
    }
  });
}
#endif

// x (B, in) float32 or bfloat16 times w (out, in), plus ``b`` (out) if given; (B, out) in
// x's dtype (B = 1: also x (in) or (1, in)). An int8 w's sums are times ``scale`` (out,
// bfloat16) and rounded before the bias is added, as forward.linear adds it to torch's int8
// product. Each row's outputs are the bits that row gets alone.
torch::Tensor linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor b) {
  check_row(x, "x");
  const int64_t B = x.dim() == 2 ? x.size(0) : 1, in = x.numel() / std::max<int64_t>(B, 1);
  const int64_t out = w.size(0);
  TORCH_CHECK(B >= 1, "x must hold a row");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == in && w.is_cpu(), "w must be a CPU (", out, ", ",
              in, ") matrix");
  const bool input_major = w.stride(0) == 1 && w.stride(1) == out && in > 1;
  TORCH_CHECK(w.is_contiguous() || (input_major && w.scalar_type() == at::kFloat),
              "w must be row-major (float32 also input-major)");
  const bool int8 = w.scalar_type() == at::kChar;
  TORCH_CHECK(int8 ? scale.numel() == out && scale.scalar_type() == at::kBFloat16
                   : scale.numel() == 0, "an int8 w takes a bfloat16 scale per output");
  TORCH_CHECK(int8 || w.scalar_type() == x.scalar_type(), "dtypes differ");
  TORCH_CHECK(b.numel() == 0 || (b.numel() == out && b.scalar_type() == x.scalar_type()),
              "b must be (out,) in x's dtype");
  std::vector<float> xf, sums(B * out);
  const bool pairs =  // bfloat16 by bfloat16: the pair products where the CPU has them
#ifdef __AVX512BF16__
      w.scalar_type() == at::kBFloat16;
#else
      false;
#endif
  if (!pairs) {
    xf.resize(B * in);
    for (int64_t i = 0; i < B * in; i++)
      xf[i] = x.scalar_type() == at::kFloat ? ptr<float>(x)[i] : from_bf16(ptr<bf16>(x)[i]);
  }
  if (pairs) {
#ifdef __AVX512BF16__
    bf16_product(ptr<bf16>(w), out, in, ptr<bf16>(x), B, sums.data());
#endif
  } else if (B == 1) {
    if (int8)
      rows_product(ptr<int8_t>(w), out, in, xf.data(), sums.data());
    else if (w.scalar_type() == at::kBFloat16)
      rows_product(ptr<bf16>(w), out, in, xf.data(), sums.data());
    else if (input_major)
      cols_product<4>(ptr<float>(w), out, in, xf.data(), sums.data());
    else
      rows_product(ptr<float>(w), out, in, xf.data(), sums.data());
  } else if (int8) {
    rows_product_b(ptr<int8_t>(w), out, in, xf.data(), B, sums.data());
  } else if (w.scalar_type() == at::kBFloat16) {
    rows_product_b(ptr<bf16>(w), out, in, xf.data(), B, sums.data());
  } else if (input_major) {
    cols_product_b(ptr<float>(w), out, in, xf.data(), B, sums.data());
  } else {
    rows_product_b(ptr<float>(w), out, in, xf.data(), B, sums.data());
  }
  float* sp = sums.data();
  if (int8) {  // the sum times the row's scale, rounded; then + b, rounded
    std::vector<float> sc(out);
    for (int64_t o = 0; o < out; o++) sc[o] = from_bf16(ptr<bf16>(scale)[o]);
    for (int64_t r = 0; r < B; r++)
      for (int64_t o = 0; o < out; o++) sp[r * out + o] = round_to<bf16>(sp[r * out + o] * sc[o]);
  }
  if (b.numel()) {
    std::vector<float> bias(out);
    for (int64_t o = 0; o < out; o++)
      bias[o] = x.scalar_type() == at::kFloat ? ptr<float>(b)[o] : from_bf16(ptr<bf16>(b)[o]);
    for (int64_t r = 0; r < B; r++)
      for (int64_t o = 0; o < out; o++) sp[r * out + o] += bias[o];
  }
  auto y = torch::empty({B, out}, x.options());
  if (x.scalar_type() == at::kFloat) {
    std::copy(sp, sp + B * out, ptr<float>(y));
  } else {
    bf16* yp = ptr<bf16>(y);
    for (int64_t i = 0; i < B * out; i++) yp[i] = to_bf16(sp[i]);
  }
  return y;
}

// ---- recall's scan of the cold keys ----------------------------------------------------
// For every cold key j: the max over the recall layers, the KV heads and each head's group
// of query heads of round(q . k_j) - lse (+ log_w[layer, head, j] if given), float32: what
// stages/score.py's cold_logits with group_max and its max over layers and heads give, the
// products summed in another order. The keys go in blocks of 16 over the threads; each
// block's rows are read once per layer and head for all of a group's queries, and its 16
// dot products per query are summed lane-wise, then folded into one vector by a tree of
// shuffles. A max is exact and a block's sums do not depend on how the blocks are shared,
// so the result does not depend on the threads.
constexpr int64_t kColdBlock = 16;
constexpr int64_t kColdAhead = 4 * kColdBlock;  // keys read ahead


#ifdef __AVX512F__
// dots[g * 16 + r] = q_g . k_r for a block of 16 key rows ``kf`` (floats, C x 16 each) and
// the G queries ``qf``: each query's 16 products summed lane-wise, then folded together
template <int C>
inline void block_dots(const float* kf, const float* qf, int64_t G, float* dots) {
  for (int64_t g = 0; g < G; g++) {
    __m512 q[C], acc[kColdBlock];
    for (int c = 0; c < C; c++) q[c] = _mm512_loadu_ps(qf + (g * C + c) * 16);
    for (int r = 0; r < kColdBlock; r++) {
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(kf + r * C * 16), q[0]);
      for (int c = 1; c < C; c++) a = _mm512_fmadd_ps(_mm512_loadu_ps(kf + (r * C + c) * 16), q[c], a);
      acc[r] = a;
    }
    _mm512_storeu_ps(dots + g * kColdBlock, sum16x16(acc));
  }
}

// block_dots for any number C of 16-float parts of a row (a head size past 128)
inline void block_dots_n(const float* kf, const float* qf, int64_t G, int64_t C, float* dots) {
  for (int64_t g = 0; g < G; g++) {
    __m512 acc[kColdBlock];
    for (int64_t r = 0; r < kColdBlock; r++) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t c = 0; c < C; c++)
        a = _mm512_fmadd_ps(_mm512_loadu_ps(kf + (r * C + c) * 16),
                            _mm512_loadu_ps(qf + (g * C + c) * 16), a);
      acc[r] = a;
    }
    _mm512_storeu_ps(dots + g * kColdBlock, sum16x16(acc));
  }
}
#endif

// dots[g * 16 + r] = round(q_g . k_{j + r}) for the G queries ``qf`` (G x D floats) and the
// keys [j, j + m) of rows at ``kh``; ``kf`` scratch for a block's rows as floats (16 x D)
template <typename T>
inline void cold_dots(const T* kh, int64_t j, int64_t m, int64_t D, int64_t G, const float* qf,
                      float* kf, float* dots) {
#ifdef __AVX512F__
  if (m == kColdBlock && D % 16 == 0 && D > 0) {
    const char* next = reinterpret_cast<const char*>(kh + (j + kColdAhead) * D);
    for (int64_t l = 0; l < kColdBlock * D * static_cast<int64_t>(sizeof(T)); l += 64)
      _mm_prefetch(next + l, _MM_HINT_T0);  // a later block's rows (past the end: harmless)
    const float* rows = kf;  // the rows as floats: float32's in place, else converted once
    if constexpr (std::is_same<T, float>::value)
      rows = kh + j * D;
    else
      for (int64_t i = 0; i < kColdBlock * D; i += 16)
        _mm512_storeu_ps(kf + i, load16(kh + j * D + i));
    switch (D / 16) {
      case 1: block_dots<1>(rows, qf, G, dots); break;
      case 2: block_dots<2>(rows, qf, G, dots); break;
      case 3: block_dots<3>(rows, qf, G, dots); break;
      case 4: block_dots<4>(rows, qf, G, dots); break;
      case 5: block_dots<5>(rows, qf, G, dots); break;
      case 6: block_dots<6>(rows, qf, G, dots); break;
      case 7: block_dots<7>(rows, qf, G, dots); break;
      case 8: block_dots<8>(rows, qf, G, dots); break;
      default: block_dots_n(rows, qf, G, D / 16, dots); break;
    }
    for (int64_t i = 0; i < G * kColdBlock; i += 16)
      _mm512_storeu_ps(dots + i, round16<T>(_mm512_loadu_ps(dots + i)));
    return;
  }
#endif
  (void)kf;
  for (int64_t g = 0; g < G; g++)
    for (int64_t r = 0; r < m; r++) {
      float dot = 0.f;
      for (int64_t d = 0; d < D; d++)
        dot = std::fma(load<T>(kh, (j + r) * D + d), qf[g * D + d], dot);
      dots[g * kColdBlock + r] = round_to<T>(dot);
    }
}

template <typename T>
void cold_max_kernel(const T* q, const float* lse, const T* k, const float* log_w,
                     const std::vector<int64_t>& layers, int64_t H, int64_t KVH, int64_t D,
                     int64_t c, int64_t q_l, int64_t k_l, int64_t k_h, int64_t w_l, int64_t w_h,
                     float* out) {
  const int64_t G = H / KVH, blocks = (c + kColdBlock - 1) / kColdBlock;
  at::parallel_for(0, blocks, 4, [&](int64_t b, int64_t e) {
    std::vector<float> qf(G * D), kf(kColdBlock * D), dots(G * kColdBlock);
    for (int64_t j = b * kColdBlock; j < std::min(c, e * kColdBlock); j++) out[j] = -INFINITY;
    for (size_t li = 0; li < layers.size(); li++) {
      const int64_t l = layers[li];
      for (int64_t h = 0; h < KVH; h++) {
        for (int64_t i = 0; i < G * D; i++) qf[i] = load<T>(q + l * q_l + h * G * D, i);
        const float* lse_h = lse + l * H + h * G;
        const T* kh = k + l * k_l + h * k_h;
        const float* w = log_w ? log_w + li * w_l + h * w_h : nullptr;
        for (int64_t blk = b; blk < e; blk++) {
          const int64_t j = blk * kColdBlock, m = std::min(kColdBlock, c - j);
          cold_dots<T>(kh, j, m, D, G, qf.data(), kf.data(), dots.data());
#ifdef __AVX512F__
          if (m == kColdBlock) {  // the same maxima, 16 lanes at once (a NaN as std::max)
            __m512 top = _mm512_set1_ps(-INFINITY);
            for (int64_t g = 0; g < G; g++)
              top = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(dots.data() + g * kColdBlock),
                                                _mm512_set1_ps(lse_h[g])), top);
            if (w) top = _mm512_add_ps(top, _mm512_loadu_ps(w + j));
            _mm512_storeu_ps(out + j, _mm512_max_ps(top, _mm512_loadu_ps(out + j)));
            continue;
          }
#endif
          float best[kColdBlock];
          for (int64_t r = 0; r < m; r++) best[r] = -INFINITY;
          for (int64_t g = 0; g < G; g++)
            for (int64_t r = 0; r < m; r++)
              best[r] = std::max(best[r], dots[g * kColdBlock + r] - lse_h[g]);
          for (int64_t r = 0; r < m; r++)
            out[j + r] = std::max(out[j + r], w ? best[r] + w[j + r] : best[r]);
        }
      }
    }
  });
}

// q (L, H, D) and lse (L, H) float32: stage 1's query and log-sum-exp; k (L, KVH, c, D) the
// cold keys (rows contiguous); log_w (len(layers), KVH, c) float32 or empty; -> (c,) float32
torch::Tensor cold_max(torch::Tensor q, torch::Tensor lse, torch::Tensor k, torch::Tensor log_w,
                       std::vector<int64_t> layers) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && q.is_contiguous() && k.stride(3) == 1 &&
              k.stride(2) == k.size(3) && q.size(2) == k.size(3) && q.size(0) == k.size(0) &&
              q.size(1) % k.size(1) == 0 && k.is_cpu() && q.is_cpu(),
              "q (L, H, D) contiguous, k (L, KVH, c, D) with contiguous rows, on the CPU");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && (k.scalar_type() == at::kFloat ||
              k.scalar_type() == at::kBFloat16), "q and k: one dtype, float32 or bfloat16");
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat &&
              lse.numel() == q.size(0) * q.size(1), "lse must be (L, H) float32");
  const int64_t c = k.size(2);
  for (int64_t l : layers) TORCH_CHECK(0 <= l && l < q.size(0), "layer ", l, " out of range");
  const bool weighted = log_w.numel() > 0;
  TORCH_CHECK(!weighted || (log_w.dim() == 3 && log_w.scalar_type() == at::kFloat &&
              log_w.size(0) == static_cast<int64_t>(layers.size()) && log_w.size(1) == k.size(1) &&
              log_w.size(2) == c && log_w.stride(2) == 1),
              "log_w must be (layers, KVH, c) float32");
  auto out = torch::empty({c}, lse.options());
  const float* w = weighted ? log_w.data_ptr<float>() : nullptr;
  const int64_t w_l = weighted ? log_w.stride(0) : 0, w_h = weighted ? log_w.stride(1) : 0;
  if (k.scalar_type() == at::kFloat)
    cold_max_kernel<float>(ptr<float>(q), lse.data_ptr<float>(), ptr<float>(k), w, layers,
                           q.size(1), k.size(1), k.size(3), c, q.stride(0), k.stride(0),
                           k.stride(1), w_l, w_h, out.data_ptr<float>());
  else
    cold_max_kernel<bf16>(ptr<bf16>(q), lse.data_ptr<float>(), ptr<bf16>(k), w, layers,
                          q.size(1), k.size(1), k.size(3), c, q.stride(0), k.stride(0),
                          k.stride(1), w_l, w_h, out.data_ptr<float>());
  return out;
}

// ---- the sampler's draw ------------------------------------------------------------------
// torch.multinomial(p, 1, generator) on the CPU, the same token and the generator left in
// the same state: torch draws q_i ~ Exp(1) for every token in turn (float(-log1p(-u_i)),
// u_i the 53 low bits of two 32-bit Mersenne Twister words, as ``exponential_`` makes
// them) and takes the first argmax of the float32 ratios p_i / q_i. Every word is drawn
// here as there, but a logarithm is taken only where the ratio could win: -log1p(-u) >= u,
// so p_i / q_i <= p_i / u_i, and a token with p_i / u_i under the best ratio so far by a
// margin wider than every rounding on the way (the logarithm's, the float conversions',
// the division's) cannot be the argmax. Probabilities torch refuses (a NaN, an infinity, a
// negative one, all zero, over 2^24 of them) return -1: the caller lets torch raise its
// own error.
int64_t draw(torch::Tensor probs, at::Generator generator) {
  TORCH_CHECK(probs.dim() == 1 && probs.is_cpu() && probs.scalar_type() == at::kFloat &&
              probs.is_contiguous(), "probs must be (V,) float32 on the CPU, contiguous");
  const float* p = probs.data_ptr<float>();
  const int64_t n = probs.numel();
  if (n > (int64_t{1} << 24)) return -1;  // torch's limit on categories
  bool any = false;
  for (int64_t i = 0; i < n; i++) {
    if (!(p[i] >= 0.0f) || std::isinf(p[i])) return -1;
    any = any || p[i] > 0.0f;
  }
  if (!any) return -1;
  auto* gen = at::check_generator<at::CPUGeneratorImpl>(generator);
  std::lock_guard<std::mutex> lock(gen->mutex_);
  at::mt19937 engine = gen->engine();
  constexpr uint64_t kMask = (uint64_t{1} << 53) - 1;
  constexpr double kUnit = 1.0 / static_cast<double>(uint64_t{1} << 53);
  constexpr double kMargin = 1.0 + 1.0 / (1 << 20);  // > the roundings' (about 1 + 2^-23)
  const float normal = std::numeric_limits<float>::min();
  int64_t best = -1;
  float top = 0.0f;  // the best ratio so far: a NaN (0 / 0) wins, the first one
  for (int64_t i = 0; i < n; i++) {
    const uint64_t hi = engine(), lo = engine();
    const double u = static_cast<double>(((hi << 32) | lo) & kMask) * kUnit;
    if (best >= 0 && (std::isnan(top) ||
                      (u > 0.0 && top >= normal && p[i] * kMargin <= top * u)))
      continue;
    const float ratio = p[i] / static_cast<float>(-std::log1p(-u));
    if (best < 0 || std::isnan(ratio) || ratio > top) {
      best = i;
      top = ratio;
    }
  }
  gen->set_engine(engine);
  return best;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "w * rms_norm(x)");
  m.def("add_rms_norm", &add_rms_norm, "x += y in place, then w * rms_norm(x)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [gate | up] rows");
  m.def("attend_rows", &attend_rows, "B rows' attention of one new token each in one layer");
  m.def("linear", &linear, "rows times a weight matrix, plus a bias");
  m.def("cold_max", &cold_max, "recall's scan: each cold key's largest logit");
  m.def("fold_into", &fold_into, "fold's targets: each culled key's most alike live key");
  m.def("draw", &draw, "torch.multinomial(probs, 1, generator)'s token, the same draw");
}
