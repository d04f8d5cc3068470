/* The native GGUF engine's decoder: a Llama forward pass (one token a step when decoding, up to 16 a
 * pass when reading a prompt) over a GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks (engines/native_gguf/
 * model.py repacks them; the bytes a token reads are the file's). Built on the machine that runs it
 * (engines/native_gguf/build.py, -march=native).
 *
 * Why hand-written: llama.cpp's kernels read such a file at memory speed but quantize the activations
 * to 8 bits per block of 32 (+0.5% perplexity on SmolLM2's Q4_1 file), and ONNX Runtime's and
 * OpenVINO's kernels keep the file's numbers but decode one sequence at under half llama.cpp's speed.
 * Here activations are quantized per block of 32 to 16 bits, split into two 8-bit planes (high and
 * low byte), and each plane meets the weights in AVX-512 VNNI's u8 x s8 dot products: twice
 * llama.cpp's integer work, 256 times finer activations (f32 to within 1e-4 of a matrix product).
 *
 * On AVX2-only CPUs (no VNNI) the same products run through vpmaddubsw / vpmaddwd, whose 16-bit pair
 * sums would overflow on a low plane up to 255: activations there are 15 bits (a 7-bit low plane, the
 * high plane within +-127), 128 times finer than llama.cpp's still.
 *
 * Weights are repacked 16 rows to a group so that each 32-bit lane of a dot product is one row:
 * the activations are broadcast, never shuffled, and one block's 16 scales are one vector.
 *   4-bit group-block (320 bytes): 256 bytes of nibbles (byte 64t + 4i + k holds row i's elements
 *     8t + k in its low and 8t + 4 + k in its high nibble), 16 f16 scales d, 16 f16 offsets m;
 *     the value is d * q + m (Q4_0 carried as m = -8d).
 *   8-bit group-block (544 bytes): 512 bytes (byte 64j + 4i + k is row i's element 4j + k) and 16 f16
 *     scales; the value is d * q.
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define VNNI 1
enum { LOW_BITS = 8, QMAX = 32767 };           /* x = 256 high + low: 16 bits */
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VNNI 0
enum { LOW_BITS = 7, QMAX = 127 * 128 };       /* x = 128 high + low, |high| <= 127: 15 bits */
#else
#error "the native GGUF kernels need AVX-512 VNNI, or AVX2 with FMA and F16C"
#endif

enum { GROUP = 16, BYTES_4BIT = 320, BYTES_8BIT = 544, PREFETCH_BLOCKS = 32 };
/* Tokens one pass takes (a prompt is read in such chunks): a group's weights, read from memory for the
 * first, are still in cache for the others. */
enum { MAX_BATCH = 16 };
enum { KIND_4BIT = 0, KIND_8BIT = 1 };

typedef struct { int kind, rows, cols; const uint8_t *data; } matrix;
typedef struct {
  const float *attn_norm, *ffn_norm;
  int n_qkv, n_gate_up;  /* 1 where the parts are fused (one kind), else 3 and 2 */
  matrix qkv[3], gate_up[2], out, down;
} layer;

/* A vector quantized per block of 32: x = scale * (2^LOW_BITS * high + low), high int8, low uint8. */
typedef struct { float *sum, *scale; int32_t *high_sum, *high, *low; } activations;

typedef struct {
  int layers, dim, ffn, heads, kv_heads, head_dim, vocab_rows, context, threads;
  float rope_base, eps;
  layer *layer;
  matrix embedding, head;
  const float *out_norm;
  /* MAX_BATCH rows each (one a token), but the KV cache and the scores (one row a head) */
  float *k_cache, *v_cache, *x, *xn, *qkv, *attn, *proj, *gate_up, *hidden, *scores, *cos, *sin;
  activations a_dim[MAX_BATCH], a_ffn[MAX_BATCH];
} model;

static void *zeroed(size_t bytes) { void *p = aligned_alloc(64, (bytes + 63) / 64 * 64); if (p) memset(p, 0, (bytes + 63) / 64 * 64); return p; }

static int activations_new(activations *a, int n) {
  int blocks = n / 32;
  a->sum = zeroed(blocks * 4); a->scale = zeroed(blocks * 4); a->high_sum = zeroed(blocks * 4);
  a->high = zeroed(blocks * 32); a->low = zeroed(blocks * 32);
  return a->sum && a->scale && a->high_sum && a->high && a->low;
}
static void activations_free(activations *a) { free(a->sum); free(a->scale); free(a->high_sum); free(a->high); free(a->low); }

