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

// The same float32 sums with the tables as byte planes, for CPUs with AVX-512 VBMI: plane b of a
// column's table holds byte b of its 256 entries (4 registers), so one byte permute pair and a blend on
// the code's bit 7 look up 64 rows in one plane; four planes, then two levels of unpacks joining the
// bytes into float32 words. Per 64 codes: 8 permutes and 8 unpacks against the float32 kernel's 32
// permutes, 12 mask tests and 4 widenings, all on the one shuffle port of Intel's cores. The entries
// and the order of the additions are the float32 kernel's, so the sums are the same bits.
//
// The unpacks work within 128-bit lanes: word k of the result holds, in lane block L, the rows
// 16L + 4k .. 16L + 4k + 3. The sums are kept in that order (row 16L + 4k + i at 16k + 4L + i, a
// transpose of 4x4 blocks of four) and put back in row order once a group's columns are done.
#define VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi")))

// Swaps 4x4 blocks of four floats of a tile's 64 sums (its own inverse): block (k, L) <-> (L, k).
static inline VBMI void transpose_blocks(float *o) {
    const __m512 r0 = _mm512_loadu_ps(o), r1 = _mm512_loadu_ps(o + 16), r2 = _mm512_loadu_ps(o + 32),
                 r3 = _mm512_loadu_ps(o + 48);
    const __m512 t0 = _mm512_shuffle_f32x4(r0, r1, 0x44), t1 = _mm512_shuffle_f32x4(r0, r1, 0xEE),
                 t2 = _mm512_shuffle_f32x4(r2, r3, 0x44), t3 = _mm512_shuffle_f32x4(r2, r3, 0xEE);
    _mm512_storeu_ps(o, _mm512_shuffle_f32x4(t0, t2, 0x88));
    _mm512_storeu_ps(o + 16, _mm512_shuffle_f32x4(t0, t2, 0xDD));
    _mm512_storeu_ps(o + 32, _mm512_shuffle_f32x4(t1, t3, 0x88));
    _mm512_storeu_ps(o + 48, _mm512_shuffle_f32x4(t1, t3, 0xDD));
}

// One plane's bytes for 64 codes: entries 0-127 and 128-255 by a permute each, bit 7 choosing.
static inline VBMI __m512i plane_bytes(__m512i low, __m512i low2, __m512i high, __m512i high2, __m512i idx,
                                       __mmask64 bit7) {
    return _mm512_mask_blend_epi8(bit7, _mm512_permutex2var_epi8(low, idx, low2),
                                  _mm512_permutex2var_epi8(high, idx, high2));
}

// tables: column c's planes at tables + (c - first_column) * 1024, plane b at + 256 b
static VBMI void sums_planes(const uint8_t *tables, const uint8_t *codes, long tiles, long columns,
                             long first_column, long last_column, float *out) {
    for (long group = 0; group < tiles; group += GROUP) {
        const long count = tiles - group < GROUP ? tiles - group : GROUP;
        for (long r = 0; r < count * ROWS; r += 16) _mm512_storeu_ps(out + group * ROWS + r, _mm512_setzero_ps());
        for (long c = first_column; c < last_column; c++) {
            const uint8_t *t = tables + (c - first_column) * 1024;
            request_codes(codes, group, count, tiles, columns, first_column, last_column, c);
            __m512i p[16];
            for (int i = 0; i < 16; i++) p[i] = _mm512_loadu_si512(t + 64 * i);
            for (long tile = group; tile < group + count; tile++) {
                const __m512i idx = _mm512_loadu_si512(codes + (tile * columns + c) * ROWS);
                const __mmask64 bit7 = _mm512_movepi8_mask(idx);
                const __m512i b0 = plane_bytes(p[0], p[1], p[2], p[3], idx, bit7),
                              b1 = plane_bytes(p[4], p[5], p[6], p[7], idx, bit7),
                              b2 = plane_bytes(p[8], p[9], p[10], p[11], idx, bit7),
                              b3 = plane_bytes(p[12], p[13], p[14], p[15], idx, bit7);
                const __m512i low01 = _mm512_unpacklo_epi8(b0, b1), high01 = _mm512_unpackhi_epi8(b0, b1),
                              low23 = _mm512_unpacklo_epi8(b2, b3), high23 = _mm512_unpackhi_epi8(b2, b3);
                const __m512i words[4] = {_mm512_unpacklo_epi16(low01, low23), _mm512_unpackhi_epi16(low01, low23),
                                          _mm512_unpacklo_epi16(high01, high23),
                                          _mm512_unpackhi_epi16(high01, high23)};
                float *o = out + tile * ROWS;
                for (int k = 0; k < 4; k++)
                    _mm512_storeu_ps(o + 16 * k,
                                     _mm512_add_ps(_mm512_loadu_ps(o + 16 * k), _mm512_castsi512_ps(words[k])));
            }
        }
        for (long tile = group; tile < group + count; tile++) transpose_blocks(out + tile * ROWS);
    }
}

