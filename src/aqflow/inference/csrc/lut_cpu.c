// One token's product with an 8-bit-code AQLM layer, each code column's table held in AVX-512
// registers: out[o] = sum_{c in [first_column, last_column)} tables[c][codes[o, c]] for the rows of
// `tiles` tiles of 64 rows, where tables[c][k] = <x's group j, codeword k of codebook m> for column
// c = j * M + m (aqflow_register_product builds them, aqflow_register_sums is given them).
//
// codes are laid out [tiles][columns][64] (a tile's 64 rows of one code column contiguous), so one
// 16-lane two-register permute looks up 16 rows in the same 256-entry float32 table: eight permutes
// cover the table's 256 entries, three levels of blends on the code's bits 5-7 pick the right one.
// A column's table is loaded into registers once for a group of GROUP tiles (512 rows), whose sums
// stay in L1 meanwhile: loaded once per tile, the table's 1 KiB would be 16 bytes read per byte of
// codes, from L2 or beyond (a layer's tables are 0.75-2 MiB), and that traffic, not the permutes,
// set the pace. A caller splits a layer's columns between threads (each thread's tables a slice)
// and adds the threads' partial sums. The entries added are the float32 table's own, so the sums
// equal a gather kernel's up to the order of the additions (and, where the tables are built here,
// the rounding of their entries). Built by aqflow.inference.register_kernel with -O3 -mavx512f
// -mavx512bw.
#include <immintrin.h>
#include <stdint.h>

#define ROWS 64
#define GROUP 8
// Code columns ahead of the one being summed whose lines are requested (prefetch; 0: none): a thread's
// slice of a tile is a short run of lines (48 at 16 threads on a 3B layer), too short for the hardware
// prefetchers to follow, so without it every run starts with trips to memory. Set by the build
// (register_kernel: $AQFLOW_CPU_PREFETCH).
#ifndef AHEAD
#define AHEAD 8
#endif

// Requests the code lines of column `c + AHEAD` of this group's tiles, or past the slice's end, of the
// next group's first columns.
static inline void request_codes(const uint8_t *codes, long group, long count, long tiles, long columns,
                                 long first_column, long last_column, long c) {
    if (AHEAD <= 0) return;
    long column = c + AHEAD, first_tile = group, n = count;
    if (column >= last_column) {
        column = first_column + (column - last_column);
        first_tile = group + GROUP;
        n = tiles - first_tile < GROUP ? tiles - first_tile : GROUP;
        if (column >= last_column) return;
    }
    for (long tile = first_tile; tile < first_tile + n; tile++)
        _mm_prefetch((const char *)(codes + (tile * columns + column) * ROWS), _MM_HINT_T0);
}

// tables: column c's 256 entries at tables + (c - first_column) * 256
static void sums(const float *tables, const uint8_t *codes, long tiles, long columns, long first_column,
                 long last_column, float *out) {
    const __m512i bit5 = _mm512_set1_epi32(32), bit6 = _mm512_set1_epi32(64), bit7 = _mm512_set1_epi32(128);
    for (long group = 0; group < tiles; group += GROUP) {
        const long count = tiles - group < GROUP ? tiles - group : GROUP;
        for (long r = 0; r < count * ROWS; r += 16) _mm512_storeu_ps(out + group * ROWS + r, _mm512_setzero_ps());
        for (long c = first_column; c < last_column; c++) {
            const float *t = tables + (c - first_column) * 256;
            request_codes(codes, group, count, tiles, columns, first_column, last_column, c);
            const __m512 t0 = _mm512_loadu_ps(t), t1 = _mm512_loadu_ps(t + 16), t2 = _mm512_loadu_ps(t + 32),
                         t3 = _mm512_loadu_ps(t + 48), t4 = _mm512_loadu_ps(t + 64), t5 = _mm512_loadu_ps(t + 80),
                         t6 = _mm512_loadu_ps(t + 96), t7 = _mm512_loadu_ps(t + 112), t8 = _mm512_loadu_ps(t + 128),
                         t9 = _mm512_loadu_ps(t + 144), t10 = _mm512_loadu_ps(t + 160),
                         t11 = _mm512_loadu_ps(t + 176), t12 = _mm512_loadu_ps(t + 192),
                         t13 = _mm512_loadu_ps(t + 208), t14 = _mm512_loadu_ps(t + 224),
                         t15 = _mm512_loadu_ps(t + 240);
            for (long tile = group; tile < group + count; tile++) {
                const uint8_t *rows = codes + (tile * columns + c) * ROWS;
                float *o = out + tile * ROWS;
                for (int u = 0; u < 4; u++) {
                    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(rows + 16 * u)));
                    const __mmask16 m5 = _mm512_test_epi32_mask(idx, bit5), m6 = _mm512_test_epi32_mask(idx, bit6),
                                    m7 = _mm512_test_epi32_mask(idx, bit7);
                    const __m512 p0 = _mm512_mask_blend_ps(m5, _mm512_permutex2var_ps(t0, idx, t1),
                                                           _mm512_permutex2var_ps(t2, idx, t3));
                    const __m512 p1 = _mm512_mask_blend_ps(m5, _mm512_permutex2var_ps(t4, idx, t5),
                                                           _mm512_permutex2var_ps(t6, idx, t7));
                    const __m512 p2 = _mm512_mask_blend_ps(m5, _mm512_permutex2var_ps(t8, idx, t9),
                                                           _mm512_permutex2var_ps(t10, idx, t11));
                    const __m512 p3 = _mm512_mask_blend_ps(m5, _mm512_permutex2var_ps(t12, idx, t13),
                                                           _mm512_permutex2var_ps(t14, idx, t15));
                    const __m512 q0 = _mm512_mask_blend_ps(m6, p0, p1), q1 = _mm512_mask_blend_ps(m6, p2, p3);
                    _mm512_storeu_ps(o + 16 * u,
                                     _mm512_add_ps(_mm512_loadu_ps(o + 16 * u), _mm512_mask_blend_ps(m7, q0, q1)));
                }
            }
        }
    }
}

