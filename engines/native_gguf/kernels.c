/* The native GGUF engine's decoder: a Llama or Qwen2 forward pass (one token a step when decoding, up to
 * 64 a pass when reading a prompt) over a GGUF file's own Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / K-quant blocks
 * (engines/native_gguf/model.py repacks them; the bytes a token reads are the file's). Built on the machine that runs it
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
 *   5-bit group-block (384 bytes, Q5_0 and Q5_1): the 4-bit layout's 256 bytes of nibbles, then a 64-byte bit plane
 *     of the values' fifth bits (bit 2t + h of byte 4i + k is that of the nibble h of byte 64t + 4i + k: one shift
 *     and one mask put nibble vector v's bits in place), then 16 f16 scales d and 16 f16 offsets m (Q5_0 carried as
 *     m = -16d); the value is d * q + m. 5 bits a value as the file's, not 8: a token reads half the bytes.
 * K-quants (Q4_K, Q5_K, Q6_K) carry a sub-block's scale as a 6- or 8-bit integer times an f16 super-block
 * scale: exact as an f32 number (at most 19 significant bits), never as an f16 one. So:
 *   4-bit K group-block (384 bytes, Q4_K): the 4-bit layout with 16 f32 scales d and 16 f32 offsets m.
 *   5-bit K group-block (448 bytes, Q5_K): the 5-bit layout with 16 f32 scales d and 16 f32 offsets m.
 *   6-bit K group-block (512 bytes, Q6_K): nibbles and a fifth-bit plane as the 5-bit layout, a sixth-bit plane
 *     likewise, then f32 scales d for each half of the block (Q6_K's sub-blocks are 16 values): 16 d of elements
 *     0-15, 16 of 16-31; the value is d * (q - 32), q unsigned.
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

enum { GROUP = 16, BYTES_4BIT = 320, BYTES_8BIT = 544, BYTES_4BIT_K = 384, BYTES_6BIT_K = 512, BYTES_5BIT = 384,
       BYTES_5BIT_K = 448, PREFETCH_BLOCKS = 32 };
/* Tokens one pass takes (a prompt is read in such chunks): a group's weights, read from memory for the
 * first, are still in cache for the others (64: a 1,024-token prompt streams the weights from memory 16
 * times, not 64, and meets a quarter of the barriers); the kernels take them TOKEN_TILE at a time (one
 * accumulator register each). */
enum { MAX_BATCH = 64, TOKEN_TILE = 16 };
enum { KIND_4BIT = 0, KIND_8BIT = 1, KIND_4BIT_K = 2, KIND_6BIT_K = 3, KIND_5BIT = 4, KIND_5BIT_K = 5 };

typedef struct { int kind, rows, cols; const uint8_t *data; } matrix;
typedef struct {
  const float *attn_norm, *ffn_norm, *qkv_bias;  /* qkv_bias: NULL, or q|k|v's biases (Qwen2) */
  int n_qkv, n_gate_up;  /* 1 where the parts are fused (one kind), else 3 and 2 */
  matrix qkv[3], gate_up[2], out, down;
} layer;

/* A vector quantized per block of 32: x = scale * (2^LOW_BITS * high + low), high int8, low uint8; the
 * sums of each block and of each half (half_sum, the 6-bit K offsets' terms) of x as quantized. */
typedef struct { float *sum, *half_sum, *scale; int32_t *high_sum, *high, *low; } activations;

typedef struct {
  int layers, dim, ffn, heads, kv_heads, head_dim, vocab_rows, context, threads;
  int kv_half;  /* the KV cache in f16 (1) or f32 (0) */
  int neox;     /* rotation of each head's halves (Qwen2, 1) or of adjacent pairs (Llama as GGUF stores it, 0) */
  int positions;  /* the cache's positions: context rounded up to whole tiles of TILE */
  float rope_base, eps;
  layer *layer;
  matrix embedding, head;
  const float *out_norm;
  void *k_cache, *v_cache;  /* f16 or f32 (kv_half), laid out as `attend` reads them */
  /* MAX_BATCH rows each (one a token), but the scores (one row of `positions` a thread) */
  float *x, *xn, *qkv, *attn, *proj, *gate_up, *hidden, *scores, *cos, *sin;
  activations a_dim[MAX_BATCH], a_ffn[MAX_BATCH];
} model;

static void *zeroed(size_t bytes) { void *p = aligned_alloc(64, (bytes + 63) / 64 * 64); if (p) memset(p, 0, (bytes + 63) / 64 * 64); return p; }

static int activations_new(activations *a, int n) {
  int blocks = n / 32;
  a->sum = zeroed(blocks * 4); a->half_sum = zeroed(blocks * 8); a->scale = zeroed(blocks * 4); a->high_sum = zeroed(blocks * 4);
  a->high = zeroed(blocks * 32); a->low = zeroed(blocks * 32);
  return a->sum && a->half_sum && a->scale && a->high_sum && a->high && a->low;
}
static void activations_free(activations *a) { free(a->sum); free(a->half_sum); free(a->scale); free(a->high_sum); free(a->high); free(a->low); }

/* A block whose largest value is below this quantizes to zeros: QMAX / top would overflow to Inf (a
 * block of subnormal activations, e.g. a near-zero norm weight), and Inf x 0 is NaN, which converts to
 * INT_MIN and overflows the plane sums. One compare a block; every block of normal numbers is unchanged. */
