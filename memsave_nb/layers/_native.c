/* memsave_nb: fused 1-bit mask kernels for the memory-saving ReLU family (plain CPU tensors).
 *
 * Bit j of byte i stands for element 8*i + j (logical row-major order), as numpy's
 * packbits(bitorder="little") writes it, so masks packed here and there are interchangeable.
 * Elements are handled by their bytes: the kernels do not depend on the float format.
 *
 *   pack_nonzero:  bit = the element is nonzero (+0 and -0 are zero; NaN is nonzero), i.e.
 *                  torch's ``x.bool()``, what a ReLU output passes to backward.
 *   select_bits:   out = bit ? grad : +0, in one pass: what stock's threshold_backward does
 *                  with a 0/1 mask (it never reads the gradient where the mask is 0).
 *   relu_pack:     out = x < 0 ? +0 : x (torch.relu's bytes: -0 and NaN pass unchanged) and
 *                  its pack_nonzero bits, in one pass (float32/float64; out may be src).
 *   pool_offsets / pool_flat: a max pool's flat argmax (an int64 index into each input plane,
 *                  as stock's pooling returns it) <-> its row-major offset inside the window,
 *                  for up to 3 spatial dims (fewer: leading dims of size 1), in one pass and
 *                  without integer division: the distance from the window's first element
 *                  maps to the offset by a small table, and back by the kernel's deltas.
 */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
/* AVX2 and AVX-512 bodies for float32, compiled for those targets and chosen at run time by
 * what the CPU (and OS) supports: torch's own kernels use them, and the 128-bit bodies ran at
 * about half of their speed. The library itself is built for the baseline, so it loads on any
 * x86-64. */
#define MEMSAVE_WIDE 1
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2")))
#define AVX512 __attribute__((target("avx512f")))
#endif

#define DEFINE_PACK(NAME, UINT, SIGN)                                                    \
    static void NAME(const UINT* src, int64_t n, uint8_t* dst) {                         \
        int64_t full = n / 8;                                                            \
        for (int64_t i = 0; i < full; i++) {                                             \
            const UINT* s = src + 8 * i;                                                 \
            uint8_t byte = 0;                                                            \
            for (int j = 0; j < 8; j++) byte |= (uint8_t)(((s[j] & ~(UINT)SIGN) != 0) << j); \
            dst[i] = byte;                                                               \
        }                                                                                \
        if (n % 8) {                                                                     \
            uint8_t byte = 0;                                                            \
            for (int64_t k = full * 8; k < n; k++)                                       \
                byte |= (uint8_t)(((src[k] & ~(UINT)SIGN) != 0) << (k - full * 8));      \
            dst[full] = byte;                                                            \
        }                                                                                \
    }

DEFINE_PACK(pack16, uint16_t, 0x8000u)
DEFINE_PACK(pack32_scalar, uint32_t, 0x80000000u)
DEFINE_PACK(pack64, uint64_t, 0x8000000000000000ull)

static void pack32(const uint32_t* src, int64_t n, uint8_t* dst) {
#if defined(__SSE2__)
    int64_t full = n / 8;
    const __m128i magnitude = _mm_set1_epi32(0x7fffffff);
    const __m128i zero = _mm_setzero_si128();
    for (int64_t i = 0; i < full; i++) {
        __m128i a = _mm_and_si128(_mm_loadu_si128((const __m128i*)(src + 8 * i)), magnitude);
        __m128i b = _mm_and_si128(_mm_loadu_si128((const __m128i*)(src + 8 * i + 4)), magnitude);
        /* lanes equal to zero -> all ones; movemask of the inverse is the nonzero bits */
        int lo = _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(a, zero)));
        int hi = _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(b, zero)));
        dst[i] = (uint8_t)(~(lo | (hi << 4)));
    }
    if (n % 8) pack32_scalar(src + 8 * full, n % 8, dst + full);
#else
    pack32_scalar(src, n, dst);
#endif
}

