// Reading one row of a weight matrix stored in its file format, as 32-bit
// words. Variants: WEIGHT_F32, WEIGHT_F16, WEIGHT_BF16, WEIGHT_Q8_0. With
// ARENA the words come from the expert-arena slab `g_slab`.

#ifdef ARENA
// As many slabs as the device lets one stage bind (set at pipeline creation).
layout(constant_id = 0) const uint MAX_SLABS = 16;
layout(set = 1, binding = 0) readonly buffer Slab { uint w[]; } slabs[MAX_SLABS];
layout(set = 1, binding = 0) readonly buffer Slab4 { uvec4 w[]; } slabs4[MAX_SLABS];
uint g_slab;
#define WORD(i) slabs[g_slab].w[i]
#define WORD4(i) slabs4[g_slab].w[i]
#else
// The same buffer as words and as 16-byte vectors (for aligned rows).
layout(set = 1, binding = 0) readonly buffer Weight { uint w[]; } weight;
layout(set = 1, binding = 0) readonly buffer Weight4 { uvec4 w[]; } weight4;
#define WORD(i) weight.w[i]
#define WORD4(i) weight4.w[i]
#endif

vec4 x4(uint i) { return vec4(s[i], s[i + 1u], s[i + 2u], s[i + 3u]); }

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
    if ((row_byte & 15u) == 0u && (cols & 3u) == 0u) {
        for (uint i = t; i < cols / 4u; i += WG) acc += dot(uintBitsToFloat(WORD4((row_byte >> 4) + i)), x4(x + 4u * i));
        return acc;
    }
    for (uint i = t; i < cols; i += WG) acc += uintBitsToFloat(WORD(base + i)) * s[x + i];
#elif defined(WEIGHT_F16) || defined(WEIGHT_BF16)
    uint base = row_byte >> 2;
    if ((row_byte & 15u) == 0u && (cols & 7u) == 0u) {
        for (uint i = t; i < cols / 8u; i += WG) {
            uvec4 u = WORD4((row_byte >> 4) + i);
#ifdef WEIGHT_F16
            vec4 lo = vec4(unpackHalf2x16(u.x), unpackHalf2x16(u.y));
            vec4 hi = vec4(unpackHalf2x16(u.z), unpackHalf2x16(u.w));
#else
            vec4 lo = uintBitsToFloat(uvec4(u.x << 16, u.x & 0xffff0000u, u.y << 16, u.y & 0xffff0000u));
            vec4 hi = uintBitsToFloat(uvec4(u.z << 16, u.z & 0xffff0000u, u.w << 16, u.w & 0xffff0000u));
#endif
            acc += dot(lo, x4(x + 8u * i)) + dot(hi, x4(x + 8u * i + 4u));
        }
        return acc;
    }
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
