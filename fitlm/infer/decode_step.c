/* One decode step of a Llama-architecture model in one call: embedding row -> blocks -> final norm -> logits.
 *
 * Why: at batch 1 on a CPU a step is the weights streaming through matrix-vector products plus ~20 small
 * torch ops a layer (norms, RoPE, cache writes, attention, SwiGLU, residuals), each a few microseconds of
 * dispatch for a few hundred numbers: a quarter of a 135M model's step. Here the whole step is one call.
 *
 * The numbers are the torch path's: every value is rounded to the model's dtype (fp32, bf16, fp16) where the
 * torch forward materialises a tensor of that dtype, products accumulate in fp32 and round once, RMSNorm
 * takes fp32 statistics and rounds before the weight (as Hugging Face does), RoPE rounds cos/sin, both
 * products and the sum, attention runs in fp32 (as fitlm's half-precision decode step does) and rounds its
 * output. Sums are taken in another order than oneDNN's and torch's, so values agree to float rounding.
 *
 * Built by fitlm/infer/native.py (-O3 -march=native -fopenmp -ffp-contract=off: no fused multiply-adds
 * outside the explicit ones in the products, so RoPE and the norms round where torch does). Threads are torch's
 * OpenMP threads (libgomp.so.1 resolves to the copy torch loaded), `nthreads` of them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { F32 = 0, BF16 = 1, F16 = 2 };

/* the per-layer pointer slots, in the order native.py fills them */
enum { IN_NORM, WQ, WK, WV, BQ, BK, BV, WO, BO, POST_NORM, WGATE, WUP, WDOWN, KCACHE, VCACHE, QNORM, KNORM, SLOTS };

typedef struct {
    int dtype, layers, hidden, heads, kv_heads, head_dim, ffn, vocab, max_len, window, nthreads;
    float eps, scale;
    const void* const* layer; /* layers x SLOTS pointers (NULL: absent bias / qk-norm) */
    const void* embed;        /* [vocab, hidden] */
    const void* final_norm;   /* [hidden] */
    const void* head;         /* [vocab, hidden] */
} Model;

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

#define BLOCK 4 /* weight rows per work item of a product (and per call of dots) */

/* sum_i w[i] x[i] over one weight row: four partial sums over consecutive vectors (one sequential stream, four
 * FMAs in flight), then one vector at a time, added in a fixed order, then the scalar tail. Every product of the
 * step goes through here, so a row's sum is the same whatever batch or block it is computed in. */
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
/* The weights of the step's products are packed (fitlm_pack) in panels of PW consecutive output rows, each
 * panel [n][PW] (bf16: [ceil(n/2)][PW][2], the two inputs of a pair side by side), rows past the end zero.
 * Why: with the outputs in the vector lanes, one weight vector load serves every row of the batch (a broadcast
 * of that row's input and an FMA each), no horizontal sums: 8 rows run at the cores' multiply-add rate, where a
 * dot product per weight row and batch row is bound by its loads. Each output is one fp32 sum over its inputs
 * in order (bf16 pair products: pairs in order), the same for every row of a batch and every batch size. */
#define PW 32

static long packed_n(long n, int dt) { return dt == BF16 ? n + (n & 1) : n; }

long fitlm_packed_bytes(long rows, long n, int dt) { return (rows + PW - 1) / PW * PW * packed_n(n, dt) * esize(dt); }

/* w [rows, n] (dtype dt) into out (fitlm_packed_bytes of it) */
void fitlm_pack(const void* w, long rows, long n, int dt, void* out) {
    long np = packed_n(n, dt), es = esize(dt), panels = (rows + PW - 1) / PW;
    memset(out, 0, panels * PW * np * es);
    for (long o = 0; o < rows; o++)
        for (long i = 0; i < n; i++) {
            long at = (o / PW) * PW * np + (dt == BF16 ? ((i / 2) * PW + o % PW) * 2 + i % 2 : i * PW + o % PW);
            memcpy((char*)out + at * es, (const char*)w + (o * n + i) * es, es);
        }
}

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
            panel_scalar(w, dt, xr, n, R, acc);