/* A block whose largest value is below this quantizes to zeros: QMAX / top would overflow to Inf (a
 * block of subnormal activations, e.g. a near-zero norm weight), and Inf x 0 is NaN, which converts to
 * INT_MIN and overflows the plane sums. One compare a block; every block of normal numbers is unchanged. */
#define TINY ((float)QMAX / FLT_MAX)

#if VNNI
static void quantize(activations *a, const float *x, int n) {
  const __m512i byte = _mm512_set1_epi32(255);
  for (int b = 0; b < n / 32; b++) {
    __m512 v0 = _mm512_loadu_ps(x + b * 32), v1 = _mm512_loadu_ps(x + b * 32 + 16);
    float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    a->sum[b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    a->scale[b] = top / QMAX;
    __m512 inverse = _mm512_set1_ps(top > TINY ? (float)QMAX / top : 0.f);
    __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inverse)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inverse));
    __m512i h0 = _mm512_srai_epi32(q0, 8), h1 = _mm512_srai_epi32(q1, 8);
    a->high_sum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(h0, h1));
    _mm_storeu_si128((__m128i *)(a->high + b * 8), _mm512_cvtepi32_epi8(h0));
    _mm_storeu_si128((__m128i *)(a->high + b * 8 + 4), _mm512_cvtepi32_epi8(h1));
    _mm_storeu_si128((__m128i *)(a->low + b * 8), _mm512_cvtepi32_epi8(_mm512_and_si512(q0, byte)));
    _mm_storeu_si128((__m128i *)(a->low + b * 8 + 4), _mm512_cvtepi32_epi8(_mm512_and_si512(q1, byte)));
  }
}

#else
static void quantize(activations *a, const float *x, int n) {
  for (int b = 0; b < n / 32; b++) {
    const float *v = x + b * 32;
    float top = 0, sum = 0;
    for (int i = 0; i < 32; i++) { top = fmaxf(top, fabsf(v[i])); sum += v[i]; }
    a->sum[b] = sum; a->scale[b] = top / QMAX;
    float inverse = top > TINY ? QMAX / top : 0.f;
    int8_t *high = (int8_t *)(a->high + b * 8); uint8_t *low = (uint8_t *)(a->low + b * 8);
    int high_sum = 0;
    for (int i = 0; i < 32; i++) {
      int q = (int)lrintf(v[i] * inverse);
      high[i] = (int8_t)(q >> LOW_BITS); low[i] = (uint8_t)(q & ((1 << LOW_BITS) - 1)); high_sum += high[i];
    }
    a->high_sum[b] = high_sum;
  }
}

#endif

static void prefetch(const uint8_t *p, int bytes) {
  for (int c = 0; c < bytes; c += 64) _mm_prefetch((const char *)p + c, _MM_HINT_T0);
}

#if VNNI
/* 16 rows of a 4-bit matrix times one token's activations (decoding). */
static void group_4bit_one(const uint8_t *p, int blocks, const activations *a, float *y) {
  __m512 acc = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(15);
  for (int b = 0; b < blocks; b++, p += BYTES_4BIT) {
    prefetch(p + PREFETCH_BLOCKS * BYTES_4BIT, BYTES_4BIT);
    const int32_t *high = a->high + b * 8, *low = a->low + b * 8;
    __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
    for (int t = 0; t < 4; t++) {
      __m512i v = _mm512_loadu_si512(p + 64 * t);
      __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      h0 = _mm512_dpbusd_epi32(h0, lo, _mm512_set1_epi32(high[2 * t]));
      h1 = _mm512_dpbusd_epi32(h1, hi, _mm512_set1_epi32(high[2 * t + 1]));
      l0 = _mm512_dpbusd_epi32(l0, _mm512_set1_epi32(low[2 * t]), lo);
      l1 = _mm512_dpbusd_epi32(l1, _mm512_set1_epi32(low[2 * t + 1]), hi);
    }
    __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8), _mm512_add_epi32(l0, l1));
    __m512 scale = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256))), _mm512_set1_ps(a->scale[b]));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
    acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 288))), _mm512_set1_ps(a->sum[b]), acc);
  }
  _mm512_storeu_ps(y, acc);
}