#define TINY ((float)QMAX / FLT_MAX)
/* A block holding Inf or NaN (a file whose numbers overflow f32 on the way) has integer planes of zeros
 * and its scale and sum not finite: the logits come out NaN, never an integer overflow's undefined sums. */

#if VNNI
static void quantize(activations *a, const float *x, int n) {
  const __m512i byte = _mm512_set1_epi32(255);
  for (int b = 0; b < n / 32; b++) {
    __m512 v0 = _mm512_loadu_ps(x + b * 32), v1 = _mm512_loadu_ps(x + b * 32 + 16);
    float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    a->half_sum[2 * b] = _mm512_reduce_add_ps(v0); a->half_sum[2 * b + 1] = _mm512_reduce_add_ps(v1);
    a->sum[b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    a->scale[b] = top / QMAX;
    if (!(top <= FLT_MAX)) v0 = v1 = _mm512_setzero_ps();
    __m512 inverse = _mm512_set1_ps(top > TINY && top <= FLT_MAX ? (float)QMAX / top : 0.f);
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
    float halves[2] = {0, 0};
    for (int i = 0; i < 32; i++) { top = fmaxf(top, fabsf(v[i])); sum += v[i]; halves[i / 16] += v[i]; }
    a->sum[b] = sum; a->half_sum[2 * b] = halves[0]; a->half_sum[2 * b + 1] = halves[1]; a->scale[b] = top / QMAX;
    float inverse = top > TINY && top <= FLT_MAX ? QMAX / top : 0.f;
    int8_t *high = (int8_t *)(a->high + b * 8); uint8_t *low = (uint8_t *)(a->low + b * 8);
    int high_sum = 0;
    for (int i = 0; i < 32; i++) {
      int q = inverse > 0 ? (int)lrintf(v[i] * inverse) : 0;
      high[i] = (int8_t)(q >> LOW_BITS); low[i] = (uint8_t)(q & ((1 << LOW_BITS) - 1)); high_sum += high[i];
    }
    a->high_sum[b] = high_sum;
  }
}

#endif

static void prefetch(const uint8_t *p, int bytes) {
  for (int c = 0; c < bytes; c += 64) _mm_prefetch((const char *)p + c, _MM_HINT_T0);
}

/* Where a nibble group-block's parts start: the nibbles, `extra` 64-byte bit planes (5-bit: one; 6-bit K:
 * two), then 16 scales d and 16 offsets m, f16 or f32 (K-quants). The 6-bit K group-block has 32 d, no m. */
static inline int scales_at(const int extra) { return 256 + 64 * extra; }
static inline int offsets_at(const int extra, const int f32) { return scales_at(extra) + (f32 ? 64 : 32); }
static inline int nibble_bytes(const int extra, const int f32) { return offsets_at(extra, f32) + (f32 ? 64 : 32); }

#if VNNI
/* A group-block's 16 scales (or offsets) at p: f16, or f32 (K-quants). */
static inline __m512 lanes16(const uint8_t *p, const int f32) {
  return f32 ? _mm512_loadu_ps(p) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* q with bit `to` of each byte set from bit v of the plane's byte (v: the nibble vector, 2t + h):
 * one shift and one vpternlogd (q | (shifted & bit)). */
static inline __m512i with_bit(__m512i q, __m512i plane, int v, int to) {
  __m512i moved = v < to ? _mm512_slli_epi16(plane, to - v) : _mm512_srli_epi16(plane, v - to);
  return _mm512_ternarylogic_epi32(q, moved, _mm512_set1_epi8((char)(1 << to)), 0xF8);
}

/* Chunk t's two value vectors (each row's elements 8t + k and 8t + 4 + k): its nibbles, with the fifth
 * (extra >= 1) and sixth (extra == 2) bits from the planes after them. */
static inline __attribute__((always_inline)) void unpacked(const uint8_t *p, int t, const int extra, __m512i *lo, __m512i *hi) {
  const __m512i nibble = _mm512_set1_epi8(15);
  __m512i v = _mm512_loadu_si512(p + 64 * t);
  *lo = _mm512_and_si512(v, nibble); *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  for (int plane = 0; plane < extra; plane++) {
    __m512i bits = _mm512_loadu_si512(p + 256 + 64 * plane);
    *lo = with_bit(*lo, bits, 2 * t, 4 + plane); *hi = with_bit(*hi, bits, 2 * t + 1, 4 + plane);
  }
}

/* 16 rows of a 4- or 5-bit (extra: 0 or 1) matrix times one token's activations (decoding); f32: the K
 * group-block. */
static inline __attribute__((always_inline)) void group_nibbles_one_(const uint8_t *p, int blocks, const activations *a, float *y,
                                                                     const int f32, const int extra) {
  __m512 acc = _mm512_setzero_ps();
  const int bytes = nibble_bytes(extra, f32);
  for (int b = 0; b < blocks; b++, p += bytes) {
    prefetch(p + PREFETCH_BLOCKS * bytes, bytes);
    const int32_t *high = a->high + b * 8, *low = a->low + b * 8;
    __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
    for (int t = 0; t < 4; t++) {
      __m512i lo, hi;
      unpacked(p, t, extra, &lo, &hi);
      h0 = _mm512_dpbusd_epi32(h0, lo, _mm512_set1_epi32(high[2 * t]));
      h1 = _mm512_dpbusd_epi32(h1, hi, _mm512_set1_epi32(high[2 * t + 1]));
      l0 = _mm512_dpbusd_epi32(l0, _mm512_set1_epi32(low[2 * t]), lo);
      l1 = _mm512_dpbusd_epi32(l1, _mm512_set1_epi32(low[2 * t + 1]), hi);
    }
    __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8), _mm512_add_epi32(l0, l1));
    __m512 scale = _mm512_mul_ps(lanes16(p + scales_at(extra), f32), _mm512_set1_ps(a->scale[b]));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
    acc = _mm512_fmadd_ps(lanes16(p + offsets_at(extra, f32), f32), _mm512_set1_ps(a->sum[b]), acc);
  }
  _mm512_storeu_ps(y, acc);
}