// The tables of columns [first_column, last_column) as byte planes into `tables` ((last - first) x
// 1024 bytes), then their sums; arguments as aqflow_register_product's.
VBMI void aqflow_register_product_planes(const float *x, const float *codebooks, long num_codebooks, long group,
                                         const uint8_t *codes, long tiles, long columns, long first_column,
                                         long last_column, uint8_t *tables, float *out) {
    // byte 4j + b of 16 entries -> lane block b, position j
    uint8_t order[64];
    for (int b = 0; b < 4; b++)
        for (int j = 0; j < 16; j++) order[16 * b + j] = (uint8_t)(4 * j + b);
    const __m512i split = _mm512_loadu_si512(order);
    for (long c = first_column; c < last_column; c++) {
        uint8_t *planes = tables + (c - first_column) * 1024;
        for (int i = 0; i < 16; i++) {
            const __m512 entries = entries16(x, codebooks, num_codebooks, group, c, i);
            const __m512i bytes = _mm512_permutexvar_epi8(split, _mm512_castps_si512(entries));
            _mm_storeu_si128((__m128i *)(planes + 16 * i), _mm512_castsi512_si128(bytes));
            _mm_storeu_si128((__m128i *)(planes + 256 + 16 * i), _mm512_extracti32x4_epi32(bytes, 1));
            _mm_storeu_si128((__m128i *)(planes + 512 + 16 * i), _mm512_extracti32x4_epi32(bytes, 2));
            _mm_storeu_si128((__m128i *)(planes + 768 + 16 * i), _mm512_extracti32x4_epi32(bytes, 3));
        }
    }
    sums_planes(tables, codes, tiles, columns, first_column, last_column, out);
}

// The same sums with 16-bit integer tables, for 16-bit activations on CPUs with AVX-512 VBMI and VNNI:
// each block of SCALE_COLUMNS consecutive columns of a slice shares one scale, its largest |entry| /
// 32767, and an entry is held as the nearest multiple of it (error <= half the scale, 2^-16 of the
// block's largest entry; float16 entries are off by up to 2^-11 of their own size). Two byte planes a
// table, so one permute pair and a blend look up 64 rows of a plane, one unpack joins the bytes into
// 16-bit words, and VNNI's multiply-add (p0, not the shuffle port) adds each word into a 32-bit sum:
// per 64 codes 4 permutes and 2 unpacks on the shuffle port, against 8 and 8 for the float32 planes.
// A block's integer sums, times its scale, go into the float32 sums.
//
// The 32-bit sums come out of the unpacks in a fixed order: sum a (0-3) lane k holds row
// 16 (k / 4) + 2 (k % 4) + (a & 1) + 8 (a >> 1); each tile's float32 sums keep that order until a group
// of tiles is done, then unpermute_words puts them back in row order.
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")))
#define SCALE_COLUMNS 8

// A tile's 64 sums from the unpacks' order to row order, in place: rows 16m .. 16m + 15 from lanes
// 4m .. 4m + 3 of each sum.
static inline VNNI void unpermute_words(float *o) {
    const __m512 a0 = _mm512_loadu_ps(o), a1 = _mm512_loadu_ps(o + 16), a2 = _mm512_loadu_ps(o + 32),
                 a3 = _mm512_loadu_ps(o + 48);
    __m512 rows[4];
    for (int m = 0; m < 4; m++) {
        int32_t index[16];
        for (int j = 0; j < 16; j++) index[j] = 4 * m + (j & 7) / 2 + ((j & 1) ? 16 : 0);
        const __m512i idx = _mm512_loadu_si512(index);
        rows[m] = _mm512_mask_blend_ps(0xFF00, _mm512_permutex2var_ps(a0, idx, a1), _mm512_permutex2var_ps(a2, idx, a3));
    }
    for (int m = 0; m < 4; m++) _mm512_storeu_ps(o + 16 * m, rows[m]);
}