/* 16 rows of an 8-bit matrix times one token's activations. VNNI multiplies u8 by s8: the weights meet
 * the signed high plane as q + 128 (unsigned), and 128 times the plane's sum comes off again. */
static void group_8bit_one(const uint8_t *p, int blocks, const activations *a, float *y) {
  __m512 acc = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  for (int b = 0; b < blocks; b++, p += BYTES_8BIT) {
    prefetch(p + PREFETCH_BLOCKS * BYTES_8BIT, BYTES_8BIT);
    const int32_t *high = a->high + b * 8, *low = a->low + b * 8;
    __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
    for (int j = 0; j < 8; j += 2) {
      __m512i w0 = _mm512_loadu_si512(p + 64 * j), w1 = _mm512_loadu_si512(p + 64 * (j + 1));
      h0 = _mm512_dpbusd_epi32(h0, _mm512_xor_si512(w0, flip), _mm512_set1_epi32(high[j]));
      h1 = _mm512_dpbusd_epi32(h1, _mm512_xor_si512(w1, flip), _mm512_set1_epi32(high[j + 1]));
      l0 = _mm512_dpbusd_epi32(l0, _mm512_set1_epi32(low[j]), w0);
      l1 = _mm512_dpbusd_epi32(l1, _mm512_set1_epi32(low[j + 1]), w1);
    }
    __m512i high_dot = _mm512_sub_epi32(_mm512_add_epi32(h0, h1), _mm512_set1_epi32(128 * a->high_sum[b]));
    __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(high_dot, 8), _mm512_add_epi32(l0, l1));
    __m512 scale = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 512))), _mm512_set1_ps(a->scale[b]));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
  }
  _mm512_storeu_ps(y, acc);
}

/* 16 rows of a 4-bit matrix times n tokens' activations (a prompt; row i of the result at y + i * stride).
 * A block's weights are unpacked once for all n; each token's arithmetic is group_4bit_one's, in the same
 * order, so a prompt's logits are a decode's to the bit. */
static void group_4bit_tokens(const uint8_t *p, int blocks, const activations *a, int n, float *y, size_t stride) {
  __m512 acc[MAX_BATCH];
  for (int i = 0; i < n; i++) acc[i] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(15);
  for (int b = 0; b < blocks; b++, p += BYTES_4BIT) {
    prefetch(p + PREFETCH_BLOCKS * BYTES_4BIT, BYTES_4BIT);
    __m512i lo[4], hi[4];
    for (int t = 0; t < 4; t++) {
      __m512i v = _mm512_loadu_si512(p + 64 * t);
      lo[t] = _mm512_and_si512(v, nibble); hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    }
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256)));
    __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 288)));
    for (int i = 0; i < n; i++) {
      const int32_t *high = a[i].high + b * 8, *low = a[i].low + b * 8;
      __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
      for (int t = 0; t < 4; t++) {
        h0 = _mm512_dpbusd_epi32(h0, lo[t], _mm512_set1_epi32(high[2 * t]));
        h1 = _mm512_dpbusd_epi32(h1, hi[t], _mm512_set1_epi32(high[2 * t + 1]));
        l0 = _mm512_dpbusd_epi32(l0, _mm512_set1_epi32(low[2 * t]), lo[t]);
        l1 = _mm512_dpbusd_epi32(l1, _mm512_set1_epi32(low[2 * t + 1]), hi[t]);
      }
      __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8), _mm512_add_epi32(l0, l1));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(a[i].scale[b])), acc[i]);
      acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(a[i].sum[b]), acc[i]);
    }
  }
  for (int i = 0; i < n; i++) _mm512_storeu_ps(y + i * stride, acc[i]);
}