/* bits of src > 0 (a float compare, ordered: false for NaN and both zeros, and it honours the
 * CPU's denormals-are-zero flag as stock's kernels do): leaky ReLU's mask of its input */
#define DEFINE_PACK_POSITIVE(NAME, FLOAT)                                                \
    static void NAME(const FLOAT* src, int64_t n, uint8_t* dst) {                        \
        int64_t full = n / 8;                                                            \
        for (int64_t i = 0; i < full; i++) {                                             \
            const FLOAT* s = src + 8 * i;                                                \
            uint8_t byte = 0;                                                            \
            for (int j = 0; j < 8; j++) byte |= (uint8_t)((s[j] > (FLOAT)0) << j);       \
            dst[i] = byte;                                                               \
        }                                                                                \
        if (n % 8) {                                                                     \
            uint8_t byte = 0;                                                            \
            for (int64_t k = full * 8; k < n; k++)                                       \
                byte |= (uint8_t)((src[k] > (FLOAT)0) << (k - full * 8));                \
            dst[full] = byte;                                                            \
        }                                                                                \
    }

DEFINE_PACK_POSITIVE(positive32_scalar, float)
DEFINE_PACK_POSITIVE(positive64, double)

static void positive32(const float* src, int64_t n, uint8_t* dst) {
#if defined(__SSE2__)
    int64_t full = n / 8;
    const __m128 zero = _mm_setzero_ps();
    for (int64_t i = 0; i < full; i++) {
        int lo = _mm_movemask_ps(_mm_cmpgt_ps(_mm_loadu_ps(src + 8 * i), zero));
        int hi = _mm_movemask_ps(_mm_cmpgt_ps(_mm_loadu_ps(src + 8 * i + 4), zero));
        dst[i] = (uint8_t)(lo | (hi << 4));
    }
    if (n % 8) positive32_scalar(src + 8 * full, n % 8, dst + full);
#else
    positive32_scalar(src, n, dst);
#endif
}

#define DEFINE_SELECT(NAME, UINT)                                                        \
    static void NAME(const UINT* grad, const uint8_t* bits, int64_t n, UINT* out) {      \
        for (int64_t k = 0; k < n; k++)                                                  \
            out[k] = ((bits[k >> 3] >> (k & 7)) & 1) ? grad[k] : (UINT)0;                \
    }

DEFINE_SELECT(select16, uint16_t)
DEFINE_SELECT(select32_scalar, uint32_t)
DEFINE_SELECT(select64, uint64_t)

static void select32(const uint32_t* grad, const uint8_t* bits, int64_t n, uint32_t* out) {
#if defined(__SSE2__)
    int64_t full = n / 8;
    const __m128i sel_lo = _mm_set_epi32(8, 4, 2, 1);
    const __m128i sel_hi = _mm_set_epi32(128, 64, 32, 16);
    for (int64_t i = 0; i < full; i++) {
        __m128i b = _mm_set1_epi32(bits[i]);
        __m128i lo = _mm_cmpeq_epi32(_mm_and_si128(b, sel_lo), sel_lo);
        __m128i hi = _mm_cmpeq_epi32(_mm_and_si128(b, sel_hi), sel_hi);
        __m128i g0 = _mm_loadu_si128((const __m128i*)(grad + 8 * i));
        __m128i g1 = _mm_loadu_si128((const __m128i*)(grad + 8 * i + 4));
        _mm_storeu_si128((__m128i*)(out + 8 * i), _mm_and_si128(g0, lo));
        _mm_storeu_si128((__m128i*)(out + 8 * i + 4), _mm_and_si128(g1, hi));
    }
    if (n % 8) select32_scalar(grad + 8 * full, bits + full, n % 8, out + 8 * full);
#else
    select32_scalar(grad, bits, n, out);
#endif
}

