// One token's product with an 8-bit-code AQLM layer on CPUs without AVX-512: x86-64 with AVX2 and FMA,
// and aarch64 (NEON). The tables stay in L1 and each code's entry is read by a scalar load:
//
//     out[o] = sum_{c in [first_column, last_column)} tables[c][codes[o, c]]
//
// for the rows of `tiles` tiles of 64 rows, where tables[c][k] = <x's group j, codeword k of codebook m>
// for column c = j * M + m; the arguments are those of lut_cpu.c's aqflow_register_product.
//
// Codes are laid out block-major (register_kernel.block_tiles): the code columns in blocks of
// BLOCK_COLUMNS (the last one may be narrower), a block holding, tile after tile, the 64 rows' codes of
// each of its columns: code (tile, c, r) of block b = c / BLOCK_COLUMNS, of width w_b, at byte
//
//     BLOCK_COLUMNS * b * tiles * 64 + tile * w_b * 64 + (c - BLOCK_COLUMNS * b) * 64 + r.
//
// So summing a block over every tile reads one sequential run of memory. In the column-tile layout of
// the AVX-512 kernel ([tiles][columns][64]) the same walk reads a 1 KiB run per tile, a whole tile's
// codes apart; with both cores streaming a layer from memory it read 15-20 % fewer codes a second
// (7.6 against 9.1e9 for a 16384 x 3072 layer, a 2-thread C benchmark on a 2-core Zen 4 EPYC).
//
// Why scalar loads. A column's table is 256 float32 entries, 1 KiB: twice what AVX2's 16 ymm registers
// or NEON's 32 q registers hold, so it cannot sit in registers as with AVX-512. On one core of a Zen 4
// EPYC, with a layer's codes streamed from memory, AVX2 gathers (vgatherdps, 8 rows of one column's
// table) read 2.6e9 codes/s and this loop 5.5e9 (a single-core C benchmark, the other core busy). Intel
// cores were not measured; their gathers are slower again where the microcode mitigation of Gather Data
// Sampling ("Downfall", Moghimi, USENIX Security 2023) is on. A byte-shuffle lookup (pshufb, tbl) covers
// 16 or 64 entries per instruction: a 256-entry table of four byte planes would take tens of shuffles
// per code. Here a code costs one load fused into a scalar add, and about two integer operations to take
// its byte out of a 32-bit word of four codes.
//
// A thread's slice of columns is summed a block at a time: the block's tables (16 KiB) are built just
// before use, so they are in L1, then every row sums them, ROW_BLOCK rows at a time, each row's sum in
// its own register across the block's columns (16 independent chains of adds: their latency is hidden),
// then added into out. The codes AHEAD_TILES tiles ahead in the block are requested meanwhile.
//
// The entries added are float32 (a column's table built with fused multiply-adds over the group, in
// order), so the sums equal the float64 product up to float32 rounding, in any order of the additions.
// Built by aqflow.inference.cpu_dispatch: -O3 -mavx2 -mfma on x86-64, -O3 on aarch64 (NEON is part of
// the architecture there), with -DBLOCK_COLUMNS from register_kernel's layout.
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "lut_cpu_l1.c reads four codes as one little-endian word"
#endif

#define ROWS 64
#ifndef BLOCK_COLUMNS
#define BLOCK_COLUMNS 16
#endif
#define ROW_BLOCK 16
#define AHEAD_TILES 2

// GCC's straight-line vectoriser packs the sixteen scalar adds into shuffles and vector adds, measured
// 5-8 % slower on Zen 4; clang's does not (and ignores GCC's optimize attribute with a warning).
#if defined(__GNUC__) && !defined(__clang__)
#define SCALAR_ADDS __attribute__((optimize("no-tree-slp-vectorize")))
#else
#define SCALAR_ADDS
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// Column c's 256 entries into `table`: x [in] float32, codebooks [M][group][256] float32 (codeword
// index last: 8 codewords' entries are one fused multiply-add per input of the group).
static void column_table(const float *x, const float *codebooks, long num_codebooks, long group, long c,
                         float *table) {
    const float *xj = x + (c / num_codebooks) * group;
    const float *book = codebooks + (c % num_codebooks) * group * 256;
    for (int i = 0; i < 256; i += 32) {
        __m256 e0 = _mm256_setzero_ps(), e1 = _mm256_setzero_ps(), e2 = _mm256_setzero_ps(),
               e3 = _mm256_setzero_ps();
        for (long d = 0; d < group; d++) {
            const __m256 xd = _mm256_set1_ps(xj[d]);
            const float *row = book + d * 256 + i;
            e0 = _mm256_fmadd_ps(xd, _mm256_loadu_ps(row), e0);
            e1 = _mm256_fmadd_ps(xd, _mm256_loadu_ps(row + 8), e1);
            e2 = _mm256_fmadd_ps(xd, _mm256_loadu_ps(row + 16), e2);
            e3 = _mm256_fmadd_ps(xd, _mm256_loadu_ps(row + 24), e3);
        }
        _mm256_storeu_ps(table + i, e0);
        _mm256_storeu_ps(table + i + 8, e1);
        _mm256_storeu_ps(table + i + 16, e2);
        _mm256_storeu_ps(table + i + 24, e3);
    }
}