/* 16 rows of an 8-bit matrix times n tokens' activations, as group_8bit_one computes each. */
static void group_8bit_tokens(const uint8_t *p, int blocks, const activations *a, int n, float *y, size_t stride) {
  __m512 acc[MAX_BATCH];
  for (int i = 0; i < n; i++) acc[i] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  for (int b = 0; b < blocks; b++, p += BYTES_8BIT) {
    prefetch(p + PREFETCH_BLOCKS * BYTES_8BIT, BYTES_8BIT);
    __m512i w[8], shifted[8];
    for (int j = 0; j < 8; j++) { w[j] = _mm512_loadu_si512(p + 64 * j); shifted[j] = _mm512_xor_si512(w[j], flip); }
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 512)));
    for (int i = 0; i < n; i++) {
      const int32_t *high = a[i].high + b * 8, *low = a[i].low + b * 8;
      __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
      for (int j = 0; j < 8; j += 2) {
        h0 = _mm512_dpbusd_epi32(h0, shifted[j], _mm512_set1_epi32(high[j]));
        h1 = _mm512_dpbusd_epi32(h1, shifted[j + 1], _mm512_set1_epi32(high[j + 1]));
        l0 = _mm512_dpbusd_epi32(l0, _mm512_set1_epi32(low[j]), w[j]);
        l1 = _mm512_dpbusd_epi32(l1, _mm512_set1_epi32(low[j + 1]), w[j + 1]);
      }
      __m512i high_dot = _mm512_sub_epi32(_mm512_add_epi32(h0, h1), _mm512_set1_epi32(128 * a[i].high_sum[b]));
      __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(high_dot, 8), _mm512_add_epi32(l0, l1));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(a[i].scale[b])), acc[i]);
    }
  }
  for (int i = 0; i < n; i++) _mm512_storeu_ps(y + i * stride, acc[i]);
}

/* One token (decoding) takes the kernel that keeps its accumulator in a register: the loop over tokens
 * halved decode speed where it ran for one. */
static void group_4bit(const uint8_t *p, int blocks, const activations *a, int n, float *y, size_t stride) {
  if (n == 1) group_4bit_one(p, blocks, a, y);
  else group_4bit_tokens(p, blocks, a, n, y, stride);
}
static void group_8bit(const uint8_t *p, int blocks, const activations *a, int n, float *y, size_t stride) {
  if (n == 1) group_8bit_one(p, blocks, a, y);
  else group_8bit_tokens(p, blocks, a, n, y, stride);
}

#else
/* AVX2: vpmaddubsw multiplies u8 by s8 into 16-bit pair sums, vpmaddwd adds pairs into 32 bits. The
 * 64-byte chunk of 16 rows is two 32-byte halves of 8 rows each. */
static inline __m256i pairs_to_32(__m256i sums16) { return _mm256_madd_epi16(sums16, _mm256_set1_epi16(1)); }

static void group_4bit_one(const uint8_t *p, int blocks, const activations *a, float *y) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const __m256i nibble = _mm256_set1_epi8(15);
  for (int b = 0; b < blocks; b++, p += BYTES_4BIT) {
    prefetch(p + PREFETCH_BLOCKS * BYTES_4BIT, BYTES_4BIT);
    const int32_t *high = a->high + b * 8, *low = a->low + b * 8;
    __m256i h[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, l[2] = {h[0], h[0]};
    for (int t = 0; t < 4; t++) {
      __m256i h0 = _mm256_set1_epi32(high[2 * t]), h1 = _mm256_set1_epi32(high[2 * t + 1]);
      __m256i l0 = _mm256_set1_epi32(low[2 * t]), l1 = _mm256_set1_epi32(low[2 * t + 1]);
      for (int half = 0; half < 2; half++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * t + 32 * half));
        __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        /* |pair sums| <= 2 * 15 * 127 twice: within 16 bits */
        h[half] = _mm256_add_epi32(h[half], pairs_to_32(_mm256_add_epi16(_mm256_maddubs_epi16(lo, h0), _mm256_maddubs_epi16(hi, h1))));
        l[half] = _mm256_add_epi32(l[half], pairs_to_32(_mm256_add_epi16(_mm256_maddubs_epi16(l0, lo), _mm256_maddubs_epi16(l1, hi))));
      }
    }
    for (int half = 0; half < 2; half++) {
      __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(h[half], LOW_BITS), l[half]);
      __m256 scale = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 256 + 16 * half))), _mm256_set1_ps(a->scale[b]));
      acc[half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[half]);
      acc[half] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 288 + 16 * half))), _mm256_set1_ps(a->sum[b]), acc[half]);
    }
  }
  _mm256_storeu_ps(y, acc[0]); _mm256_storeu_ps(y + 8, acc[1]);
}

