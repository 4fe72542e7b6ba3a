// Table sums with the table in AVX-512 registers (the T-MAC idea for 8-bit codes), against gathers
// from an L1-resident table: one token's y[o] = sum_c table[c][codes[o, c]] for 2x8 layers. The
// float16 variant and the gather baseline; the float32 variant is aqflow's own kernel.
// Built by benchmarks/lut_registers.py with `cc -O3 -march=native -shared -fPIC`.
//
// Codes here are laid out [tiles][columns][64 rows] (for each code column, the tile's 64 rows
// contiguous), so that one 16-lane permute serves 16 rows that read the same table.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define ROWS 64

// The exact float32 version is the shipped kernel, src/aqflow/inference/csrc/lut_cpu.c
// (aqflow_register_sums: a column's table loaded once for a group of 8 tiles), compiled into the
// same library by benchmarks/lut_registers.py. Below, its first form (shipped until 2026-11-29):
// the tile's 64 sums in registers, so each column's 1 KiB table is loaded again for every tile.
void sum_f32_registers_per_tile(const float *tables, const uint8_t *codes, int tiles, int columns, float *out) {
    const __m512i bit5 = _mm512_set1_epi32(32), bit6 = _mm512_set1_epi32(64), bit7 = _mm512_set1_epi32(128);
    for (int tile = 0; tile < tiles; tile++) {
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int c = 0; c < columns; c++) {
            const float *t = tables + (size_t)c * 256;
            __m512 tab[16];
            for (int k = 0; k < 16; k++) tab[k] = _mm512_loadu_ps(t + 16 * k);
            const uint8_t *rows = codes + ((size_t)tile * columns + c) * ROWS;
            for (int u = 0; u < 4; u++) {
                const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(rows + 16 * u)));
                const __mmask16 m5 = _mm512_test_epi32_mask(idx, bit5), m6 = _mm512_test_epi32_mask(idx, bit6),
                                m7 = _mm512_test_epi32_mask(idx, bit7);
                __m512 p[4];
                for (int k = 0; k < 4; k++)
                    p[k] = _mm512_mask_blend_ps(m5, _mm512_permutex2var_ps(tab[4 * k], idx, tab[4 * k + 1]),
                                                _mm512_permutex2var_ps(tab[4 * k + 2], idx, tab[4 * k + 3]));
                const __m512 q0 = _mm512_mask_blend_ps(m6, p[0], p[1]), q1 = _mm512_mask_blend_ps(m6, p[2], p[3]);
                acc[u] = _mm512_add_ps(acc[u], _mm512_mask_blend_ps(m7, q0, q1));
            }
        }
        for (int u = 0; u < 4; u++) _mm512_storeu_ps(out + (size_t)tile * ROWS + 16 * u, acc[u]);
    }
}

// fp16 table (256 entries = 8 registers): four 2-register word permutes serve 32 rows at once,
// two levels of blends on bits 6, 7, then widening to float32 for the sum. Not exact: each
// entry is rounded to float16 (about 3 significant digits).
void sum_f16_registers(const uint16_t *tables, const uint8_t *codes, int tiles, int columns, float *out) {
    const __m512i b6 = _mm512_set1_epi16(64), b7 = _mm512_set1_epi16(128);
    for (int tile = 0; tile < tiles; tile++) {
        __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
        const uint8_t *block = codes + (size_t)tile * columns * ROWS;
        for (int c = 0; c < columns; c++) {
            const uint16_t *t = tables + (size_t)c * 256;
            __m512i t0 = _mm512_loadu_si512(t), t1 = _mm512_loadu_si512(t + 32), t2 = _mm512_loadu_si512(t + 64),
                    t3 = _mm512_loadu_si512(t + 96), t4 = _mm512_loadu_si512(t + 128), t5 = _mm512_loadu_si512(t + 160),
                    t6 = _mm512_loadu_si512(t + 192), t7 = _mm512_loadu_si512(t + 224);
            const uint8_t *rows = block + (size_t)c * ROWS;
#define LOOKUP32(lo, hi, u)                                                                              \
    {                                                                                                    \
        __m512i idx = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(rows + 32 * (u))));      \
        __mmask32 m6 = _mm512_test_epi16_mask(idx, b6), m7 = _mm512_test_epi16_mask(idx, b7);            \
        __m512i q0 = _mm512_mask_blend_epi16(m6, _mm512_permutex2var_epi16(t0, idx, t1),                 \
                                             _mm512_permutex2var_epi16(t2, idx, t3));                    \
        __m512i q1 = _mm512_mask_blend_epi16(m6, _mm512_permutex2var_epi16(t4, idx, t5),                 \
                                             _mm512_permutex2var_epi16(t6, idx, t7));                    \
        __m512i v = _mm512_mask_blend_epi16(m7, q0, q1);                                                 \
        lo = _mm512_add_ps(lo, _mm512_cvtph_ps(_mm512_castsi512_si256(v)));                             \
        hi = _mm512_add_ps(hi, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1)));                        \
    }
            LOOKUP32(acc0, acc1, 0) LOOKUP32(acc2, acc3, 1)
#undef LOOKUP32
        }
        // lanes of v are rows 0..31 of the word permute: low half rows 0-15, high half rows 16-31
        float *o = out + (size_t)tile * ROWS;
        _mm512_storeu_ps(o, acc0); _mm512_storeu_ps(o + 16, acc1);
        _mm512_storeu_ps(o + 32, acc2); _mm512_storeu_ps(o + 48, acc3);
    }
}

// The baseline in the same layout as the numba kernels ([tiles][slices][64 rows][32 columns]):
// per row, 32 codes of a slice summed with two 16-lane gathers from the slice's 32 KiB of table.
void sum_f32_gathers(const float *tables, const uint8_t *codes, int tiles, int columns, float *out) {
    const int slices = columns / 32;
    const __m512i lane = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(256));
    const __m512i lane16 = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * 256));
    memset(out, 0, sizeof(float) * (size_t)tiles * ROWS);
    for (int s = 0; s < slices; s++) {
        const float *t = tables + (size_t)s * 32 * 256;
        for (int tile = 0; tile < tiles; tile++) {
            const uint8_t *block = codes + ((size_t)tile * slices + s) * ROWS * 32;
            for (int r = 0; r < ROWS; r++) {
                const uint8_t *row = block + r * 32;
                __m512i i0 = _mm512_add_epi32(lane, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)row)));
                __m512i i1 = _mm512_add_epi32(lane16, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + 16))));
                __m512 v = _mm512_add_ps(_mm512_i32gather_ps(i0, t, 4), _mm512_i32gather_ps(i1, t, 4));
                out[(size_t)tile * ROWS + r] += _mm512_reduce_add_ps(v);
            }
        }
    }
}