/* 16 rows of a 6-bit K matrix (unsigned values up to 63) times one token's activations: each half of a
 * block its own integer dot product, scale d and offset -32d (exact in f32). */
static void group_6bit_k_one(const uint8_t *p, int blocks, const activations *a, float *y) {
  __m512 acc = _mm512_setzero_ps();
  const __m512 minus32 = _mm512_set1_ps(-32.f);
  for (int b = 0; b < blocks; b++, p += BYTES_6BIT_K) {
    prefetch(p + PREFETCH_BLOCKS * BYTES_6BIT_K, BYTES_6BIT_K);
    const int32_t *high = a->high + b * 8, *low = a->low + b * 8;
    for (int half = 0; half < 2; half++) {
      __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
      for (int t = 2 * half; t < 2 * half + 2; t++) {
        __m512i lo, hi;
        unpacked(p, t, 2, &lo, &hi);
        h0 = _mm512_dpbusd_epi32(h0, lo, _mm512_set1_epi32(high[2 * t]));
        h1 = _mm512_dpbusd_epi32(h1, hi, _mm512_set1_epi32(high[2 * t + 1]));
        l0 = _mm512_dpbusd_epi32(l0, _mm512_set1_epi32(low[2 * t]), lo);
        l1 = _mm512_dpbusd_epi32(l1, _mm512_set1_epi32(low[2 * t + 1]), hi);
      }
      __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), LOW_BITS), _mm512_add_epi32(l0, l1));
      __m512 d = _mm512_loadu_ps(p + 384 + 64 * half);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(a->scale[b])), acc);
      acc = _mm512_fmadd_ps(_mm512_mul_ps(d, minus32), _mm512_set1_ps(a->half_sum[2 * b + half]), acc);
    }
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

/* 16 rows of a 4- or 5-bit matrix times n tokens' activations (a prompt; row i of the result at y + i * stride).
 * A block's weights are unpacked once for all n; each token's arithmetic is group_nibbles_one_'s, in the
 * same order, so a prompt's logits are a decode's to the bit. */