/* The signed weights meet the signed high plane as |q| times the plane with q's sign. */
static void group_8bit_one(const uint8_t *p, int blocks, const activations *a, float *y) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int b = 0; b < blocks; b++, p += BYTES_8BIT) {
    prefetch(p + PREFETCH_BLOCKS * BYTES_8BIT, BYTES_8BIT);
    const int32_t *high = a->high + b * 8, *low = a->low + b * 8;
    __m256i h[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, l[2] = {h[0], h[0]};
    for (int j = 0; j < 8; j++) {
      __m256i hj = _mm256_set1_epi32(high[j]), lj = _mm256_set1_epi32(low[j]);
      for (int half = 0; half < 2; half++) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(p + 64 * j + 32 * half));
        h[half] = _mm256_add_epi32(h[half], pairs_to_32(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(hj, w))));
        l[half] = _mm256_add_epi32(l[half], pairs_to_32(_mm256_maddubs_epi16(lj, w)));
      }
    }
    for (int half = 0; half < 2; half++) {
      __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(h[half], LOW_BITS), l[half]);
      __m256 scale = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 512 + 16 * half))), _mm256_set1_ps(a->scale[b]));
      acc[half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[half]);
    }
  }
  _mm256_storeu_ps(y, acc[0]); _mm256_storeu_ps(y + 8, acc[1]);
}

/* A prompt's tokens one after the other: the group's weights stay in cache between them. */
static void group_4bit(const uint8_t *p, int blocks, const activations *a, int n, float *y, size_t stride) {
  for (int i = 0; i < n; i++) group_4bit_one(p, blocks, &a[i], y + i * stride);
}
static void group_8bit(const uint8_t *p, int blocks, const activations *a, int n, float *y, size_t stride) {
  for (int i = 0; i < n; i++) group_8bit_one(p, blocks, &a[i], y + i * stride);
}
#endif

static size_t group_bytes(const matrix *w) { return (size_t)(w->cols / 32) * (w->kind == KIND_4BIT ? BYTES_4BIT : BYTES_8BIT); }

/* Y = W A for n tokens' activations (row i of Y at y + i * stride), the row groups shared out among the
 * team's threads (inside a parallel region). */
static void matmul(const matrix *w, const activations *a, int n, float *y, int stride) {
  int blocks = w->cols / 32, groups = w->rows / GROUP;
  size_t bytes = group_bytes(w);
  #pragma omp for schedule(static)
  for (int g = 0; g < groups; g++) {
    if (w->kind == KIND_4BIT) group_4bit(w->data + g * bytes, blocks, a, n, y + g * GROUP, stride);
    else group_8bit(w->data + g * bytes, blocks, a, n, y + g * GROUP, stride);
  }
}

/* One row of a repacked matrix, dequantized (the embedding lookup). */
static void dequantized_row(const matrix *w, int r, float *out) {
  int blocks = w->cols / 32, lane = r % GROUP;
  const uint8_t *group = w->data + (size_t)(r / GROUP) * group_bytes(w);
  for (int b = 0; b < blocks; b++) {
    if (w->kind == KIND_4BIT) {
      const uint8_t *p = group + (size_t)b * BYTES_4BIT;
      float d = _cvtsh_ss(*(const uint16_t *)(p + 256 + 2 * lane)), m = _cvtsh_ss(*(const uint16_t *)(p + 288 + 2 * lane));
      for (int e = 0; e < 32; e++) {
        uint8_t byte = p[64 * (e / 8) + 4 * lane + e % 4];
        out[b * 32 + e] = d * ((e % 8) < 4 ? byte & 15 : byte >> 4) + m;
      }
    } else {
      const uint8_t *p = group + (size_t)b * BYTES_8BIT;
      float d = _cvtsh_ss(*(const uint16_t *)(p + 512 + 2 * lane));
      for (int e = 0; e < 32; e++) out[b * 32 + e] = d * (int8_t)p[64 * (e / 4) + 4 * lane + e % 4];
    }
  }
}