#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>

// Column c's 256 entries into `table` (as the AVX2 build's: 4 codewords a register, 16 at a time).
static void column_table(const float *x, const float *codebooks, long num_codebooks, long group, long c,
                         float *table) {
    const float *xj = x + (c / num_codebooks) * group;
    const float *book = codebooks + (c % num_codebooks) * group * 256;
    for (int i = 0; i < 256; i += 16) {
        float32x4_t e0 = vdupq_n_f32(0.0f), e1 = vdupq_n_f32(0.0f), e2 = vdupq_n_f32(0.0f), e3 = vdupq_n_f32(0.0f);
        for (long d = 0; d < group; d++) {
            const float *row = book + d * 256 + i;
            e0 = vfmaq_n_f32(e0, vld1q_f32(row), xj[d]);
            e1 = vfmaq_n_f32(e1, vld1q_f32(row + 4), xj[d]);
            e2 = vfmaq_n_f32(e2, vld1q_f32(row + 8), xj[d]);
            e3 = vfmaq_n_f32(e3, vld1q_f32(row + 12), xj[d]);
        }
        vst1q_f32(table + i, e0);
        vst1q_f32(table + i + 4, e1);
        vst1q_f32(table + i + 8, e2);
        vst1q_f32(table + i + 12, e3);
    }
}

#else
#error "lut_cpu_l1.c: build for x86-64 with -mavx2 -mfma, or for aarch64"
#endif

// For the rows of every tile: out[row] (=, or += where `accumulate`) the sum of the entries their codes
// pick in `count` columns of one block, whose tables are tables[0 .. count): the columns' codes of tile
// t at codes + t * tile_bytes, one column's 64 rows after another.
static SCALAR_ADDS void block_sums(const float *tables, const uint8_t *codes, long tiles, long tile_bytes,
                                   long count, int accumulate, float *out) {
    for (long tile = 0; tile < tiles; tile++) {
        const uint8_t *block = codes + tile * tile_bytes;
        if (tile + AHEAD_TILES < tiles)
            for (long c = 0; c < count; c++) __builtin_prefetch(block + AHEAD_TILES * tile_bytes + c * ROWS, 0, 3);
        for (int r = 0; r < ROWS; r += ROW_BLOCK) {
            float sums[ROW_BLOCK] = {0};
            for (long c = 0; c < count; c++) {
                const float *table = tables + c * 256;
                const uint8_t *rows = block + c * ROWS + r;
                for (int w = 0; w < ROW_BLOCK / 4; w++) {
                    uint32_t four;
                    memcpy(&four, rows + 4 * w, 4);
                    sums[4 * w] += table[four & 255];
                    sums[4 * w + 1] += table[(four >> 8) & 255];
                    sums[4 * w + 2] += table[(four >> 16) & 255];
                    sums[4 * w + 3] += table[four >> 24];
                }
            }
            float *o = out + tile * ROWS + r;
            if (accumulate)
                for (int i = 0; i < ROW_BLOCK; i++) o[i] += sums[i];
            else
                for (int i = 0; i < ROW_BLOCK; i++) o[i] = sums[i];
        }
    }
}

// The sums of columns [first_column, last_column) over every row, into out [tiles * 64]: x [in],
// codebooks [M][group][256] float32, codes block-major (above); tables: the caller's scratch of at least
// min(BLOCK_COLUMNS, last - first) x 256 floats. Arguments as aqflow_register_product's. A slice may
// start and end inside blocks: each block's part of it is summed on its own.
void aqflow_l1_product(const float *x, const float *codebooks, long num_codebooks, long group, const uint8_t *codes,
                       long tiles, long columns, long first_column, long last_column, float *tables, float *out) {
    for (long start = first_column; start < last_column;) {
        const long block = start / BLOCK_COLUMNS, block_first = block * BLOCK_COLUMNS;
        const long width = columns - block_first < BLOCK_COLUMNS ? columns - block_first : BLOCK_COLUMNS;
        const long end = last_column < block_first + width ? last_column : block_first + width;
        for (long c = start; c < end; c++) column_table(x, codebooks, num_codebooks, group, c, tables + (c - start) * 256);
        const uint8_t *block_codes = codes + block_first * tiles * ROWS + (start - block_first) * ROWS;
        block_sums(tables, block_codes, tiles, width * ROWS, end - start, start > first_column, out);
        start = end;
    }
}