static inline __attribute__((always_inline)) void group_nibbles_tokens_(const uint8_t *p, int blocks, const activations *a, int n, float *y,
                                                                        size_t stride, const int f32, const int extra) {
  __m512 acc[TOKEN_TILE];
  for (int i = 0; i < n; i++) acc[i] = _mm512_setzero_ps();
  const int bytes = nibble_bytes(extra, f32);
  for (int b = 0; b < blocks; b++, p += bytes) {
    prefetch(p + PREFETCH_BLOCKS * bytes, bytes);
    __m512i lo[4], hi[4];
    for (int t = 0; t < 4; t++) unpacked(p, t, extra, &lo[t], &hi[t]);
    __m512 d = lanes16(p + scales_at(extra), f32), m = lanes16(p + offsets_at(extra, f32), f32);
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

/* 16 rows of a 6-bit K matrix times n tokens' activations, as group_6bit_k_one computes each. */
static void group_6bit_k_tokens(const uint8_t *p, int blocks, const activations *a, int n, float *y, size_t stride) {
  __m512 acc[TOKEN_TILE];
  for (int i = 0; i < n; i++) acc[i] = _mm512_setzero_ps();
  for (int b = 0; b < blocks; b++, p += BYTES_6BIT_K) {
    prefetch(p + PREFETCH_BLOCKS * BYTES_6BIT_K, BYTES_6BIT_K);
    __m512i w[8];  /* w[2t]: chunk t's low nibbles' values, w[2t + 1] its high ones' */
    for (int t = 0; t < 4; t++) unpacked(p, t, 2, &w[2 * t], &w[2 * t + 1]);
    __m512 d[2] = {_mm512_loadu_ps(p + 384), _mm512_loadu_ps(p + 448)};
    __m512 m[2] = {_mm512_mul_ps(d[0], _mm512_set1_ps(-32.f)), _mm512_mul_ps(d[1], _mm512_set1_ps(-32.f))};
    for (int i = 0; i < n; i++) {
      const int32_t *high = a[i].high + b * 8, *low = a[i].low + b * 8;
      for (int half = 0; half < 2; half++) {
        __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
        for (int j = 4 * half; j < 4 * half + 4; j += 2) {
          h0 = _mm512_dpbusd_epi32(h0, w[j], _mm512_set1_epi32(high[j]));
          h1 = _mm512_dpbusd_epi32(h1, w[j + 1], _mm512_set1_epi32(high[j + 1]));
          l0 = _mm512_dpbusd_epi32(l0, _mm512_set1_epi32(low[j]), w[j]);
          l1 = _mm512_dpbusd_epi32(l1, _mm512_set1_epi32(low[j + 1]), w[j + 1]);
        }
        __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), LOW_BITS), _mm512_add_epi32(l0, l1));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d[half], _mm512_set1_ps(a[i].scale[b])), acc[i]);
        acc[i] = _mm512_fmadd_ps(m[half], _mm512_set1_ps(a[i].half_sum[2 * b + half]), acc[i]);
      }
    }
  }
  for (int i = 0; i < n; i++) _mm512_storeu_ps(y + i * stride, acc[i]);
}
/* 16 rows of an 8-bit matrix times n tokens' activations, as group_8bit_one computes each. */
static void group_8bit_tokens(const uint8_t *p, int blocks, const activations *a, int n, float *y, size_t stride) {
  __m512 acc[TOKEN_TILE];
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
#define NIBBLE_KERNEL(name, f32, extra)                                                                  \
  static void name(const uint8_t *p, int blocks, const activations *a, int n, float *y, size_t stride) { \
    if (n == 1) group_nibbles_one_(p, blocks, a, y, f32, extra);                                         \
    else group_nibbles_tokens_(p, blocks, a, n, y, stride, f32, extra);                                  \
  }
NIBBLE_KERNEL(group_4bit, 0, 0)
NIBBLE_KERNEL(group_4bit_k, 1, 0)
NIBBLE_KERNEL(group_5bit, 0, 1)
NIBBLE_KERNEL(group_5bit_k, 1, 1)
static void group_6bit_k(const uint8_t *p, int blocks, const activations *a, int n, float *y, size_t stride) {
  if (n == 1) group_6bit_k_one(p, blocks, a, y);
  else group_6bit_k_tokens(p, blocks, a, n, y, stride);
}
static void group_8bit(const uint8_t *p, int blocks, const activations *a, int n, float *y, size_t stride) {
  if (n == 1) group_8bit_one(p, blocks, a, y);
  else group_8bit_tokens(p, blocks, a, n, y, stride);
}

#else
/* AVX2: vpmaddubsw multiplies u8 by s8 into 16-bit pair sums, vpmaddwd adds pairs into 32 bits. The
 * 64-byte chunk of 16 rows is two 32-byte halves of 8 rows each. */
static inline __m256i pairs_to_32(__m256i sums16) { return _mm256_madd_epi16(sums16, _mm256_set1_epi16(1)); }

/* 8 of a group-block's scales (or offsets) at p: f16, or f32 (K-quants). */
static inline __m256 lanes8(const uint8_t *p, const int f32) {
  return f32 ? _mm256_loadu_ps((const float *)p) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* q with bit `to` of each byte set from bit v of the plane's byte (v: the nibble vector, 2t + h). */
static inline __m256i with_bit(__m256i q, __m256i plane, int v, int to) {
  __m256i moved = v < to ? _mm256_slli_epi16(plane, to - v) : _mm256_srli_epi16(plane, v - to);
  return _mm256_or_si256(q, _mm256_and_si256(moved, _mm256_set1_epi8((char)(1 << to))));
}

/* Rows 8 half .. 8 half + 7 of chunk t's two value vectors: nibbles, with the fifth (extra >= 1) and
 * sixth (extra == 2) bits from the planes after them. */
static inline __attribute__((always_inline)) void unpacked(const uint8_t *p, int t, int half, const int extra, __m256i *lo, __m256i *hi) {
  const __m256i nibble = _mm256_set1_epi8(15);
  __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * t + 32 * half));
  *lo = _mm256_and_si256(v, nibble); *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
  for (int plane = 0; plane < extra; plane++) {
    __m256i bits = _mm256_loadu_si256((const __m256i *)(p + 256 + 64 * plane + 32 * half));
    *lo = with_bit(*lo, bits, 2 * t, 4 + plane); *hi = with_bit(*hi, bits, 2 * t + 1, 4 + plane);
  }
}