/* out[k] = bit k ? grad[k] * on : grad[k] * off, in the gradient's float type, one pass; with
 * copy_on the set bits copy grad unchanged. Leaky ReLU's backward is (copy, slope): stock's
 * input > 0 ? grad : grad * slope. Dropout's is (scale, 0): stock's grad * noise, with noise
 * scale or 0 (so an inf or NaN gradient where dropped gives NaN, as there). */
/* branch-free: both products are made and the bit picks one by an integer mask (random masks
 * make a branch mispredict about every other element: 10x slower here) */
#define SCALE_LOOP(FLOAT, UINT, ON_VALUE)                                                \
    for (int64_t k = 0; k < n; k++) {                                                    \
        FLOAT g = grad[k];                                                               \
        FLOAT a = ON_VALUE, c = g * off;                                                 \
        UINT ua, uc;                                                                     \
        memcpy(&ua, &a, sizeof ua);                                                      \
        memcpy(&uc, &c, sizeof uc);                                                      \
        UINT m = (UINT)0 - (UINT)((bits[k >> 3] >> (k & 7)) & 1);                        \
        UINT r = (ua & m) | (uc & ~m);                                                   \
        memcpy(out + k, &r, sizeof r);                                                   \
    }

#define DEFINE_SCALE(NAME, FLOAT, UINT)                                                  \
    static void NAME(const FLOAT* grad, const uint8_t* bits, int64_t n, FLOAT on,       \
                     FLOAT off, int copy_on, FLOAT* out) {                               \
        if (copy_on) {                                                                   \
            SCALE_LOOP(FLOAT, UINT, g)                                                   \
        } else {                                                                         \
            SCALE_LOOP(FLOAT, UINT, g * on)                                              \
        }                                                                                \
    }

DEFINE_SCALE(scale32_scalar, float, uint32_t)
DEFINE_SCALE(scale64, double, uint64_t)

static void scale32(const float* grad, const uint8_t* bits, int64_t n, float on, float off,
                    int copy_on, float* out) {
#if defined(__SSE2__)
    /* 8 elements per mask byte, as select32: lane masks from the byte, then a bitwise pick */
    int64_t full = n / 8;
    const __m128i sel_lo = _mm_set_epi32(8, 4, 2, 1);
    const __m128i sel_hi = _mm_set_epi32(128, 64, 32, 16);
    const __m128 von = _mm_set1_ps(on), voff = _mm_set1_ps(off);
    for (int64_t i = 0; i < full; i++) {
        __m128i b = _mm_set1_epi32(bits[i]);
        __m128 lo = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(b, sel_lo), sel_lo));
        __m128 hi = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(b, sel_hi), sel_hi));
        __m128 g0 = _mm_loadu_ps(grad + 8 * i), g1 = _mm_loadu_ps(grad + 8 * i + 4);
        __m128 a0 = copy_on ? g0 : _mm_mul_ps(g0, von);
        __m128 a1 = copy_on ? g1 : _mm_mul_ps(g1, von);
        __m128 c0 = _mm_mul_ps(g0, voff), c1 = _mm_mul_ps(g1, voff);
        _mm_storeu_ps(out + 8 * i, _mm_or_ps(_mm_and_ps(lo, a0), _mm_andnot_ps(lo, c0)));
        _mm_storeu_ps(out + 8 * i + 4, _mm_or_ps(_mm_and_ps(hi, a1), _mm_andnot_ps(hi, c1)));
    }
    if (n % 8)
        scale32_scalar(grad + 8 * full, bits + full, n % 8, on, off, copy_on, out + 8 * full);
#else
    scale32_scalar(grad, bits, n, on, off, copy_on, out);
#endif
}

