// Test driver of csrc/lut_cpu_l1.c's aqflow_l1_product, linked against a built kernel library (the NEON
// build run under qemu-aarch64): reads one product's operands from a file, writes its sums.
//
// input: 7 int64 (num_codebooks M, group g, tiles, columns, first_column, last_column, in_features),
//        x float32 [in], codebooks float32 [M][g][256], codes uint8 [tiles * columns * 64] block-major
//        (register_kernel.block_tiles, as the kernel reads them)
// output: out float32 [tiles * 64]
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

void aqflow_l1_product(const float *x, const float *codebooks, long num_codebooks, long group, const uint8_t *codes,
                       long tiles, long columns, long first_column, long last_column, float *tables, float *out);

static void *read_array(FILE *file, size_t count, size_t size) {
    void *data = malloc(count * size + 1);
    if (data == NULL || fread(data, size, count, file) != count) {
        fprintf(stderr, "l1_driver: short input\n");
        exit(2);
    }
    return data;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: l1_driver INPUT OUTPUT\n");
        return 2;
    }
    FILE *input = fopen(argv[1], "rb");
    if (input == NULL) return 2;
    int64_t *header = read_array(input, 7, sizeof(int64_t));
    const long num_codebooks = header[0], group = header[1], tiles = header[2], columns = header[3],
               first_column = header[4], last_column = header[5], in_features = header[6];
    float *x = read_array(input, in_features, sizeof(float));
    float *codebooks = read_array(input, num_codebooks * group * 256, sizeof(float));
    uint8_t *codes = read_array(input, tiles * columns * 64, 1);
    fclose(input);
    float *tables = malloc((last_column - first_column) * 256 * sizeof(float));
    float *out = malloc(tiles * 64 * sizeof(float));
    aqflow_l1_product(x, codebooks, num_codebooks, group, codes, tiles, columns, first_column, last_column, tables,
                      out);
    FILE *output = fopen(argv[2], "wb");
    if (output == NULL || fwrite(out, sizeof(float), tiles * 64, output) != (size_t)(tiles * 64)) return 2;
    fclose(output);
    return 0;
}