#endif
            for (int r = 0; r < R; r++)
                for (long j = 0; j < outs; j++)
                    y[(long)(b0 + r) * rows_out + o0 + j] = rnd(acc[r * PW + j] + (bias ? ld(bias, o0 + j, dt) : 0.0f), dt);
        }
    }
}
/* ------------------------------------------------------------------------------------- the small ops */
/* Hugging Face's RMSNorm: fp32 statistics, x * rsqrt(mean(x^2) + eps) rounded, then times the weight */
static void rms_norm(const float* x, const void* w, long n, float eps, int dt, float* out) {
    float ss = 0;
    for (long i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (long i = 0; i < n; i++) out[i] = rnd(ld(w, i, dt) * rnd(x[i] * r, dt), dt);
}

/* x [D] rotated in place: x * cos + rotate_half(x) * sin, cos and sin rounded to the dtype first */
static void rope(float* x, const float* cos, const float* sin, int d, int dt) {
    float tmp[d];
    int half = d / 2;
    for (int i = 0; i < d; i++) {
        float rot = i < half ? -x[i + half] : x[i - half];
        float a = rnd(x[i] * rnd(cos[i], dt), dt), b = rnd(rot * rnd(sin[i], dt), dt);
        tmp[i] = rnd(a + b, dt);
    }
    memcpy(x, tmp, sizeof(float) * d);
}

/* out[i] += p * v[i], i < d: one value row (dtype) weighted into the fp32 output */
static void axpy(float* out, float p, const void* v, int d, int dt) {
    if (dt == F32) {
        const float* vf32 = v;
        for (int i = 0; i < d; i++) out[i] += p * vf32[i];
    } else if (dt == BF16) {
        const uint16_t* vb = v;
        for (int i = 0; i < d; i++) out[i] += p * bf16_f32(vb[i]);
    } else {
        const _Float16* vh = v;
        for (int i = 0; i < d; i++) out[i] += p * (float)vh[i];
    }
}

/* one query head against keys/values [first, last] of its kv head (cache rows of D), softmax in fp32; the
 * scores by the products' kernel (BLOCK keys at a time), qb: q as bf16 (exact: q is bf16-valued there) */
static void attend(const float* q, const uint16_t* qb, const void* kc, const void* vc, long first, long last, int d,
                   float scale, int dt, float* scores, float* out) {
    float mx = -INFINITY;
    for (long j = first; j <= last; j += BLOCK) {
        int rows = last - j + 1 < BLOCK ? (int)(last - j + 1) : BLOCK;
        float s[BLOCK];
        dots(kc, j, rows, q, qb, d, dt, s);
        for (int r = 0; r < rows; r++) {
            scores[j - first + r] = s[r] * scale;
            if (scores[j - first + r] > mx) mx = scores[j - first + r];
        }
    }
    float sum = 0;
    for (long j = first; j <= last; j++) sum += scores[j - first] = expf(scores[j - first] - mx);
    for (int i = 0; i < d; i++) out[i] = 0;
    for (long j = first; j <= last; j++) axpy(out, scores[j - first], (const char*)vc + j * d * esize(dt), d, dt);
    for (int i = 0; i < d; i++) out[i] = rnd(out[i] / sum, dt);
}

/* ------------------------------------------------------------------------------------------ one layer */
/* activations of the batch's rows, [batch, width] each, fp32 holding values of the model's dtype */
typedef struct {
    int batch;
    float *h, *xn, *q, *k, *v, *att, *o, *gate, *up, *scores; /* q [batch, H*D], k and v [batch, K*D] */
    uint16_t* xb; /* the product's input as bf16 (the bf16 pair products) */
    const float *cos, *sin; /* [batch, head_dim] */
    const int64_t* first;   /* [batch]: each row's first cache cell */
    int64_t cell;           /* the cache cell this step writes (every row) */
} Step;

static void to_bf16(const float* x, uint16_t* xb, long n, int dt) {
    if (dt == BF16)
        for (long i = 0; i < n; i++) xb[i] = f32_bf16(x[i]); /* exact: x is bf16-valued */
}

static void norm_rows(const Model* m, const float* x, const void* w, long n, float* out, uint16_t* xb, int batch) {
    for (int b = 0; b < batch; b++) rms_norm(x + b * n, w, n, m->eps, m->dtype, out + b * n);
    to_bf16(out, xb, batch * n, m->dtype);
}

/* q and k heads of one row: per-head norm (Qwen3), RoPE; then its keys and values into the cache */
static void position_row(const Model* m, const void* const* p, Step* s, int b) {
    int dt = m->dtype, H = m->heads, K = m->kv_heads, D = m->head_dim;
    float *q = s->q + (long)b * H * D, *k = s->k + (long)b * K * D, *v = s->v + (long)b * K * D;
    for (int h = 0; h < H + K; h++) {
        float* x = h < H ? q + (long)h * D : k + (long)(h - H) * D;
        const void* norm = h < H ? p[QNORM] : p[KNORM];
        if (norm) {
            float tmp[D];
            rms_norm(x, norm, D, m->eps, dt, tmp);
            memcpy(x, tmp, sizeof(float) * D);
        }
        rope(x, s->cos + (long)b * D, s->sin + (long)b * D, D, dt);
    }
    long row = (long)b * K * m->max_len; /* cache [batch, K, max_len, D] */
    for (int h = 0; h < K; h++)
        for (int i = 0; i < D; i++) {
            st((void*)p[KCACHE], ((row + (long)h * m->max_len) + s->cell) * D + i, k[(long)h * D + i], dt);
            st((void*)p[VCACHE], ((row + (long)h * m->max_len) + s->cell) * D + i, v[(long)h * D + i], dt);
        }
}

static void attention_block(const Model* m, const void* const* p, Step* s) {
    int dt = m->dtype, C = m->hidden, H = m->heads, K = m->kv_heads, D = m->head_dim, nt = m->nthreads;
    int B = s->batch, group = H / K;
    long span_max = s->cell + 1;
    norm_rows(m, s->h, p[IN_NORM], C, s->xn, s->xb, B);
    matvec(p[WQ], p[BQ], s->xn, s->xb, C, (long)H * D, dt, s->q, B, nt);
    matvec(p[WK], p[BK], s->xn, s->xb, C, (long)K * D, dt, s->k, B, nt);
    matvec(p[WV], p[BV], s->xn, s->xb, C, (long)K * D, dt, s->v, B, nt);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && B > 1)
    for (int b = 0; b < B; b++) position_row(m, p, s, b);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && span_max * B * H * D > 65536)
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        long first = s->first[b];
        if (m->window > 0 && s->cell - m->window + 1 > first) first = s->cell - m->window + 1;
        long off = (((long)b * K + h / group) * m->max_len) * D * esize(dt);
        const float* q = s->q + ((long)b * H + h) * D;
        uint16_t qb[D + 32];
        to_bf16(q, qb, D, dt);
        attend(q, qb, (const char*)p[KCACHE] + off, (const char*)p[VCACHE] + off, first,
               s->cell, D, m->scale, dt, s->scores + (long)bh * span_max, s->att + (long)bh * D);
    }
    to_bf16(s->att, s->xb, (long)B * H * D, dt);
    matvec(p[WO], p[BO], s->att, s->xb, (long)H * D, C, dt, s->o, B, nt);
    for (long i = 0; i < (long)B * C; i++) s->h[i] = rnd(s->h[i] + s->o[i], dt);
}