/* x < 0 is false for -0 and NaN: those pass unchanged, as in torch.relu */
#define DEFINE_RELU_PACK(NAME, FLOAT, UINT, MAGNITUDE)                                   \
    static void NAME(const FLOAT* src, int64_t n, FLOAT* out, uint8_t* dst) {            \
        for (int64_t i = 0; 8 * i < n; i++) {                                            \
            int64_t count = (n - 8 * i) < 8 ? (n - 8 * i) : 8;                           \
            uint8_t byte = 0;                                                            \
            for (int j = 0; j < count; j++) {                                            \
                FLOAT v = src[8 * i + j];                                                \
                FLOAT o = v < 0 ? (FLOAT)0 : v;                                          \
                UINT b;                                                                  \
                memcpy(&b, &o, sizeof b);                                                \
                out[8 * i + j] = o;                                                      \
                byte |= (uint8_t)(((b & (MAGNITUDE)) != 0) << j);                        \
            }                                                                            \
            dst[i] = byte;                                                               \
        }                                                                                \
    }

DEFINE_RELU_PACK(relu_pack32_scalar, float, uint32_t, 0x7fffffffu)
DEFINE_RELU_PACK(relu_pack64, double, uint64_t, 0x7fffffffffffffffull)

static void relu_pack32(const float* src, int64_t n, float* out, uint8_t* dst) {
#if defined(__SSE2__)
    int64_t full = n / 8;
    const __m128 zero = _mm_setzero_ps();
    const __m128i magnitude = _mm_set1_epi32(0x7fffffff);
    const __m128i izero = _mm_setzero_si128();
    for (int64_t i = 0; i < full; i++) {
        __m128 a = _mm_loadu_ps(src + 8 * i);
        __m128 b = _mm_loadu_ps(src + 8 * i + 4);
        __m128 oa = _mm_andnot_ps(_mm_cmplt_ps(a, zero), a);
        __m128 ob = _mm_andnot_ps(_mm_cmplt_ps(b, zero), b);
        _mm_storeu_ps(out + 8 * i, oa);
        _mm_storeu_ps(out + 8 * i + 4, ob);
        int lo = _mm_movemask_ps(_mm_castsi128_ps(
            _mm_cmpeq_epi32(_mm_and_si128(_mm_castps_si128(oa), magnitude), izero)));
        int hi = _mm_movemask_ps(_mm_castsi128_ps(
            _mm_cmpeq_epi32(_mm_and_si128(_mm_castps_si128(ob), magnitude), izero)));
        dst[i] = (uint8_t)(~(lo | (hi << 4)));
    }
    if (n % 8) relu_pack32_scalar(src + 8 * full, n % 8, out + 8 * full, dst + full);
#else
    relu_pack32_scalar(src, n, out, dst);
#endif
}

/* Which bodies run: 0 the baseline (SSE2 or plain C), 1 AVX2, 2 AVX-512; never above what the
 * CPU supports. memsave_simd_level(cap) lowers (or restores) the cap, for tests and for
 * comparing the bodies; cap < 0 only asks. Every level writes the same bytes. */
static int simd_cap = 2;

