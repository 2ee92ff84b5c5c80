// Reading one row of a weight matrix stored in its file format, as 32-bit
// words. Variants: WEIGHT_F32, WEIGHT_F16, WEIGHT_BF16, WEIGHT_Q8_0. With
// ARENA the words come from the expert-arena slab `g_slab`.

#ifdef ARENA
// As many slabs as the device lets one stage bind (set at pipeline creation).
layout(constant_id = 0) const uint MAX_SLABS = 16;
layout(set = 1, binding = 0) readonly buffer Slab { uint w[]; } slabs[MAX_SLABS];
uint g_slab;
#define WORD(i) slabs[g_slab].w[i]
#else
layout(set = 1, binding = 0) readonly buffer Weight { uint w[]; } weight;
#define WORD(i) weight.w[i]
#endif

#ifdef WEIGHT_Q8_0
// Four bytes at any byte address (buffers are padded to whole words).
uint word_at(uint byte_addr) {
    uint i = byte_addr >> 2, sh = (byte_addr & 3u) * 8u;
    return sh == 0u ? WORD(i) : (WORD(i) >> sh) | (WORD(i + 1u) << (32u - sh));
}
#endif

// This invocation's share of dot(row, x); `row_byte` is the row's first byte,
// `x` the scratch offset of the input.
float row_dot(uint row_byte, uint x, uint cols) {
    float acc = 0.0;
    uint t = gl_LocalInvocationIndex;
#if defined(WEIGHT_F32)
    uint base = row_byte >> 2;
    for (uint i = t; i < cols; i += WG) acc += uintBitsToFloat(WORD(base + i)) * s[x + i];
#elif defined(WEIGHT_F16) || defined(WEIGHT_BF16)
    uint base = row_byte >> 2;
    for (uint p = t; p < cols / 2u; p += WG) {
        uint u = WORD(base + p);
#ifdef WEIGHT_F16
        vec2 v = unpackHalf2x16(u);
#else
        vec2 v = vec2(uintBitsToFloat(u << 16), uintBitsToFloat(u & 0xffff0000u));
#endif
        acc += v.x * s[x + 2u * p] + v.y * s[x + 2u * p + 1u];
    }
#elif defined(WEIGHT_Q8_0)
    for (uint b = t; b < cols / 32u; b += WG) {
        uint a = row_byte + b * 34u;
        float d = unpackHalf2x16((WORD(a >> 2) >> ((a & 3u) * 8u)) & 0xffffu).x;
        float sum = 0.0;
        for (uint j = 0u; j < 8u; j++) {
            int q = int(word_at(a + 2u + 4u * j));
            uint xi = x + b * 32u + 4u * j;
            sum += float(bitfieldExtract(q, 0, 8)) * s[xi] + float(bitfieldExtract(q, 8, 8)) * s[xi + 1u]
                 + float(bitfieldExtract(q, 16, 8)) * s[xi + 2u] + float(bitfieldExtract(q, 24, 8)) * s[xi + 3u];
        }
        acc += d * sum;
    }
#else
#error "define one of WEIGHT_F32, WEIGHT_F16, WEIGHT_BF16, WEIGHT_Q8_0"
#endif
    return acc;
}