static void rms_norm(float *out, const float *x, const float *w, int n, float eps) {
  float s = 0; for (int i = 0; i < n; i++) s += x[i] * x[i];
  float r = 1.f / sqrtf(s / n + eps);
  for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* Llama's rotation as GGUF stores Q and K: adjacent pairs within each head. */
static void rope(const model *m, float *v, int heads, int token) {
  const float *cos = m->cos + token * m->head_dim / 2, *sin = m->sin + token * m->head_dim / 2;
  for (int h = 0; h < heads; h++)
    for (int i = 0; i < m->head_dim / 2; i++) {
      float *p = v + h * m->head_dim + 2 * i, a = p[0], b = p[1];
      p[0] = a * cos[i] - b * sin[i]; p[1] = a * sin[i] + b * cos[i];
    }
}

/* A dot product vectorized (the compiler keeps a float sum in order, so it would not). */
static float dot(const float *a, const float *b, int n) {
  int i = 0;
#if VNNI
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  float s = _mm512_reduce_add_ps(acc);
#else
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q)); q = _mm_add_ss(q, _mm_movehdup_ps(q));
  float s = _mm_cvtss_f32(q);
#endif
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

/* One head of one token at `pos`: its query is row `token` of the QKV rows, its keys and values the
 * cache's positions 0 .. pos. */
static void attention_head(const model *m, int l, int h, int token, int pos) {
  int kv = m->kv_heads * m->head_dim, g = h / (m->heads / m->kv_heads), hd = m->head_dim;
  const float *q = m->qkv + (size_t)token * (m->dim + 2 * kv) + h * hd;
  float *scores = m->scores + (size_t)h * m->context, top = -INFINITY, total = 0, scale = 1.f / sqrtf((float)hd);
  const float *keys = m->k_cache + (size_t)l * m->context * kv + g * hd, *values = m->v_cache + (size_t)l * m->context * kv + g * hd;
  for (int t = 0; t <= pos; t++) {
    scores[t] = dot(q, keys + (size_t)t * kv, hd) * scale;
    top = fmaxf(top, scores[t]);
  }
  for (int t = 0; t <= pos; t++) { scores[t] = expf(scores[t] - top); total += scores[t]; }
  float *out = m->attn + (size_t)token * m->dim + h * hd;
  for (int i = 0; i < hd; i++) out[i] = 0;
  for (int t = 0; t <= pos; t++) {
    float p = scores[t] / total;
    for (int i = 0; i < hd; i++) out[i] += p * values[(size_t)t * kv + i];
  }
}

static void matmul_parts(const matrix *parts, int count, const activations *a, int n, float *y, int stride) {
  for (int i = 0; i < count; i++) { matmul(&parts[i], a, n, y, stride); y += parts[i].rows; }
}

/* Norm and quantize each of n rows (inside a single). */
static void normed(model *m, const float *weight, int n) {
  for (int i = 0; i < n; i++) {
    rms_norm(m->xn + (size_t)i * m->dim, m->x + (size_t)i * m->dim, weight, m->dim, m->eps);
    quantize(&m->a_dim[i], m->xn + (size_t)i * m->dim, m->dim);
  }
}

static void layer_step(model *m, int l, int n, int pos) {
  const layer *y = &m->layer[l];
  int kv = m->kv_heads * m->head_dim, qkv = m->dim + 2 * kv;
  #pragma omp single
  normed(m, y->attn_norm, n);
  matmul_parts(y->qkv, y->n_qkv, m->a_dim, n, m->qkv, qkv);
  #pragma omp single
  for (int i = 0; i < n; i++) {
    float *row = m->qkv + (size_t)i * qkv;
    rope(m, row, m->heads, i); rope(m, row + m->dim, m->kv_heads, i);
    memcpy(m->k_cache + ((size_t)l * m->context + pos + i) * kv, row + m->dim, kv * sizeof(float));
    memcpy(m->v_cache + ((size_t)l * m->context + pos + i) * kv, row + m->dim + kv, kv * sizeof(float));
  }
  #pragma omp for schedule(static)
  for (int h = 0; h < m->heads; h++)
    for (int i = 0; i < n; i++) attention_head(m, l, h, i, pos + i);
  #pragma omp single
  for (int i = 0; i < n; i++) quantize(&m->a_dim[i], m->attn + (size_t)i * m->dim, m->dim);
  matmul(&y->out, m->a_dim, n, m->proj, m->dim);
  #pragma omp single
  {
    for (size_t i = 0; i < (size_t)n * m->dim; i++) m->x[i] += m->proj[i];
    normed(m, y->ffn_norm, n);
  }
  matmul_parts(y->gate_up, y->n_gate_up, m->a_dim, n, m->gate_up, 2 * m->ffn);
  #pragma omp for simd collapse(2) schedule(static)  /* both threads share even one token's */
  for (int i = 0; i < n; i++)
    for (int j = 0; j < m->ffn; j++) {
      float gate = m->gate_up[(size_t)i * 2 * m->ffn + j], up = m->gate_up[(size_t)i * 2 * m->ffn + m->ffn + j];
      m->hidden[(size_t)i * m->ffn + j] = gate / (1.f + expf(-gate)) * up;
    }
  #pragma omp single
  for (int i = 0; i < n; i++) quantize(&m->a_ffn[i], m->hidden + (size_t)i * m->ffn, m->ffn);
  matmul(&y->down, m->a_ffn, n, m->proj, m->dim);
  #pragma omp single
  for (size_t i = 0; i < (size_t)n * m->dim; i++) m->x[i] += m->proj[i];
}