static int cpu_level(void) {
#ifdef MEMSAVE_WIDE
    static int level = -1;  /* a benign race: every thread computes the same value */
    if (level < 0) {
        __builtin_cpu_init();
        level = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return level;
#else
    return 0;
#endif
}

int memsave_simd_level(int cap) {
    if (cap >= 0) simd_cap = cap;
    int cpu = cpu_level();
    return simd_cap < cpu ? simd_cap : cpu;
}

#ifdef MEMSAVE_WIDE
/* AVX-512: 16 elements per step, their bits are two whole bytes (little-endian, as on x86) */
AVX512 static void pack32_avx512(const uint32_t* src, int64_t n, uint8_t* dst) {
    int64_t full = n / 16;
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    for (int64_t i = 0; i < full; i++) {
        uint16_t m = (uint16_t)_mm512_test_epi32_mask(
            _mm512_loadu_si512((const void*)(src + 16 * i)), magnitude);
        memcpy(dst + 2 * i, &m, 2);
    }
    if (n % 16) pack32_scalar(src + 16 * full, n % 16, dst + 2 * full);
}

AVX512 static void select32_avx512(const uint32_t* grad, const uint8_t* bits, int64_t n,
                                   uint32_t* out) {
    int64_t full = n / 16;
    for (int64_t i = 0; i < full; i++) {
        uint16_t m;
        memcpy(&m, bits + 2 * i, 2);
        __m512i g = _mm512_loadu_si512((const void*)(grad + 16 * i));
        _mm512_storeu_si512((void*)(out + 16 * i), _mm512_maskz_mov_epi32((__mmask16)m, g));
    }
    if (n % 16) select32_scalar(grad + 16 * full, bits + 2 * full, n % 16, out + 16 * full);
}

AVX512 static void relu_pack32_avx512(const float* src, int64_t n, float* out, uint8_t* dst) {
    int64_t full = n / 16;
    const __m512 zero = _mm512_setzero_ps();
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    for (int64_t i = 0; i < full; i++) {
        __m512 v = _mm512_loadu_ps(src + 16 * i);
        /* ordered less-than: false for NaN and -0, which pass unchanged */
        __m512 o = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ), zero);
        _mm512_storeu_ps(out + 16 * i, o);
        uint16_t m = (uint16_t)_mm512_test_epi32_mask(_mm512_castps_si512(o), magnitude);
        memcpy(dst + 2 * i, &m, 2);
    }
    if (n % 16) relu_pack32_scalar(src + 16 * full, n % 16, out + 16 * full, dst + 2 * full);
}

/* AVX2: 8 elements per step, their bits one byte */
AVX2 static void pack32_avx2(const uint32_t* src, int64_t n, uint8_t* dst) {
    int64_t full = n / 8;
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t i = 0; i < full; i++) {
        __m256i a = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(src + 8 * i)), magnitude);
        dst[i] = (uint8_t)~_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a, zero)));
    }
    if (n % 8) pack32_scalar(src + 8 * full, n % 8, dst + full);
}

AVX2 static void select32_avx2(const uint32_t* grad, const uint8_t* bits, int64_t n,
                               uint32_t* out) {
    int64_t full = n / 8;
    const __m256i sel = _mm256_set_epi32(128, 64, 32, 16, 8, 4, 2, 1);
    for (int64_t i = 0; i < full; i++) {
        __m256i keep = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits[i]), sel), sel);
        __m256i g = _mm256_loadu_si256((const __m256i*)(grad + 8 * i));
        _mm256_storeu_si256((__m256i*)(out + 8 * i), _mm256_and_si256(g, keep));
    }
    if (n % 8) select32_scalar(grad + 8 * full, bits + full, n % 8, out + 8 * full);
}

AVX2 static void relu_pack32_avx2(const float* src, int64_t n, float* out, uint8_t* dst) {
    int64_t full = n / 8;
    const __m256 zero = _mm256_setzero_ps();
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
    const __m256i izero = _mm256_setzero_si256();
    for (int64_t i = 0; i < full; i++) {
        __m256 v = _mm256_loadu_ps(src + 8 * i);
        __m256 o = _mm256_andnot_ps(_mm256_cmp_ps(v, zero, _CMP_LT_OQ), v);
        _mm256_storeu_ps(out + 8 * i, o);
        __m256i z = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(o), magnitude), izero);
        dst[i] = (uint8_t)~_mm256_movemask_ps(_mm256_castsi256_ps(z));
    }
    if (n % 8) relu_pack32_scalar(src + 8 * full, n % 8, out + 8 * full, dst + full);
}
#endif

/* the float32 bodies at the level in force */
#ifdef MEMSAVE_WIDE
AVX512 static void positive32_avx512(const float* src, int64_t n, uint8_t* dst) {
    int64_t full = n / 16;
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t i = 0; i < full; i++) {
        uint16_t m = (uint16_t)_mm512_cmp_ps_mask(_mm512_loadu_ps(src + 16 * i), zero, _CMP_GT_OQ);
        memcpy(dst + 2 * i, &m, 2);
    }
    if (n % 16) positive32_scalar(src + 16 * full, n % 16, dst + 2 * full);
}