static float silu(float x) { return x / (1.0f + expf(-x)); }

static void mlp_block(const Model* m, const void* const* p, Step* s) {
    int dt = m->dtype, C = m->hidden, F = m->ffn, nt = m->nthreads, B = s->batch;
    norm_rows(m, s->h, p[POST_NORM], C, s->xn, s->xb, B);
    matvec(p[WGATE], NULL, s->xn, s->xb, C, F, dt, s->gate, B, nt);
    matvec(p[WUP], NULL, s->xn, s->xb, C, F, dt, s->up, B, nt);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && B * F > 4096)
    for (long i = 0; i < (long)B * F; i++) s->gate[i] = rnd(rnd(silu(s->gate[i]), dt) * s->up[i], dt);
    to_bf16(s->gate, s->xb, (long)B * F, dt);
    matvec(p[WDOWN], NULL, s->gate, s->xb, F, C, dt, s->o, B, nt);
    for (long i = 0; i < (long)B * C; i++) s->h[i] = rnd(s->h[i] + s->o[i], dt);
}

/* Logits [batch, vocab] (in the model's dtype) of tokens[b] for each row b of the cache; their keys and values
 * go into cache cell `cell`, and row b attends to cells first[b] .. cell. cos/sin [batch, head_dim] fp32 are
 * the rotary tables' rows of each token's position. Returns 0, or -1 when out of memory. */