int ng_max_batch(void) { return MAX_BATCH; }

/* n (1 .. MAX_BATCH) tokens at positions pos .. pos + n - 1, the cache holding positions 0 .. pos - 1
 * of this sequence. logits: every token's (n rows of vocab_rows) where `every`, else the last one's;
 * none where it is NULL. */
void ng_forward(model *m, const int *tokens, int n, int pos, float *logits, int every) {
  for (int i = 0; i < n; i++) {
    dequantized_row(&m->embedding, tokens[i], m->x + (size_t)i * m->dim);
    for (int j = 0; j < m->head_dim / 2; j++) {
      float theta = (pos + i) * powf(m->rope_base, -2.f * j / m->head_dim);
      m->cos[i * m->head_dim / 2 + j] = cosf(theta); m->sin[i * m->head_dim / 2 + j] = sinf(theta);
    }
  }
  int first = every ? 0 : n - 1, rows = every ? n : 1;
  #pragma omp parallel num_threads(m->threads)
  {
    for (int l = 0; l < m->layers; l++) layer_step(m, l, n, pos);
    if (logits) {  /* NULL: a prompt's pass before its last, which only fills the cache */
      #pragma omp single
      for (int i = first; i < n; i++) {
        rms_norm(m->xn + (size_t)i * m->dim, m->x + (size_t)i * m->dim, m->out_norm, m->dim, m->eps);
        quantize(&m->a_dim[i], m->xn + (size_t)i * m->dim, m->dim);
      }
      matmul(&m->head, m->a_dim + first, rows, logits, m->vocab_rows);
    }
  }
}

/* The logits (vocab_rows of them) of the token after `token` at position `pos`. */
void ng_step(model *m, int token, int pos, float *logits) { ng_forward(m, &token, 1, pos, logits, 1); }

void ng_free(model *m) {
  if (!m) return;
  for (int i = 0; i < MAX_BATCH; i++) { activations_free(&m->a_dim[i]); activations_free(&m->a_ffn[i]); }
  float *buffers[] = {m->k_cache, m->v_cache, m->x, m->xn, m->qkv, m->attn, m->proj, m->gate_up, m->hidden, m->scores, m->cos, m->sin};
  for (size_t i = 0; i < sizeof buffers / sizeof *buffers; i++) free(buffers[i]);
  free(m->layer); free(m);
}

/* The contract. Nothing below checks what it is given (the loops are the hot path): the caller,
 * engines/native_gguf/contract.py, checks each of these in Python before any of it reaches C, item for
 * item in the same order.
 * 1. Counts are positive whole numbers that fit their C types: layers <= 4096; dim, ffn, heads,
 *    kv_heads <= 2^20 (so dim + 2 kv and 2 ffn stay ints); vocab_rows <= 2^24 (the vocabulary padded
 *    to 16); context <= 2^20 (positions are ints, the cache's size a size_t); 1 <= threads <= 1024.
 *    ng_forward's n is 1 .. MAX_BATCH, pos >= 0 and pos + n <= context; tokens are 0 .. vocab - 1.
 * 2. Shapes: heads divides dim, head_dim = dim / heads is even, kv_heads divides heads; dim, ffn and
 *    kv_heads * head_dim are multiples of 32 (whole activation blocks; rows whole 16-row groups).
 * 3. rope_base and eps are finite and > 0 as floats, rope_base >= 1 (0, NaN or Inf makes every logit
 *    NaN; a base below 1 makes frequencies above 1 and Inf angles).
 * 4. Tensors: each layer's q [dim rows], k and v [kv_heads * head_dim rows], out [dim rows], gate and up
 *    [ffn rows] of dim columns, down [dim rows] of ffn columns; embedding and head [vocab_rows rows] of
 *    dim columns; attn_norm, ffn_norm and out_norm `dim` finite floats each. Matrices are Q4_0, Q4_1 or
 *    Q8_0 repacked as the header describes (KIND_4BIT / KIND_8BIT, group-blocks of 320 / 544 bytes,
 *    rows / 16 groups of cols / 32 blocks), and live until ng_free.
 * 5. The file's tensor data lay inside the file, aligned to its general.alignment, none overlapping.
 * 6. Block scales (and Q4_1's offsets, Q4_0's -8 x scale) are finite f16 numbers.
 * 7. The KV cache (2 x layers x context x kv_heads x head_dim floats) fits the machine's memory.
 * NULL where memory runs out. */