AVX2 static void positive32_avx2(const float* src, int64_t n, uint8_t* dst) {
    int64_t full = n / 8;
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t i = 0; i < full; i++)
        dst[i] = (uint8_t)_mm256_movemask_ps(
            _mm256_cmp_ps(_mm256_loadu_ps(src + 8 * i), zero, _CMP_GT_OQ));
    if (n % 8) positive32_scalar(src + 8 * full, n % 8, dst + full);
}
#endif

static void positive32_any(const float* src, int64_t n, uint8_t* dst) {
#ifdef MEMSAVE_WIDE
    switch (memsave_simd_level(-1)) {
        case 2: positive32_avx512(src, n, dst); return;
        case 1: positive32_avx2(src, n, dst); return;
    }
#endif
    positive32(src, n, dst);
}

static void pack32_any(const uint32_t* src, int64_t n, uint8_t* dst) {
#ifdef MEMSAVE_WIDE
    switch (memsave_simd_level(-1)) {
        case 2: pack32_avx512(src, n, dst); return;
        case 1: pack32_avx2(src, n, dst); return;
    }
#endif
    pack32(src, n, dst);
}

#ifdef MEMSAVE_WIDE
AVX512 static void scale32_avx512(const float* grad, const uint8_t* bits, int64_t n, float on,
                                  float off, int copy_on, float* out) {
    int64_t full = n / 16;
    const __m512 von = _mm512_set1_ps(on), voff = _mm512_set1_ps(off);
    for (int64_t i = 0; i < full; i++) {
        uint16_t m;
        memcpy(&m, bits + 2 * i, 2);
        __m512 g = _mm512_loadu_ps(grad + 16 * i);
        __m512 a = copy_on ? g : _mm512_mul_ps(g, von);
        _mm512_storeu_ps(out + 16 * i, _mm512_mask_blend_ps((__mmask16)m, _mm512_mul_ps(g, voff), a));
    }
    if (n % 16)
        scale32_scalar(grad + 16 * full, bits + 2 * full, n % 16, on, off, copy_on, out + 16 * full);
}

AVX2 static void scale32_avx2(const float* grad, const uint8_t* bits, int64_t n, float on,
                              float off, int copy_on, float* out) {
    int64_t full = n / 8;
    const __m256i sel = _mm256_set_epi32(128, 64, 32, 16, 8, 4, 2, 1);
    const __m256 von = _mm256_set1_ps(on), voff = _mm256_set1_ps(off);
    for (int64_t i = 0; i < full; i++) {
        __m256 keep = _mm256_castsi256_ps(
            _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits[i]), sel), sel));
        __m256 g = _mm256_loadu_ps(grad + 8 * i);
        __m256 a = copy_on ? g : _mm256_mul_ps(g, von);
        _mm256_storeu_ps(out + 8 * i, _mm256_blendv_ps(_mm256_mul_ps(g, voff), a, keep));
    }
    if (n % 8) scale32_scalar(grad + 8 * full, bits + full, n % 8, on, off, copy_on, out + 8 * full);
}
#endif

static void scale32_any(const float* grad, const uint8_t* bits, int64_t n, float on, float off,
                        int copy_on, float* out) {
#ifdef MEMSAVE_WIDE
    switch (memsave_simd_level(-1)) {
        case 2: scale32_avx512(grad, bits, n, on, off, copy_on, out); return;
        case 1: scale32_avx2(grad, bits, n, on, off, copy_on, out); return;
    }
#endif
    scale32(grad, bits, n, on, off, copy_on, out);
}

static void select32_any(const uint32_t* grad, const uint8_t* bits, int64_t n, uint32_t* out) {
#ifdef MEMSAVE_WIDE
    switch (memsave_simd_level(-1)) {
        case 2: select32_avx512(grad, bits, n, out); return;
        case 1: select32_avx2(grad, bits, n, out); return;
    }
#endif
    select32(grad, bits, n, out);
}