// tables: column c's two planes (low bytes, high bytes) at tables + (c - first_column) * 512; scales:
// one a block of SCALE_COLUMNS columns from first_column.
static VNNI void sums_int16(const uint8_t *tables, const float *scales, const uint8_t *codes, long tiles,
                            long columns, long first_column, long last_column, float *out) {
    const __m512i even = _mm512_set1_epi32(1), odd = _mm512_set1_epi32(1 << 16);
    int32_t words[GROUP][64] __attribute__((aligned(64)));
    for (long group = 0; group < tiles; group += GROUP) {
        const long count = tiles - group < GROUP ? tiles - group : GROUP;
        for (long r = 0; r < count * ROWS; r += 16) _mm512_storeu_ps(out + group * ROWS + r, _mm512_setzero_ps());
        for (long block = first_column; block < last_column; block += SCALE_COLUMNS) {
            const long block_end = block + SCALE_COLUMNS < last_column ? block + SCALE_COLUMNS : last_column;
            for (long n = 0; n < count; n++)
                for (int k = 0; k < 4; k++) _mm512_store_si512(words[n] + 16 * k, _mm512_setzero_si512());
            for (long c = block; c < block_end; c++) {
                const uint8_t *t = tables + (c - first_column) * 512;
                request_codes(codes, group, count, tiles, columns, first_column, last_column, c);
                __m512i p[8];
                for (int i = 0; i < 8; i++) p[i] = _mm512_loadu_si512(t + 64 * i);
                for (long tile = group; tile < group + count; tile++) {
                    const __m512i idx = _mm512_loadu_si512(codes + (tile * columns + c) * ROWS);
                    const __mmask64 bit7 = _mm512_movepi8_mask(idx);
                    const __m512i low = plane_bytes(p[0], p[1], p[2], p[3], idx, bit7),
                                  high = plane_bytes(p[4], p[5], p[6], p[7], idx, bit7);
                    const __m512i w0 = _mm512_unpacklo_epi8(low, high), w1 = _mm512_unpackhi_epi8(low, high);
                    int32_t *w = words[tile - group];
                    _mm512_store_si512(w, _mm512_dpwssd_epi32(_mm512_load_si512(w), w0, even));
                    _mm512_store_si512(w + 16, _mm512_dpwssd_epi32(_mm512_load_si512(w + 16), w0, odd));
                    _mm512_store_si512(w + 32, _mm512_dpwssd_epi32(_mm512_load_si512(w + 32), w1, even));
                    _mm512_store_si512(w + 48, _mm512_dpwssd_epi32(_mm512_load_si512(w + 48), w1, odd));
                }
            }
            const __m512 scale = _mm512_set1_ps(scales[(block - first_column) / SCALE_COLUMNS]);
            for (long n = 0; n < count; n++) {
                float *o = out + (group + n) * ROWS;
                for (int k = 0; k < 4; k++)
                    _mm512_storeu_ps(o + 16 * k,
                                     _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(words[n] + 16 * k)), scale,
                                                     _mm512_loadu_ps(o + 16 * k)));
            }
        }
        for (long tile = group; tile < group + count; tile++) unpermute_words(out + tile * ROWS);
    }
}

// The int16 tables of columns [first_column, last_column) into `tables` ((last - first) x 512 bytes of
// planes, then a float scale per block of SCALE_COLUMNS columns), then their sums; arguments as
// aqflow_register_product's.
VNNI void aqflow_register_product_int16(const float *x, const float *codebooks, long num_codebooks, long group,
                                        const uint8_t *codes, long tiles, long columns, long first_column,
                                        long last_column, uint8_t *tables, float *out) {
    float *scales = (float *)(tables + (last_column - first_column) * 512);
    for (long block = first_column; block < last_column; block += SCALE_COLUMNS) {
        const long block_end = block + SCALE_COLUMNS < last_column ? block + SCALE_COLUMNS : last_column;
        __m512 entries[SCALE_COLUMNS][16];
        __m512 largest = _mm512_setzero_ps();
        for (long c = block; c < block_end; c++)
            for (int i = 0; i < 16; i++) {
                entries[c - block][i] = entries16(x, codebooks, num_codebooks, group, c, i);
                largest = _mm512_max_ps(largest, _mm512_abs_ps(entries[c - block][i]));
            }
        const float top = _mm512_reduce_max_ps(largest);
        scales[(block - first_column) / SCALE_COLUMNS] = top / 32767.0f;
        const __m512 inverse = _mm512_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
        for (long c = block; c < block_end; c++) {
            uint8_t *planes = tables + (c - first_column) * 512;
            for (int i = 0; i < 16; i++) {
                const __m512i steps = _mm512_cvtps_epi32(_mm512_mul_ps(entries[c - block][i], inverse));
                const __m256i words = _mm512_cvtsepi32_epi16(steps);
                _mm_storeu_si128((__m128i *)(planes + 16 * i), _mm256_cvtepi16_epi8(words));
                _mm_storeu_si128((__m128i *)(planes + 256 + 16 * i), _mm256_cvtepi16_epi8(_mm256_srli_epi16(words, 8)));
            }
        }
    }
    sums_int16(tables, scales, codes, tiles, columns, first_column, last_column, out);
}
