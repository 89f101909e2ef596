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
#include "products.h"

/* the per-layer pointer slots, in the order native.py fills them */
enum { IN_NORM, WQ, WK, WV, BQ, BK, BV, WO, BO, POST_NORM, WGATE, WUP, WDOWN, KCACHE, VCACHE, QNORM, KNORM, SLOTS };

typedef struct {
    int dtype, layers, hidden, heads, kv_heads, head_dim, ffn, vocab, max_len, window, nthreads;
    float eps, scale;
    const void* const* layer; /* layers x SLOTS pointers (NULL: absent bias / qk-norm); weights: packed panels */
    const void* embed;        /* [vocab, hidden] */
    const void* final_norm;   /* [hidden] */
    const void* head;         /* the output projection [vocab, hidden] as packed panels */
} Model;

/* ------------------------------------------------------------------------------------- the small ops */
#if defined(__AVX512F__)
/* e^x, 16 at a time: Cephes' expf (range reduction by ln 2 in two parts, a degree-7 polynomial, relative error
 * ~1e-7, as glibc's and Sleef's within an ulp or two), 2^n applied by scalef so tiny results underflow smoothly */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-103.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

/* v rounded to the dtype and back, 16 at a time (rnd's twin: bf16 to nearest even, NaN kept) */
static inline __m512 rnd16(__m512 v, int dt) {
    if (dt == F32) return v;
    if (dt == F16) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    __m512 rounded = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000)));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, v);
}
#endif

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
    int half = d / 2, i = 0;
#if defined(__AVX512F__)
    if (half % 16 == 0) /* 16 at a time, the same roundings */
        for (; i < d; i += 16) {
            __m512 rot = i < half ? _mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(x + i + half))
                                  : _mm512_loadu_ps(x + i - half);
            __m512 a = rnd16(_mm512_mul_ps(_mm512_loadu_ps(x + i), rnd16(_mm512_loadu_ps(cos + i), dt)), dt);
            __m512 b = rnd16(_mm512_mul_ps(rot, rnd16(_mm512_loadu_ps(sin + i), dt)), dt);
            _mm512_storeu_ps(tmp + i, rnd16(_mm512_add_ps(a, b), dt));
        }
#endif
    for (; i < d; i++) {
        float rot = i < half ? -x[i + half] : x[i - half];
        float a = rnd(x[i] * rnd(cos[i], dt), dt), b = rnd(rot * rnd(sin[i], dt), dt);
        tmp[i] = rnd(a + b, dt);
    }
    memcpy(x, tmp, sizeof(float) * d);
}

/* out[i] = x[i] in the dtype, i < n (x holds values of the dtype: exact) */
static void store_row(void* out, const float* x, long n, int dt) {
    long i = 0;
#if defined(__AVX512F__)
    for (; dt != F32 && i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __m256i h = dt == F16 ? _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                              : _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
        _mm256_storeu_si256((__m256i*)((uint16_t*)out + i), h);
    }
#endif
    if (dt == F32) memcpy(out, x, sizeof(float) * n);
    else
        for (; i < n; i++) st(out, i, x[i], dt);
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

#if defined(__AVX512F__)
/* out[0..16*NVD) = sum_j p[j] v[first + j] for j < n: the accumulators in registers (NVD a constant) */
static inline __attribute__((always_inline)) void weigh_values16(const float* p, const void* vc, long first, long n,
                                                                 const int NVD, int dt, float* out) {
    __m512 acc[8];
    for (int c = 0; c < NVD; c++) acc[c] = _mm512_setzero_ps();
    for (long j = 0; j < n; j++) {
        __m512 pj = _mm512_set1_ps(p[j]);
        const char* row = (const char*)vc + (first + j) * 16 * NVD * esize(dt);
        for (int c = 0; c < NVD; c++) {
            __m512 v = dt == F32 ? _mm512_loadu_ps((const float*)row + c * 16)
                       : dt == BF16 ? VLOAD_BF16((const uint16_t*)row + c * 16)
                                    : VLOAD_F16((const _Float16*)row + c * 16);
            acc[c] = _mm512_fmadd_ps(pj, v, acc[c]);
        }
    }
    for (int c = 0; c < NVD; c++) _mm512_storeu_ps(out + c * 16, acc[c]);
}
#endif

/* out[i] = sum_j p[j] v[first + j][i], i < d: the values weighted by the softmax's numerators (fp32) */
static void weigh_values(const float* p, const void* vc, long first, long n, int d, int dt, float* out) {
#if defined(__AVX512F__)
    if (d == 64 || d == 128) { /* (the head sizes of the families; others take the loop below) */
        if (d == 64) weigh_values16(p, vc, first, n, 4, dt, out);
        else weigh_values16(p, vc, first, n, 8, dt, out);
        return;
    }
#endif
    for (int i = 0; i < d; i++) out[i] = 0;
    for (long j = 0; j < n; j++) axpy(out, p[j], (const char*)vc + (first + j) * d * esize(dt), d, dt);
}

/* scores[j] = e^(scores[j] - mx) for j < n; their sum */
static float softmax_numerators(float* scores, long n, float mx) {
    long j = 0;
    float sum = 0;
#if defined(__AVX512F__)
    __m512 vs = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + j), _mm512_set1_ps(mx)));
        _mm512_storeu_ps(scores + j, e);
        vs = _mm512_add_ps(vs, e);
    }
    sum = _mm512_reduce_add_ps(vs);
#endif
    for (; j < n; j++) sum += scores[j] = expf(scores[j] - mx);
    return sum;
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
    float sum = softmax_numerators(scores, last - first + 1, mx);
    weigh_values(scores, vc, first, last - first + 1, d, dt, out);
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
    for (int h = 0; h < K; h++) {
        long at = ((row + (long)h * m->max_len) + s->cell) * D * esize(dt);
        store_row((char*)p[KCACHE] + at, k + (long)h * D, D, dt);
        store_row((char*)p[VCACHE] + at, v + (long)h * D, D, dt);
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

/* gate[i] = rnd(rnd(silu(gate[i])) * up[i]) for i < n: the SwiGLU product, rounded where torch rounds */
static void silu_mul(float* gate, const float* up, long n, int dt) {
    long i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        __m512 g = _mm512_loadu_ps(gate + i);
        __m512 sg = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_storeu_ps(gate + i, rnd16(_mm512_mul_ps(rnd16(sg, dt), _mm512_loadu_ps(up + i)), dt));
    }
#endif
    for (; i < n; i++) gate[i] = rnd(rnd(silu(gate[i]), dt) * up[i], dt);
}

static void mlp_block(const Model* m, const void* const* p, Step* s) {
    int dt = m->dtype, C = m->hidden, F = m->ffn, nt = m->nthreads, B = s->batch;
    norm_rows(m, s->h, p[POST_NORM], C, s->xn, s->xb, B);
    matvec(p[WGATE], NULL, s->xn, s->xb, C, F, dt, s->gate, B, nt);
    matvec(p[WUP], NULL, s->xn, s->xb, C, F, dt, s->up, B, nt);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && B > 1)
    for (int b = 0; b < B; b++) silu_mul(s->gate + (long)b * F, s->up + (long)b * F, F, dt);
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