static void relu_pack32_any(const float* src, int64_t n, float* out, uint8_t* dst) {
#ifdef MEMSAVE_WIDE
    switch (memsave_simd_level(-1)) {
        case 2: relu_pack32_avx512(src, n, out, dst); return;
        case 1: relu_pack32_avx2(src, n, out, dst); return;
    }
#endif
    relu_pack32(src, n, out, dst);
}

/* out = relu(src) (out may equal src) and its nonzero bits at dst; 0 on success */
int memsave_relu_pack(const void* src, int64_t n, int elem_size, void* out, uint8_t* dst) {
    switch (elem_size) {
        case 4: relu_pack32_any((const float*)src, n, (float*)out, dst); return 0;
        case 8: relu_pack64((const double*)src, n, (double*)out, dst); return 0;
        default: return 1;
    }
}

/* n elements from src (elem_size bytes each) -> ceil(n / 8) bytes at dst; 0 on success */
int memsave_pack_nonzero(const void* src, int64_t n, int elem_size, uint8_t* dst) {
    switch (elem_size) {
        case 2: pack16((const uint16_t*)src, n, dst); return 0;
        case 4: pack32_any((const uint32_t*)src, n, dst); return 0;
        case 8: pack64((const uint64_t*)src, n, dst); return 0;
        default: return 1;
    }
}

/* bits of src[k] > 0 for n float32 or float64 elements -> ceil(n / 8) bytes; 0 on success */
int memsave_pack_positive(const void* src, int64_t n, int elem_size, uint8_t* dst) {
    switch (elem_size) {
        case 4: positive32_any((const float*)src, n, dst); return 0;
        case 8: positive64((const double*)src, n, dst); return 0;
        default: return 1;
    }
}

/* out[k] = bit k of bits ? grad[k] : 0, for n elements of elem_size bytes; 0 on success */
int memsave_select_bits(const void* grad, const uint8_t* bits, int64_t n, int elem_size, void* out) {
    switch (elem_size) {
        case 2: select16((const uint16_t*)grad, bits, n, (uint16_t*)out); return 0;
        case 4: select32_any((const uint32_t*)grad, bits, n, (uint32_t*)out); return 0;
        case 8: select64((const uint64_t*)grad, bits, n, (uint64_t*)out); return 0;
        default: return 1;
    }
}

/* out[k] = bit k of bits ? grad[k] * on : grad[k] * off (on == 1: grad[k] itself), for n float32
 * or float64 elements; on and off are cast to the gradient's type; 0 on success */
int memsave_scale_bits(const void* grad, const uint8_t* bits, int64_t n, int elem_size,
                       double on, double off, void* out) {
    int copy_on = on == 1.0;
    switch (elem_size) {
        case 4:
            scale32_any((const float*)grad, bits, n, (float)on, (float)off, copy_on, (float*)out);
            return 0;
        case 8:
            scale64((const double*)grad, bits, n, on, off, copy_on, (double*)out);
            return 0;
        default: return 1;
    }
}

/* Pooling geometry, spatial dims padded to 3 from the front (size 1, stride 1, no padding). */
typedef struct {
    int64_t out[3], in[3], stride[3], pad[3];
} pool_geom;

static void geom(pool_geom* g, int n, const int64_t* out, const int64_t* in,
                 const int64_t* stride, const int64_t* pad) {
    for (int d = 0; d < 3; d++) {
        int src = d - (3 - n);
        int ok = src >= 0;
        g->out[d] = ok ? out[src] : 1;
        g->in[d] = ok ? in[src] : 1;
        g->stride[d] = ok ? stride[src] : 1;
        g->pad[d] = ok ? pad[src] : 0;
    }
}

/* Visit every output position in order: i counts them, base is the flat input index of its
 * window's first element, walked without division (each step along the last dim adds its
 * stride; each row starts afresh). */