/* 16 rows of a 4- or 5-bit (extra: 0 or 1) matrix times one token's activations; f32: the K group-block. */
static inline __attribute__((always_inline)) void group_nibbles_one_(const uint8_t *p, int blocks, const activations *a, float *y,
                                                                     const int f32, const int extra) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const int bytes = nibble_bytes(extra, f32), width = f32 ? 4 : 2;
  for (int b = 0; b < blocks; b++, p += bytes) {
    prefetch(p + PREFETCH_BLOCKS * bytes, bytes);
    const int32_t *high = a->high + b * 8, *low = a->low + b * 8;
    __m256i h[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, l[2] = {h[0], h[0]};
    for (int t = 0; t < 4; t++) {
      __m256i h0 = _mm256_set1_epi32(high[2 * t]), h1 = _mm256_set1_epi32(high[2 * t + 1]);
      __m256i l0 = _mm256_set1_epi32(low[2 * t]), l1 = _mm256_set1_epi32(low[2 * t + 1]);
      for (int half = 0; half < 2; half++) {
        __m256i lo, hi;
        unpacked(p, t, half, extra, &lo, &hi);
        /* |pair sums| <= 2 * 31 * 127 twice: within 16 bits */
        h[half] = _mm256_add_epi32(h[half], pairs_to_32(_mm256_add_epi16(_mm256_maddubs_epi16(lo, h0), _mm256_maddubs_epi16(hi, h1))));
        l[half] = _mm256_add_epi32(l[half], pairs_to_32(_mm256_add_epi16(_mm256_maddubs_epi16(l0, lo), _mm256_maddubs_epi16(l1, hi))));
      }
    }
    for (int half = 0; half < 2; half++) {
      __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(h[half], LOW_BITS), l[half]);
      __m256 scale = _mm256_mul_ps(lanes8(p + scales_at(extra) + 8 * width * half, f32), _mm256_set1_ps(a->scale[b]));
      acc[half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[half]);
      acc[half] = _mm256_fmadd_ps(lanes8(p + offsets_at(extra, f32) + 8 * width * half, f32), _mm256_set1_ps(a->sum[b]), acc[half]);
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

/* 16 rows of a 6-bit K matrix (unsigned values up to 63: |pair sums| <= 2 * 63 * 127 twice, within 16 bits)
 * times one token's activations, each half of a block with its own scale d and offset -32d. */
static void group_6bit_k_one(const uint8_t *p, int blocks, const activations *a, float *y) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const __m256 minus32 = _mm256_set1_ps(-32.f);
  for (int b = 0; b < blocks; b++, p += BYTES_6BIT_K) {
    prefetch(p + PREFETCH_BLOCKS * BYTES_6BIT_K, BYTES_6BIT_K);
    const int32_t *high = a->high + b * 8, *low = a->low + b * 8;
    for (int part = 0; part < 2; part++) {  /* elements 0-15, then 16-31 */
      __m256i h[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, l[2] = {h[0], h[0]};
      for (int t = 2 * part; t < 2 * part + 2; t++) {
        __m256i h0 = _mm256_set1_epi32(high[2 * t]), h1 = _mm256_set1_epi32(high[2 * t + 1]);
        __m256i l0 = _mm256_set1_epi32(low[2 * t]), l1 = _mm256_set1_epi32(low[2 * t + 1]);
        for (int half = 0; half < 2; half++) {
          __m256i lo, hi;
          unpacked(p, t, half, 2, &lo, &hi);
          h[half] = _mm256_add_epi32(h[half], pairs_to_32(_mm256_add_epi16(_mm256_maddubs_epi16(lo, h0), _mm256_maddubs_epi16(hi, h1))));
          l[half] = _mm256_add_epi32(l[half], pairs_to_32(_mm256_add_epi16(_mm256_maddubs_epi16(l0, lo), _mm256_maddubs_epi16(l1, hi))));
        }
      }
      for (int half = 0; half < 2; half++) {
        __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(h[half], LOW_BITS), l[half]);
        __m256 d = _mm256_loadu_ps((const float *)(p + 384 + 64 * part + 32 * half));
        acc[half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(a->scale[b])), acc[half]);
        acc[half] = _mm256_fmadd_ps(_mm256_mul_ps(d, minus32), _mm256_set1_ps(a->half_sum[2 * b + part]), acc[half]);
      }
    }
  }
  _mm256_storeu_ps(y, acc[0]); _mm256_storeu_ps(y + 8, acc[1]);
}

/* A prompt's tokens one after the other: the group's weights stay in cache between them. */
#define NIBBLE_KERNEL(name, f32, extra)                                                                  \
  static void name(const uint8_t *p, int blocks, const activations *a, int n, float *y, size_t stride) { \
    for (int i = 0; i < n; i++) group_nibbles_one_(p, blocks, &a[i], y + i * stride, f32, extra);       \
  }
NIBBLE_KERNEL(group_4bit, 0, 0)
NIBBLE_KERNEL(group_4bit_k, 1, 0)
NIBBLE_KERNEL(group_5bit, 0, 1)
NIBBLE_KERNEL(group_5bit_k, 1, 1)
static void group_6bit_k(const uint8_t *p, int blocks, const activations *a, int n, float *y, size_t stride) {
  for (int i = 0; i < n; i++) group_6bit_k_one(p, blocks, &a[i], y + i * stride);
}
static void group_8bit(const uint8_t *p, int blocks, const activations *a, int n, float *y, size_t stride) {
  for (int i = 0; i < n; i++) group_8bit_one(p, blocks, &a[i], y + i * stride);
}
#endif

static const int BLOCK_BYTES[] = {BYTES_4BIT, BYTES_8BIT, BYTES_4BIT_K, BYTES_6BIT_K, BYTES_5BIT, BYTES_5BIT_K};  /* by kind */
static size_t group_bytes(const matrix *w) { return (size_t)(w->cols / 32) * BLOCK_BYTES[w->kind]; }

/* Y = W A for n tokens' activations (row i of Y at y + i * stride), the row groups shared out among the
 * team's threads (inside a parallel region). */
