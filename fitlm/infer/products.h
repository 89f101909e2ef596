/* The products of decode_step.c, and the dtype helpers they share with it: one header, built into the step.
 *
 * Two kinds: `dot`, one weight row against one input (attention's scores over the KV cache, rows of [len, D]),
 * and `matvec`, a linear layer's weights packed in panels of PW output rows against up to RG rows of inputs
 * per pass (see "the packed products"). Every vector path (AVX-512 with or without BF16 pair products, AVX2,
 * none) computes the same sums in the same order for a given path, whatever the batch.
 */
#ifndef FITLM_PRODUCTS_H
#define FITLM_PRODUCTS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { F32 = 0, BF16 = 1, F16 = 2 };

/* ---------------------------------------------------------------------------------------- dtype helpers */
static inline float bf16_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t f32_bf16(float f) { /* round to nearest even, as torch; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float ld(const void* p, long i, int dt) {
    if (dt == F32) return ((const float*)p)[i];
    if (dt == BF16) return bf16_f32(((const uint16_t*)p)[i]);
    return (float)((const _Float16*)p)[i];
}
static inline void st(void* p, long i, float v, int dt) {
    if (dt == F32) ((float*)p)[i] = v;
    else if (dt == BF16) ((uint16_t*)p)[i] = f32_bf16(v);
    else ((_Float16*)p)[i] = (_Float16)v;
}
/* bytes of one element of the dtype */
static inline long esize(int dt) { return dt == F32 ? 4 : 2; }
/* v rounded to the dtype and back: where torch would hold a tensor of that dtype */
static inline float rnd(float v, int dt) {
    if (dt == F32) return v;
    if (dt == BF16) return bf16_f32(f32_bf16(v));
    return (float)(_Float16)v;
}

/* ------------------------------------------------------------------------------------------ products */
#if defined(__AVX512F__)
#define VEC 16
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSUM(v) _mm512_reduce_add_ps(v)
#define VLOAD_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p))), 16))
#define VLOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p)))
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VEC 8
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
static inline float vsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define VSUM(v) vsum8(v)
#define VLOAD_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p))), 16))
#define VLOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p)))
#else
#define VEC 0 /* no vector path: the scalar loop below does everything */
#endif

#define BLOCK 4 /* rows per call of dots (attention's keys) */

/* sum_i w[i] x[i] over one weight row: four partial sums over consecutive vectors (one sequential stream, four
 * FMAs in flight), then one vector at a time, added in a fixed order, then the scalar tail. Attention's scores
 * (a cached key row against a query) go through here, so a key's score is the same in every batch. */
#define DOT_BODY(STEP, LOAD_W, LOAD_X, FMA)                                                  \
    for (; i + 4 * (STEP) <= n; i += 4 * (STEP)) {                                           \
        a0 = FMA(a0, LOAD_W(i), LOAD_X(i));                                                   \
        a1 = FMA(a1, LOAD_W(i + (STEP)), LOAD_X(i + (STEP)));                                 \
        a2 = FMA(a2, LOAD_W(i + 2 * (STEP)), LOAD_X(i + 2 * (STEP)));                         \
        a3 = FMA(a3, LOAD_W(i + 3 * (STEP)), LOAD_X(i + 3 * (STEP)));                         \
    }                                                                                         \
    for (; i + (STEP) <= n; i += (STEP)) a0 = FMA(a0, LOAD_W(i), LOAD_X(i));

#if VEC
#define ACC_FMA(acc, w, x) VFMA(w, x, acc)
#define W_F32(k) VLOAD(wf + (k))
#define W_BF16(k) VLOAD_BF16(wb + (k))
#define W_F16(k) VLOAD_F16(wh + (k))
#define X_F32(k) VLOAD(x + (k))
#if defined(__AVX512BF16__)
#define DP_FMA(acc, w, x) _mm512_dpbf16_ps(acc, w, x)
#define W_BH(k) ((__m512bh)_mm512_loadu_si512((const void*)(wb + (k))))
#define X_BH(k) ((__m512bh)_mm512_loadu_si512((const void*)(xb + (k))))
#endif
#endif

static float dot(const void* w, const float* x, const uint16_t* xb, long n, int dt) {
    long i = 0;
    float s = 0;
#if VEC
    vf a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
    if (dt == F32) {
        const float* wf = w;
        DOT_BODY(VEC, W_F32, X_F32, ACC_FMA)
    } else if (dt == BF16) {
        const uint16_t* wb = w;
#if defined(__AVX512BF16__)
        /* bf16 pairs multiplied exactly and summed in fp32 (the instruction oneDNN uses); x is bf16-valued */
        DOT_BODY(32, W_BH, X_BH, DP_FMA)
#endif
        DOT_BODY(VEC, W_BF16, X_F32, ACC_FMA)
    } else {
        const _Float16* wh = w;
        DOT_BODY(VEC, W_F16, X_F32, ACC_FMA)
    }
    s = VSUM(VADD(VADD(a0, a1), VADD(a2, a3)));
#endif
    (void)xb;
    for (; i < n; i++) s += ld(w, i, dt) * x[i]; /* the tail past the vectors */
    return s;
}

/* out[r] = sum_i W[row0 + r, i] x[i] for r < rows */
static void dots(const void* w, long row0, int rows, const float* x, const uint16_t* xb, long n, int dt, float* out) {
    for (int r = 0; r < rows; r++) out[r] = dot((const char*)w + (row0 + r) * n * esize(dt), x, xb, n, dt);
}

/* ------------------------------------------------------------------------------- the packed products */
/* The weights of the step's products are packed (native_decode.pack_panels) in panels of PW consecutive output rows, each
 * panel [n][PW] (bf16: [ceil(n/2)][PW][2], the two inputs of a pair side by side), rows past the end zero.
 * Why: with the outputs in the vector lanes, one weight vector load serves every row of the batch (a broadcast
 * of that row's input and an FMA each), no horizontal sums: 8 rows run at the cores' multiply-add rate, where a
 * dot product per weight row and batch row is bound by its loads. Each output is one fp32 sum over its inputs
 * in order (bf16 pair products: pairs in order), the same for every row of a batch and every batch size. */
#define PW 32

static long packed_n(long n, int dt) { return dt == BF16 ? n + (n & 1) : n; }

#if VEC
#define NV (PW / VEC) /* vectors of a panel's row */
#ifndef PF
#define PF 32
#endif
#define PREFETCH(p) (_mm_prefetch((const char*)(p), _MM_HINT_T0), _mm_prefetch((const char*)(p) + 64, _MM_HINT_T0))
#if defined(__AVX512F__)
#define RG 8 /* batch rows per pass over a panel: 8 x 2 accumulators of the 32 registers */
#define VSET1(v) _mm512_set1_ps(v)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define PAIR_EVEN(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512((const void*)(p)), 16))
#define PAIR_ODD(p) _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512((const void*)(p)), _mm512_set1_epi32((int)0xffff0000)))
#else
#define RG 2 /* 2 x 4 accumulators of the 16 registers */
#define VSET1(v) _mm256_set1_ps(v)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define PAIR_EVEN(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(p)), 16))
#define PAIR_ODD(p) _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i*)(p)), _mm256_set1_epi32((int)0xffff0000)))
#endif

/* acc[r][v] += x[r][k] * W[k][v lanes] for each input k: the inner loop of a panel, R rows (a constant) */
#define PANEL_LOOP(K_END, W_AT, X_AT, LOAD)                          \
    for (long k = 0; k < (K_END); k++) {                             \
        vf wv[NV];                                                   \
        for (int v = 0; v < NV; v++) wv[v] = LOAD((W_AT) + v * VEC); \
        PREFETCH((W_AT) + PF * PW);                                  \
        for (int r = 0; r < R; r++) {                                \
            vf xv = VSET1(X_AT);                                     \
            for (int v = 0; v < NV; v++) a[r][v] = VFMA(wv[v], xv, a[r][v]); \
        }                                                            \
    }

/* y[r][0..PW) = sum_k x[r][k] W[k][..] for the R rows of x (and xb, bf16 copy) [R, n], one panel pw */
static inline __attribute__((always_inline)) void panel(const void* pw, int dt, const float* x, const uint16_t* xb,
                                                        long n, const int R, float* y) {
    vf a[RG][NV];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) a[r][v] = VZERO();
    if (dt == F32) {
        const float* w = pw;
        PANEL_LOOP(n, w + k * PW, x[r * n + k], VLOAD)
    } else if (dt == F16) {
        const _Float16* w = pw;
        PANEL_LOOP(n, w + k * PW, x[r * n + k], VLOAD_F16)
    } else {
        const uint16_t* w = pw;
        long pairs = n / 2;
#if defined(__AVX512BF16__)
        /* bf16 pairs multiplied exactly and summed in fp32 (the instruction oneDNN uses); x is bf16-valued */
        for (long k = 0; k < pairs; k++) {
            __m512bh wv[NV];
            for (int v = 0; v < NV; v++) wv[v] = (__m512bh)_mm512_loadu_si512((const void*)(w + (k * PW + v * VEC) * 2));
            PREFETCH(w + (k + PF) * PW * 2);
            for (int r = 0; r < R; r++) {
                uint32_t two;
                memcpy(&two, xb + r * n + 2 * k, 4);
                __m512bh xv = (__m512bh)_mm512_set1_epi32((int)two);
                for (int v = 0; v < NV; v++) a[r][v] = _mm512_dpbf16_ps(a[r][v], wv[v], xv);
            }
        }
#else
        for (long k = 0; k < pairs; k++) { /* the pair's first input, then its second */
            vf ev[NV], od[NV];
            for (int v = 0; v < NV; v++) ev[v] = PAIR_EVEN(w + (k * PW + v * VEC) * 2), od[v] = PAIR_ODD(w + (k * PW + v * VEC) * 2);
            for (int r = 0; r < R; r++) {
                vf x0 = VSET1(x[r * n + 2 * k]), x1 = VSET1(x[r * n + 2 * k + 1]);
                for (int v = 0; v < NV; v++) a[r][v] = VFMA(od[v], x1, VFMA(ev[v], x0, a[r][v]));
            }
        }
#endif
        if (n & 1) { /* the last input alone: the first of a pair whose second is zero */
            vf ev[NV];
            for (int v = 0; v < NV; v++) ev[v] = PAIR_EVEN(w + (pairs * PW + v * VEC) * 2);
            for (int r = 0; r < R; r++) {
                vf xv = VSET1(x[r * n + n - 1]);
                for (int v = 0; v < NV; v++) a[r][v] = VFMA(ev[v], xv, a[r][v]);
            }
        }
        (void)xb;
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) VSTORE(y + r * PW + v * VEC, a[r][v]);
}
#endif