int fitlm_decode_step(const Model* m, int batch, const int64_t* tokens, const int64_t* first, int64_t cell,
                      const float* cos, const float* sin, void* logits) {
    int dt = m->dtype, C = m->hidden, H = m->heads, K = m->kv_heads, D = m->head_dim, F = m->ffn, B = batch;
    long widest = C > F ? C : F, hd = (long)H * D;
    if (hd > widest) widest = hd;
    /* per row: h, xn, q, k, v, att, o, gate, up, scores; then the logits in fp32 */
    long floats = (long)B * (2 * C + (long)(H + 2 * K) * D + hd + C + 2 * F + H * (cell + 1)) + (long)B * m->vocab;
    float* buf = malloc(sizeof(float) * floats);
    uint16_t* xb = malloc(sizeof(uint16_t) * (B * widest + 32));
    if (!buf || !xb) {
        free(buf);
        free(xb);
        return -1;
    }
    Step s = {.batch = B, .xb = xb, .cos = cos, .sin = sin, .first = first, .cell = cell};
    s.h = buf, s.xn = s.h + (long)B * C, s.q = s.xn + (long)B * C, s.k = s.q + (long)B * hd;
    s.v = s.k + (long)B * K * D, s.att = s.v + (long)B * K * D, s.o = s.att + (long)B * hd, s.gate = s.o + (long)B * C;
    s.up = s.gate + (long)B * F, s.scores = s.up + (long)B * F;
    for (int b = 0; b < B; b++)
        for (int i = 0; i < C; i++) s.h[(long)b * C + i] = ld(m->embed, tokens[b] * C + i, dt);
    for (int l = 0; l < m->layers; l++) {
        const void* const* p = m->layer + (long)l * SLOTS;
        attention_block(m, p, &s);
        mlp_block(m, p, &s);
    }
    norm_rows(m, s.h, m->final_norm, C, s.xn, s.xb, B);
    float* out = s.scores + (long)B * H * (cell + 1);
    matvec(m->head, NULL, s.xn, s.xb, C, m->vocab, dt, out, B, m->nthreads);
    for (long i = 0; i < (long)B * m->vocab; i++) st(logits, i, out[i], dt);
    free(buf);
    free(xb);
    return 0;
}

/* y [m, rows_out] = x [m, n] W^T + bias (dtype dt each, bias may be NULL) through the packed panels pw of W
 * [rows_out, n]: a linear layer's product for m rows, RG at a time. Returns 0, or -1 when out of memory. */
int fitlm_linear(const void* pw, const void* bias, const void* x, long m, long n, long rows_out, int dt, void* y,
                 int nthreads) {
    long tile = 64; /* rows converted per pass: the fp32 (and bf16) copies of the inputs, the fp32 outputs */
    float* xf = malloc(sizeof(float) * (tile * n + tile * rows_out));
    uint16_t* xb = malloc(sizeof(uint16_t) * (tile * n + 32));
    if (!xf || !xb) {
        free(xf);
        free(xb);
        return -1;
    }
    float* out = xf + tile * n;
    for (long r0 = 0; r0 < m; r0 += tile) {
        long rows = m - r0 < tile ? m - r0 : tile;
        for (long i = 0; i < rows * n; i++) xf[i] = ld(x, r0 * n + i, dt);
        to_bf16(xf, xb, rows * n, dt);
        matvec(pw, bias, xf, xb, n, rows_out, dt, out, (int)rows, nthreads);
        for (long i = 0; i < rows * rows_out; i++) st(y, r0 * rows_out + i, out[i], dt);
    }
    free(xf);
    free(xb);
    return 0;
}