static void matmul(const matrix *w, const activations *a, int n, float *y, int stride) {
  int blocks = w->cols / 32, groups = w->rows / GROUP;
  size_t bytes = group_bytes(w);
  #pragma omp for schedule(static)
  for (int g = 0; g < groups; g++) {
    const uint8_t *p = w->data + g * bytes;
    for (int i = 0; i < n; i += TOKEN_TILE) {
      int tile = n - i < TOKEN_TILE ? n - i : TOKEN_TILE;
      float *out = y + g * GROUP + (size_t)i * stride;
      switch (w->kind) {
        case KIND_4BIT: group_4bit(p, blocks, a + i, tile, out, stride); break;
        case KIND_8BIT: group_8bit(p, blocks, a + i, tile, out, stride); break;
        case KIND_4BIT_K: group_4bit_k(p, blocks, a + i, tile, out, stride); break;
        case KIND_5BIT: group_5bit(p, blocks, a + i, tile, out, stride); break;
        case KIND_5BIT_K: group_5bit_k(p, blocks, a + i, tile, out, stride); break;
        default: group_6bit_k(p, blocks, a + i, tile, out, stride);
      }
    }
  }
}

/* Lane `lane`'s element e of a nibble group-block (4, 5 or 6 bits: `extra` bit planes after the nibbles). */
static inline int nibble_value(const uint8_t *p, int lane, int e, int extra) {
  int t = e / 8, h = (e % 8) / 4, at = 4 * lane + e % 4, q = (p[64 * t + at] >> (4 * h)) & 15;
  for (int plane = 0; plane < extra; plane++) q |= ((p[256 + 64 * plane + at] >> (2 * t + h)) & 1) << (4 + plane);
  return q;
}

