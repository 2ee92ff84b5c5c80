/* Quantizes rows of f32 with ggml's own quantizer, no importance matrix
 * (what llama-quantize runs): the reference bytes for tests/quant_blocks.rs.
 *
 *   ggml_quantize_ref TYPE N_PER_ROW IN.f32 OUT.bin
 *
 * Built by make_fixtures.py against a llama.cpp build (ggml.h, libggml-base).
 */
#include <ggml.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct { const char *name; enum ggml_type type; } TYPES[] = {
    {"Q4_0", GGML_TYPE_Q4_0}, {"Q4_1", GGML_TYPE_Q4_1}, {"Q5_0", GGML_TYPE_Q5_0},
    {"Q5_1", GGML_TYPE_Q5_1}, {"Q8_0", GGML_TYPE_Q8_0}, {"Q2_K", GGML_TYPE_Q2_K},
    {"Q3_K", GGML_TYPE_Q3_K}, {"Q4_K", GGML_TYPE_Q4_K}, {"Q5_K", GGML_TYPE_Q5_K},
    {"Q6_K", GGML_TYPE_Q6_K},
};

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s TYPE N_PER_ROW IN.f32 OUT.bin\n", argv[0]);
        return 2;
    }
    enum ggml_type type = GGML_TYPE_COUNT;
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++) {
        if (strcmp(argv[1], TYPES[i].name) == 0) type = TYPES[i].type;
    }
    if (type == GGML_TYPE_COUNT) {
        fprintf(stderr, "unknown type %s\n", argv[1]);
        return 2;
    }
    long n_per_row = atol(argv[2]);
    FILE *f = fopen(argv[3], "rb");
    if (!f || n_per_row <= 0) return 1;
    fseek(f, 0, SEEK_END);
    long n = ftell(f) / 4;
    fseek(f, 0, SEEK_SET);
    float *src = malloc(n * 4);
    if (fread(src, 4, n, f) != (size_t)n) return 1;
    fclose(f);
    long rows = n / n_per_row;
    size_t bytes = ggml_row_size(type, n_per_row) * rows;
    void *dst = malloc(bytes);
    ggml_quantize_chunk(type, src, dst, 0, rows, n_per_row, NULL);
    FILE *o = fopen(argv[4], "wb");
    if (!o || fwrite(dst, 1, bytes, o) != bytes) return 1;
    fclose(o);
    return 0;
}