#if !VEC
#define RG 8
/* the scalar twin of panel: the same sums in the same order, one output at a time */
static void panel_scalar(const void* pw, int dt, const float* x, long n, int R, float* y) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < PW; j++) {
            float acc = 0;
            for (long k = 0; k < n; k++) {
                long at = dt == BF16 ? ((k / 2) * PW + j) * 2 + k % 2 : k * PW + j;
                acc += ld(pw, at, dt) * x[r * n + k];
            }
            y[r * PW + j] = acc;
        }
}
#endif

/* y[b, o] = rnd(W[o] . x[b] + bias[o]) for b < batch, o < rows_out: pw the packed W [rows_out, n], x [batch, n],
 * y [batch, rows_out]. Each panel is read from memory once for every RG rows of the batch. */
static void matvec(const void* pw, const void* bias, const float* x, const uint16_t* xb, long n, long rows_out,
                   int dt, float* y, int batch, int nthreads) {
    long panels = (rows_out + PW - 1) / PW, panel_bytes = PW * packed_n(n, dt) * esize(dt);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && rows_out * n > 32768)
    for (long p = 0; p < panels; p++) {
        const char* w = (const char*)pw + p * panel_bytes;
        long o0 = p * PW, outs = rows_out - o0 < PW ? rows_out - o0 : PW;
        for (int b0 = 0; b0 < batch; b0 += RG) {
            int R = batch - b0 < RG ? batch - b0 : RG;
            float acc[RG * PW];
            const float* xr = x + (long)b0 * n;
#if VEC
            const uint16_t* xbr = xb + (long)b0 * n;
            switch (R) { /* R a constant in each: the accumulators stay in registers */
#define PANEL_CASE(k) case k: panel(w, dt, xr, xbr, n, k, acc); break;
                PANEL_CASE(1) PANEL_CASE(2)
#if RG > 2
                PANEL_CASE(3) PANEL_CASE(4) PANEL_CASE(5) PANEL_CASE(6) PANEL_CASE(7) PANEL_CASE(8)
#endif
            }
#else
            (void)xb;
            panel_scalar(w, dt, xr, n, R, acc);
#endif
            for (int r = 0; r < R; r++)
                for (long j = 0; j < outs; j++)
                    y[(long)(b0 + r) * rows_out + o0 + j] = rnd(acc[r * PW + j] + (bias ? ld(bias, o0 + j, dt) : 0.0f), dt);
        }
    }
}
#endif /* FITLM_PRODUCTS_H */