/* One row of a repacked matrix, dequantized (the embedding lookup). */
static void dequantized_row(const matrix *w, int r, float *out) {
  int blocks = w->cols / 32, lane = r % GROUP;
  const uint8_t *group = w->data + (size_t)(r / GROUP) * group_bytes(w);
  for (int b = 0; b < blocks; b++) {
    const uint8_t *p = group + (size_t)b * BLOCK_BYTES[w->kind];
    if (w->kind == KIND_6BIT_K) {
      const float *d = (const float *)(p + 384);
      for (int e = 0; e < 32; e++) {
        float scale = d[16 * (e / 16) + lane];
        out[b * 32 + e] = scale * nibble_value(p, lane, e, 2) + scale * -32.f;
      }
    } else if (w->kind != KIND_8BIT) {
      int k = w->kind == KIND_4BIT_K || w->kind == KIND_5BIT_K, extra = w->kind == KIND_5BIT || w->kind == KIND_5BIT_K;
      const uint8_t *ds = p + scales_at(extra), *ms = p + offsets_at(extra, k);
      float d = k ? ((const float *)ds)[lane] : _cvtsh_ss(((const uint16_t *)ds)[lane]);
      float m = k ? ((const float *)ms)[lane] : _cvtsh_ss(((const uint16_t *)ms)[lane]);
      for (int e = 0; e < 32; e++) out[b * 32 + e] = d * nibble_value(p, lane, e, extra) + m;
    } else {
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

/* Llama's rotation as GGUF stores Q and K: adjacent pairs within each head; Qwen2's (NEOX): element i
with element i + head_dim / 2. */
static void rope(const model *m, float *v, int heads, int token) {
  int half = m->head_dim / 2;
  const float *cos = m->cos + token * half, *sin = m->sin + token * half;
  for (int h = 0; h < heads; h++)
    for (int i = 0; i < half; i++) {
      float *p = v + h * m->head_dim + (m->neox ? i : 2 * i), *q = m->neox ? p + half : p + 1, a = *p, b = *q;
      *p = a * cos[i] - b * sin[i]; *q = a * sin[i] + b * cos[i];
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

/* The KV cache, per layer and key/value head: keys in tiles of TILE positions, dimension-major within
 * a tile (a tile's TILE scores are the lanes of one vector: no horizontal sums), values position-major;
 * f16 (half the bytes a token reads at long context) or f32. 256-bit vectors on both paths (Zen 4 and
 * Intel's cores split 512-bit ones into two, so the lanes are as fast; F16C converts). */
enum { TILE = 8 };

static inline size_t cache_base(const model *m, int l, int g) { return ((size_t)l * m->kv_heads + g) * m->positions * m->head_dim; }
static inline size_t key_at(const model *m, int t, int d) { return (size_t)(t / TILE) * m->head_dim * TILE + (size_t)d * TILE + t % TILE; }

static inline __m256 load8(const void *p, size_t i, const int half) {
  return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))) : _mm256_loadu_ps((const float *)p + i);
}
static inline float load1(const void *p, size_t i, const int half) { return half ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i]; }
/* f16 saturates at +-65504 (a key or value beyond it, which only a file of extreme scales makes, would
 * be Inf in the cache and NaN in every score). */
static inline void store1(void *p, size_t i, float v, const int half) {
  if (half) ((uint16_t *)p)[i] = _cvtss_sh(fminf(fmaxf(v, -65504.f), 65504.f), _MM_FROUND_TO_NEAREST_INT);
  else ((float *)p)[i] = v;
}

/* e^x for x <= 0 (softmax's), 0 below -87: a degree-6 polynomial on [-ln2/2, ln2/2] times 2^n, within
 * 2e-7 relative (libm's expf one value at a time was a tenth of a long prompt's time). */
static inline __m256 exp8(__m256 x) {
  __m256 gone = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  const float c[] = {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
  for (int k = 0; k < 6; k++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c[k]));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(gone, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* Query `q`'s scores against a tile of keys (TILE lanes). */
static inline __m256 tile_scores(const float *q, const void *tile, int hd, const int half) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int d = 0;
  for (; d + 4 <= hd; d += 4) {
    a0 = _mm256_fmadd_ps(_mm256_set1_ps(q[d]), load8(tile, (size_t)d * TILE, half), a0);
    a1 = _mm256_fmadd_ps(_mm256_set1_ps(q[d + 1]), load8(tile, (size_t)(d + 1) * TILE, half), a1);
    a2 = _mm256_fmadd_ps(_mm256_set1_ps(q[d + 2]), load8(tile, (size_t)(d + 2) * TILE, half), a2);
    a3 = _mm256_fmadd_ps(_mm256_set1_ps(q[d + 3]), load8(tile, (size_t)(d + 3) * TILE, half), a3);
  }
  for (; d < hd; d++) a0 = _mm256_fmadd_ps(_mm256_set1_ps(q[d]), load8(tile, (size_t)d * TILE, half), a0);
  return _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
}

/* Dimensions d0 .. d0 + 63 of the scores-weighted sum of `count` value rows: each row read once, its 64
 * dimensions 8 accumulators (a row at a time keeps the index arithmetic to one pointer step). */
static inline __attribute__((always_inline)) void weighted_64(const float *scores, const void *values, int count, int hd, int d0,
                                                              float inverse, float *out, const int half) {
  __m256 acc[8];
  for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
  size_t at = d0;
  for (int t = 0; t < count; t++, at += hd) {
    __m256 p = _mm256_set1_ps(scores[t]);
    for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(p, load8(values, at + 8 * c, half), acc[c]);
  }
  for (int c = 0; c < 8; c++) _mm256_storeu_ps(out + d0 + 8 * c, _mm256_mul_ps(acc[c], _mm256_set1_ps(inverse)));
}

static inline float sum8(__m256 v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q)); q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

/* Head h of token `token` (at position pos + token): its query is row `token` of the QKV rows, its keys
 * and values the cache's positions 0 .. pos + token; `scores` one row of `positions` floats. */
static inline __attribute__((always_inline)) void attend(const model *m, int l, int h, int token, int pos, float *scores, const int half) {
  int hd = m->head_dim, g = h / (m->heads / m->kv_heads), count = pos + token + 1, tiles = (count + TILE - 1) / TILE;
  const float *q = m->qkv + (size_t)token * (m->dim + 2 * m->kv_heads * hd) + h * hd;
  size_t base = cache_base(m, l, g);
  const char *keys = (const char *)m->k_cache + base * (half ? 2 : 4), *values = (const char *)m->v_cache + base * (half ? 2 : 4);
  __m256 scale = _mm256_set1_ps(1.f / sqrtf((float)hd)), top = _mm256_set1_ps(-INFINITY), total = _mm256_setzero_ps();
  for (int t = 0; t < tiles; t++)
    _mm256_storeu_ps(scores + t * TILE, _mm256_mul_ps(tile_scores(q, keys + (size_t)t * hd * TILE * (half ? 2 : 4), hd, half), scale));
  for (int t = count; t < tiles * TILE; t++) scores[t] = -INFINITY;  /* the last tile's positions past this token's */
  for (int t = 0; t < tiles; t++) top = _mm256_max_ps(top, _mm256_loadu_ps(scores + t * TILE));
  float highest = top[0];
  for (int k = 1; k < TILE; k++) highest = fmaxf(highest, top[k]);
  for (int t = 0; t < tiles; t++) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t * TILE), _mm256_set1_ps(highest)));
    _mm256_storeu_ps(scores + t * TILE, e); total = _mm256_add_ps(total, e);
  }
  float inverse = 1.f / sum8(total), *out = m->attn + (size_t)token * m->dim + h * hd;
  int d = 0;
  for (; d + 64 <= hd; d += 64) weighted_64(scores, values, count, hd, d, inverse, out, half);
  for (; d + 8 <= hd; d += 8) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int t = 0;
    for (; t + 4 <= count; t += 4) {
      a0 = _mm256_fmadd_ps(_mm256_set1_ps(scores[t]), load8(values, (size_t)t * hd + d, half), a0);
      a1 = _mm256_fmadd_ps(_mm256_set1_ps(scores[t + 1]), load8(values, (size_t)(t + 1) * hd + d, half), a1);
      a2 = _mm256_fmadd_ps(_mm256_set1_ps(scores[t + 2]), load8(values, (size_t)(t + 2) * hd + d, half), a2);
      a3 = _mm256_fmadd_ps(_mm256_set1_ps(scores[t + 3]), load8(values, (size_t)(t + 3) * hd + d, half), a3);
    }
    for (; t < count; t++) a0 = _mm256_fmadd_ps(_mm256_set1_ps(scores[t]), load8(values, (size_t)t * hd + d, half), a0);
    _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)), _mm256_set1_ps(inverse)));
  }
  for (; d < hd; d++) {
    float sum = 0;
    for (int t = 0; t < count; t++) sum += scores[t] * load1(values, (size_t)t * hd + d, half);
    out[d] = sum * inverse;
  }
}
static void attend_f16(const model *m, int l, int h, int token, int pos, float *scores) { attend(m, l, h, token, pos, scores, 1); }
static void attend_f32(const model *m, int l, int h, int token, int pos, float *scores) { attend(m, l, h, token, pos, scores, 0); }