model *ng_new(int layers, int dim, int ffn, int heads, int kv_heads, int vocab_rows, int context, float rope_base, float eps, int threads) {
  model *m = calloc(1, sizeof(model));
  if (!m) return NULL;
  *m = (model){.layers = layers, .dim = dim, .ffn = ffn, .heads = heads, .kv_heads = kv_heads, .head_dim = dim / heads,
               .vocab_rows = vocab_rows, .context = context, .threads = threads, .rope_base = rope_base, .eps = eps};
  size_t kv = (size_t)kv_heads * m->head_dim, cache = (size_t)layers * context * kv * sizeof(float);
  m->layer = calloc(layers, sizeof(layer));
  m->k_cache = zeroed(cache); m->v_cache = zeroed(cache);
  size_t rows = MAX_BATCH * sizeof(float);
  m->x = zeroed(dim * rows); m->xn = zeroed(dim * rows); m->attn = zeroed(dim * rows); m->proj = zeroed(dim * rows);
  m->qkv = zeroed((dim + 2 * kv) * rows); m->gate_up = zeroed(2 * (size_t)ffn * rows); m->hidden = zeroed((size_t)ffn * rows);
  m->scores = zeroed((size_t)heads * context * 4); m->cos = zeroed(m->head_dim / 2 * rows); m->sin = zeroed(m->head_dim / 2 * rows);
  int ok = m->layer && m->k_cache && m->v_cache && m->x && m->xn && m->attn && m->proj && m->qkv && m->gate_up &&
           m->hidden && m->scores && m->cos && m->sin;
  for (int i = 0; i < MAX_BATCH; i++) ok = ok && activations_new(&m->a_dim[i], dim) && activations_new(&m->a_ffn[i], ffn);
  if (!ok) { ng_free(m); return NULL; }
  return m;
}

void ng_layer(model *m, int l, const float *attn_norm, const float *ffn_norm, const int *kinds, const int *rows,
              const uint8_t *const *data) {
  /* kinds, rows, data: the layer's matrices in order q|k|v (or fused qkv), out, gate|up (or fused), down;
   * a fused entry's rows count every part. */
  layer *y = &m->layer[l];
  int i = 0, qkv_rows = m->dim + 2 * m->kv_heads * m->head_dim;
  y->attn_norm = attn_norm; y->ffn_norm = ffn_norm;
  y->n_qkv = rows[0] == qkv_rows ? 1 : 3;
  for (int p = 0; p < y->n_qkv; p++, i++) y->qkv[p] = (matrix){kinds[i], rows[i], m->dim, data[i]};
  y->out = (matrix){kinds[i], rows[i], m->dim, data[i]}; i++;
  y->n_gate_up = rows[i] == 2 * m->ffn ? 1 : 2;
  for (int p = 0; p < y->n_gate_up; p++, i++) y->gate_up[p] = (matrix){kinds[i], rows[i], m->dim, data[i]};
  y->down = (matrix){kinds[i], rows[i], m->ffn, data[i]};
}

void ng_head(model *m, const float *out_norm, int embedding_kind, const uint8_t *embedding, int head_kind, const uint8_t *head) {
  m->out_norm = out_norm;
  m->embedding = (matrix){embedding_kind, m->vocab_rows, m->dim, embedding};
  m->head = (matrix){head_kind, m->vocab_rows, m->dim, head};
}

/* Which path this library was compiled to: 1 AVX-512 VNNI (16-bit activations), 0 AVX2 (15-bit). */
int ng_vnni(void) { return VNNI; }