#define FOR_EACH_WINDOW(g, planes, BODY)                                                 \
    do {                                                                                 \
        int64_t i = 0;                                                                   \
        for (int64_t p = 0; p < (planes); p++)                                           \
            for (int64_t a = 0; a < (g)->out[0]; a++)                                    \
                for (int64_t b = 0; b < (g)->out[1]; b++) {                              \
                    int64_t base = (((a) * (g)->stride[0] - (g)->pad[0]) * (g)->in[1]    \
                                    + ((b) * (g)->stride[1] - (g)->pad[1])) * (g)->in[2] \
                                   - (g)->pad[2];                                        \
                    for (int64_t c = 0; c < (g)->out[2]; c++, i++, base += (g)->stride[2]) { \
                        BODY                                                             \
                    }                                                                    \
                }                                                                        \
    } while (0)

#define DEFINE_OFFSETS(NAME, T)                                                          \
    static int NAME(const int64_t* flat, int64_t planes, const pool_geom* g,             \
                    const int32_t* table, int64_t table_len, T* local) {                 \
        FOR_EACH_WINDOW(g, planes, {                                                     \
            int64_t d = flat[i] - base;                                                  \
            if (d < 0 || d >= table_len || table[d] < 0) return 2;                       \
            local[i] = (T)table[d];                                                      \
        });                                                                              \
        return 0;                                                                        \
    }

#define DEFINE_FLAT(NAME, T)                                                             \
    static int NAME(const T* local, int64_t planes, const pool_geom* g,                  \
                    const int64_t* deltas, int64_t window, int64_t* flat) {              \
        FOR_EACH_WINDOW(g, planes, {                                                     \
            int64_t l = (int64_t)local[i];                                               \
            if (l < 0 || l >= window) return 2;                                          \
            flat[i] = base + deltas[l];                                                  \
        });                                                                              \
        return 0;                                                                        \
    }

DEFINE_OFFSETS(offsets8, uint8_t)
DEFINE_OFFSETS(offsets16, int16_t)
DEFINE_OFFSETS(offsets32, int32_t)
DEFINE_FLAT(flat8, uint8_t)
DEFINE_FLAT(flat16, int16_t)
DEFINE_FLAT(flat32, int32_t)

/* flat argmax (int64, planes x prod(out)) -> window offsets of local_size bytes, by the table
 * delta-from-window-start -> offset (-1: no kernel position); 0 on success, else nothing
 * trustworthy was written (an index outside its window) */
int memsave_pool_offsets(const int64_t* flat, int64_t planes, int n, const int64_t* out,
                         const int64_t* in, const int64_t* stride, const int64_t* pad,
                         const int32_t* table, int64_t table_len, int local_size, void* local) {
    pool_geom g;
    if (n < 1 || n > 3) return 1;
    geom(&g, n, out, in, stride, pad);
    switch (local_size) {
        case 1: return offsets8(flat, planes, &g, table, table_len, (uint8_t*)local);
        case 2: return offsets16(flat, planes, &g, table, table_len, (int16_t*)local);
        case 4: return offsets32(flat, planes, &g, table, table_len, (int32_t*)local);
        default: return 1;
    }
}

/* window offsets (local_size bytes each) -> flat argmax (int64): window start + deltas[offset];
 * 0 on success */
int memsave_pool_flat(const void* local, int local_size, int64_t planes, int n,
                      const int64_t* out, const int64_t* in, const int64_t* stride,
                      const int64_t* pad, const int64_t* deltas, int64_t window,
                      int64_t* flat) {
    pool_geom g;
    if (n < 1 || n > 3) return 1;
    geom(&g, n, out, in, stride, pad);
    switch (local_size) {
        case 1: return flat8((const uint8_t*)local, planes, &g, deltas, window, flat);
        case 2: return flat16((const int16_t*)local, planes, &g, deltas, window, flat);
        case 4: return flat32((const int32_t*)local, planes, &g, deltas, window, flat);
        default: return 1;
    }
}