/* Row `token`'s keys and values (rotated) into the cache at position `at`. */
static void cache_store(model *m, int l, const float *row, int at) {
  int hd = m->head_dim, kv = m->kv_heads * hd;
  for (int g = 0; g < m->kv_heads; g++) {
    size_t base = cache_base(m, l, g);
    for (int d = 0; d < hd; d++) {
      store1(m->k_cache, base + key_at(m, at, d), row[m->dim + g * hd + d], m->kv_half);
      store1(m->v_cache, base + (size_t)at * hd + d, row[m->dim + kv + g * hd + d], m->kv_half);
    }
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
  int qkv = m->dim + 2 * m->kv_heads * m->head_dim;
  #pragma omp single
  normed(m, y->attn_norm, n);
  matmul_parts(y->qkv, y->n_qkv, m->a_dim, n, m->qkv, qkv);
  #pragma omp single
  for (int i = 0; i < n; i++) {
    float *row = m->qkv + (size_t)i * qkv;
    if (y->qkv_bias) for (int j = 0; j < qkv; j++) row[j] += y->qkv_bias[j];
    rope(m, row, m->heads, i); rope(m, row + m->dim, m->kv_heads, i);
    cache_store(m, l, row, pos + i);
  }
  /* every (head, token) pair its own item: 9 heads shared by 2 threads leave neither idle */
  float *scores = m->scores + (size_t)omp_get_thread_num() * m->positions;
  #pragma omp for schedule(static)
  for (int p = 0; p < m->heads * n; p++) {
    if (m->kv_half) attend_f16(m, l, p / n, p % n, pos, scores);
    else attend_f32(m, l, p / n, p % n, pos, scores);
  }
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
  free(m->k_cache); free(m->v_cache);
  float *buffers[] = {m->x, m->xn, m->qkv, m->attn, m->proj, m->gate_up, m->hidden, m->scores, m->cos, m->sin};
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
 *    dim columns; attn_norm, ffn_norm and out_norm `dim` finite floats each; a Qwen2 layer's q|k|v bias
 *    (ng_layer_bias) dim + 2 x kv_heads x head_dim finite floats, none elsewhere. Matrices are Q4_0,
 *    Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K (K-quants' rows whole 256-value super-blocks) repacked as the header
 *    describes (KIND_4BIT / KIND_8BIT / KIND_4BIT_K / KIND_6BIT_K / KIND_5BIT / KIND_5BIT_K, group-blocks of
 *    320 / 544 / 384 / 512 / 384 / 448 bytes, rows / 16 groups of cols / 32 blocks), and live until ng_free.
 * 5. The file's tensor data lay inside the file, aligned to its general.alignment, none overlapping.
 * 6. Block scales (and Q4_1's and Q5_1's offsets, Q4_0's -8 x scale and Q5_0's -16 x scale, the K-quants'
 *    super-block scales and mins) are finite f16 numbers.
 * 7. The KV cache (2 x layers x positions x kv_heads x head_dim values of 2 bytes, kv_half, or 4) fits
 *    the machine's memory.
 * NULL where memory runs out. */
model *ng_new(int layers, int dim, int ffn, int heads, int kv_heads, int vocab_rows, int context, float rope_base, float eps,
              int threads, int kv_half, int neox) {
  model *m = calloc(1, sizeof(model));
  if (!m) return NULL;
  *m = (model){.layers = layers, .dim = dim, .ffn = ffn, .heads = heads, .kv_heads = kv_heads, .head_dim = dim / heads,
               .vocab_rows = vocab_rows, .context = context, .threads = threads, .rope_base = rope_base, .eps = eps,
               .kv_half = kv_half != 0, .neox = neox != 0, .positions = (context + TILE - 1) / TILE * TILE};
  size_t kv = (size_t)kv_heads * m->head_dim, cache = (size_t)layers * m->positions * kv * (m->kv_half ? 2 : 4);
  m->layer = calloc(layers, sizeof(layer));
  m->k_cache = zeroed(cache); m->v_cache = zeroed(cache);
  size_t rows = MAX_BATCH * sizeof(float);
  m->x = zeroed(dim * rows); m->xn = zeroed(dim * rows); m->attn = zeroed(dim * rows); m->proj = zeroed(dim * rows);
  m->qkv = zeroed((dim + 2 * kv) * rows); m->gate_up = zeroed(2 * (size_t)ffn * rows); m->hidden = zeroed((size_t)ffn * rows);
  m->scores = zeroed((size_t)threads * m->positions * 4); m->cos = zeroed(m->head_dim / 2 * rows); m->sin = zeroed(m->head_dim / 2 * rows);
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

/* Layer l's q|k|v biases (dim + 2 x kv_heads x head_dim floats, live until ng_free), added before the rotation. */
void ng_layer_bias(model *m, int l, const float *qkv_bias) { m->layer[l].qkv_bias = qkv_bias; }

void ng_head(model *m, const float *out_norm, int embedding_kind, const uint8_t *embedding, int head_kind, const uint8_t *head) {
  m->out_norm = out_norm;
  m->embedding = (matrix){embedding_kind, m->vocab_rows, m->dim, embedding};
  m->head = (matrix){head_kind, m->vocab_rows, m->dim, head};
}

/* Which path this library was compiled to: 1 AVX-512 VNNI (16-bit activations), 0 AVX2 (15-bit). */
int ng_vnni(void) { return VNNI; }