void aqflow_register_sums(const float *tables, const uint8_t *codes, long tiles, long columns, long first_column,
                          long last_column, float *out) {
    sums(tables + first_column * 256, codes, tiles, columns, first_column, last_column, out);
}

// The tables of columns [first_column, last_column) built into `tables` ((last - first) x 256
// floats, the caller's scratch: a thread builds only its own slice's, which then stay in its
// caches), then their sums. x [in] float32; codebooks [M][group][256] float32 (codeword index
// last, so 16 codewords' entries are one fused multiply-add per input of the group).
// Entries 16i..16i+15 of column c's table: <x's group j, codewords 16i.. of codebook m>, c = j*M + m.
static inline __m512 entries16(const float *x, const float *codebooks, long num_codebooks, long group, long c, int i) {
    const float *xj = x + (c / num_codebooks) * group;
    const float *book = codebooks + (c % num_codebooks) * group * 256 + 16 * i;
    __m512 entry = _mm512_setzero_ps();
    for (long d = 0; d < group; d++) entry = _mm512_fmadd_ps(_mm512_set1_ps(xj[d]), _mm512_loadu_ps(book + d * 256), entry);
    return entry;
}

void aqflow_register_product(const float *x, const float *codebooks, long num_codebooks, long group,
                             const uint8_t *codes, long tiles, long columns, long first_column, long last_column,
                             float *tables, float *out) {
    for (long c = first_column; c < last_column; c++)
        for (int i = 0; i < 16; i++)
            _mm512_storeu_ps(tables + (c - first_column) * 256 + 16 * i,
                             entries16(x, codebooks, num_codebooks, group, c, i));
    sums(tables, codes, tiles, columns, first_column, last_column, out);
}

// The same product with float16 tables, for 16-bit activations (the caller rounds the outputs to
// bfloat16 or float16): a table is 8 registers, and one word permute pair looks up 32 rows, half
// the permutes per code of the float32 tables. Each entry is rounded to float16 (relative error
// <= 2^-11), about an eighth of the bfloat16 output's own rounding; the sums are float32.
static void sums16(const uint16_t *tables, const uint8_t *codes, long tiles, long columns, long first_column,
                   long last_column, float *out) {
    const __m512i bit6 = _mm512_set1_epi16(64), bit7 = _mm512_set1_epi16(128);
    for (long group = 0; group < tiles; group += GROUP) {
        const long count = tiles - group < GROUP ? tiles - group : GROUP;
        for (long r = 0; r < count * ROWS; r += 16) _mm512_storeu_ps(out + group * ROWS + r, _mm512_setzero_ps());
        for (long c = first_column; c < last_column; c++) {
            const uint16_t *t = tables + (c - first_column) * 256;
            request_codes(codes, group, count, tiles, columns, first_column, last_column, c);
            const __m512i t0 = _mm512_loadu_si512(t), t1 = _mm512_loadu_si512(t + 32), t2 = _mm512_loadu_si512(t + 64),
                          t3 = _mm512_loadu_si512(t + 96), t4 = _mm512_loadu_si512(t + 128),
                          t5 = _mm512_loadu_si512(t + 160), t6 = _mm512_loadu_si512(t + 192),
                          t7 = _mm512_loadu_si512(t + 224);
            for (long tile = group; tile < group + count; tile++) {
                const uint8_t *rows = codes + (tile * columns + c) * ROWS;
                float *o = out + tile * ROWS;
                for (int u = 0; u < 2; u++) {
                    const __m512i idx = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(rows + 32 * u)));
                    const __mmask32 m6 = _mm512_test_epi16_mask(idx, bit6), m7 = _mm512_test_epi16_mask(idx, bit7);
                    const __m512i p0 = _mm512_mask_blend_epi16(m6, _mm512_permutex2var_epi16(t0, idx, t1),
                                                               _mm512_permutex2var_epi16(t2, idx, t3));
                    const __m512i p1 = _mm512_mask_blend_epi16(m6, _mm512_permutex2var_epi16(t4, idx, t5),
                                                               _mm512_permutex2var_epi16(t6, idx, t7));
                    const __m512i h = _mm512_mask_blend_epi16(m7, p0, p1);
                    float *o32 = o + 32 * u;
                    _mm512_storeu_ps(o32, _mm512_add_ps(_mm512_loadu_ps(o32), _mm512_cvtph_ps(_mm512_castsi512_si256(h))));
                    _mm512_storeu_ps(o32 + 16, _mm512_add_ps(_mm512_loadu_ps(o32 + 16),
                                                             _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1))));
                }
            }
        }
    }
}

void aqflow_register_product_f16(const float *x, const float *codebooks, long num_codebooks, long group,
                                 const uint8_t *codes, long tiles, long columns, long first_column, long last_column,
                                 uint16_t *tables, float *out) {
    for (long c = first_column; c < last_column; c++)
        for (int i = 0; i < 16; i++)
            _mm256_storeu_si256((__m256i *)(tables + (c - first_column) * 256 + 16 * i),
                                _mm512_cvtps_ph(entries16(x, codebooks, num_codebooks, group, c, i),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    sums16(tables, codes, tiles, columns, first_column, last_column, out);
}
