// One token's table sums of an 8-bit-code AQLM layer with each code column's table held in AVX-512
// registers: out[o] = sum_c tables[c][codes[o, c]] for the rows of `tiles` tiles of 64 rows.
//
// codes are laid out [tiles][columns][64] (a tile's 64 rows of one code column contiguous), so one
// 16-lane two-register permute looks up 16 rows in the same 256-entry float32 table: eight permutes
// cover the table's 256 entries, three levels of blends on the code's bits 5-7 pick the right one.
// The entries added are the float32 table's own, so the sums equal a gather kernel's up to the order
// of the additions. Built by aqflow.inference.register_kernel with -O3 -mavx512f -mavx512bw.
#include <immintrin.h>
#include <stdint.h>

#define ROWS 64

void aqflow_register_sums(const float *tables, const uint8_t *codes, long tiles, long columns, float *out) {
    const __m512i bit5 = _mm512_set1_epi32(32), bit6 = _mm512_set1_epi32(64), bit7 = _mm512_set1_epi32(128);
    for (long tile = 0; tile < tiles; tile++) {
        __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
        const uint8_t *block = codes + tile * columns * ROWS;
        for (long c = 0; c < columns; c++) {
            const float *t = tables + c * 256;
            __m512 t0 = _mm512_loadu_ps(t), t1 = _mm512_loadu_ps(t + 16), t2 = _mm512_loadu_ps(t + 32),
                   t3 = _mm512_loadu_ps(t + 48), t4 = _mm512_loadu_ps(t + 64), t5 = _mm512_loadu_ps(t + 80),
                   t6 = _mm512_loadu_ps(t + 96), t7 = _mm512_loadu_ps(t + 112), t8 = _mm512_loadu_ps(t + 128),
                   t9 = _mm512_loadu_ps(t + 144), t10 = _mm512_loadu_ps(t + 160), t11 = _mm512_loadu_ps(t + 176),
                   t12 = _mm512_loadu_ps(t + 192), t13 = _mm512_loadu_ps(t + 208), t14 = _mm512_loadu_ps(t + 224),
                   t15 = _mm512_loadu_ps(t + 240);
            const uint8_t *rows = block + c * ROWS;
#define LOOKUP16(acc, u)                                                                                \
    {                                                                                                   \
        __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(rows + 16 * (u))));        \
        __mmask16 m5 = _mm512_test_epi32_mask(idx, bit5), m6 = _mm512_test_epi32_mask(idx, bit6),       \
                  m7 = _mm512_test_epi32_mask(idx, bit7);                                               \
        __m512 p0 = _mm512_mask_blend_ps(m5, _mm512_permutex2var_ps(t0, idx, t1),                       \
                                         _mm512_permutex2var_ps(t2, idx, t3));                          \
        __m512 p1 = _mm512_mask_blend_ps(m5, _mm512_permutex2var_ps(t4, idx, t5),                       \
                                         _mm512_permutex2var_ps(t6, idx, t7));                          \
        __m512 p2 = _mm512_mask_blend_ps(m5, _mm512_permutex2var_ps(t8, idx, t9),                       \
                                         _mm512_permutex2var_ps(t10, idx, t11));                        \
        __m512 p3 = _mm512_mask_blend_ps(m5, _mm512_permutex2var_ps(t12, idx, t13),                     \
                                         _mm512_permutex2var_ps(t14, idx, t15));                        \
        __m512 q0 = _mm512_mask_blend_ps(m6, p0, p1), q1 = _mm512_mask_blend_ps(m6, p2, p3);            \
        acc = _mm512_add_ps(acc, _mm512_mask_blend_ps(m7, q0, q1));                                     \
    }
            LOOKUP16(acc0, 0) LOOKUP16(acc1, 1) LOOKUP16(acc2, 2) LOOKUP16(acc3, 3)
#undef LOOKUP16
        }
        float *o = out + tile * ROWS;
        _mm512_storeu_ps(o, acc0);
        _mm512_storeu_ps(o + 16, acc1);
        _mm512_storeu_ps(o + 32, acc2);
        _mm512_storeu_ps(o + 48, acc3);
    }
}
