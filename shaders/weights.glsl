// Weight rows in the device layout of src/vulkan/layout.rs (payload of
// 16-byte aligned blocks, then up to two field arrays of per-block scales),
// one work item at a time. One type per module: WEIGHT_F32, WEIGHT_F16,
// WEIGHT_BF16, WEIGHT_Q4_0, WEIGHT_Q4_1, WEIGHT_Q5_0, WEIGHT_Q5_1,
// WEIGHT_Q8_0, WEIGHT_Q2_K, WEIGHT_Q3_K, WEIGHT_Q4_K, WEIGHT_Q5_K,
// WEIGHT_Q6_K. With ARENA the bytes come from the expert-arena slab `g_slab`.
//
// Include after the push-constant block `pc` (uses pc.cols, pc.row_bytes).
// With FAST the quantized types are decoded by weights_int.glsl instead
// (8-bit activations, integer dot products); both define `prepare_x(x, c0,
// c1)` (columns c0 .. c1 - 1 of the entry's activations at x), which every
// invocation calls once per entry before the first item (not the batch
// modules, BATCH, which read rounded activations in place).
// Each type defines
//   QK    values per block (the float types: per 16-byte item)
//   IPB   work items per block
//   XV    vec4s of activations per item
//   Xs load_x(x, b, k, v)              the activations of item k of block b
//                                      (shared by every row the invocation
//                                      handles) of the entry at x (FAST: in
//                                      shared memory, or with BATCH vector v
//                                      of the rounded region at x)
//   Wt item_w(row, g, b, k)            the item's weights, decoded once for
//                                      every entry that shares them
//   float w_dot(w, b, k, xs)           that item's share of dot(row, x)
// (the exact kernels: `float item_dot(row, g, b, k, xs)`, both in one, and
// an item_w that only keeps row and g; a fast kernel decodes in item_w),
// with `row` the byte offset of the row's payload, `b` the block within the
// row, `g` the block within the part (row * blocks per row + b, indexing the
// field arrays at byte offsets F0 and F1).
//
// Quantized values become floats without int-to-float conversions (a
// quarter-rate instruction on NVIDIA): a byte q ORed into the mantissa of
// 2^23 is the float 2^23 + q, and subtracting 2^23 + bias leaves q - bias
// exactly. Per-block scales multiply per-item sums (d * sum(q x)); minima
// use the activations' sums (m * sum(x)), computed once per item.

#ifdef ARENA
// As many slabs as the device lets one stage bind (set at pipeline creation).
layout(constant_id = 0) const uint MAX_SLABS = 16;
layout(set = 1, binding = 0) readonly restrict buffer Slab { uint w[]; } slabs[MAX_SLABS];
layout(set = 1, binding = 0) readonly restrict buffer Slab4 { uvec4 w[]; } slabs4[MAX_SLABS];
uint g_slab;
#define WORD(i) slabs[g_slab].w[i]
#define WORD4(i) slabs4[g_slab].w[i]
#else
layout(set = 1, binding = 0) readonly restrict buffer Weight { uint w[]; } weight;
layout(set = 1, binding = 0) readonly restrict buffer Weight4 { uvec4 w[]; } weight4;
#define WORD(i) weight.w[i]
#define WORD4(i) weight4.w[i]
#endif

// The scratch buffer (set 0, binding 0) as vec4s: activations start at
// multiples of four floats (the recorder checks).
layout(set = 0, binding = 0) readonly buffer ScratchVec4 { vec4 s4[]; };

// Byte offsets of the field arrays in the bound buffer (set by main).
uint F0, F1;

// 4 (16) bytes at a byte offset that is a multiple of 4 (16).
uint W(uint byte) { return WORD(byte >> 2); }
uvec4 P4(uint byte) { return WORD4(byte >> 4); }
// The f16 at an even byte offset.
float half_at(uint byte) { return unpackHalf2x16(W(byte) >> ((byte & 2u) << 3)).x; }

// The four bytes of `w` (each below 256) as floats, minus `bias`.
vec4 f4(uint w, float bias) {
    uvec4 b = (uvec4(w) >> uvec4(0u, 8u, 16u, 24u)) & 0xFFu;
    return uintBitsToFloat(b | 0x4B000000u) - (8388608.0 + bias);
}

// Activations x[i..i+4] (i a multiple of 4).
vec4 xv(uint i) { return s4[i >> 2]; }

float hsum(vec4 v) { return (v.x + v.y) + (v.z + v.w); }

// Shared by both kernel families: each quantized type's item decoded to
// its levels (the stored codes as bytes of 32-bit words, before any offset)
// and the factors that scale them; the exact kernels turn the levels into
// floats (`f4`), the fast ones multiply them as bytes.

// Bits 0..3 of h moved to bit 4 of bytes 0..3.
uint spread4(uint h) { return (((h & 0xFu) * 0x00204081u) & 0x01010101u) << 4; }

// Byte i of the 12 packed K-quant scale bytes.
uint byte_of(uvec3 s, uint i) { return (s[i >> 2] >> (8u * (i & 3u))) & 0xFFu; }

// Scale and minimum j of the 12 packed bytes (as the CPU's scale_min_k4).
vec2 scale_min(uvec3 s, uint j) {
    if (j < 4u) return vec2(byte_of(s, j) & 63u, byte_of(s, j + 4u) & 63u);
    return vec2((byte_of(s, j + 4u) & 0xFu) | ((byte_of(s, j - 4u) >> 6) << 4),
                (byte_of(s, j + 4u) >> 4) | ((byte_of(s, j) >> 6) << 4));
}

#if defined(WEIGHT_Q4_0) || defined(WEIGHT_Q4_1) || defined(WEIGHT_Q5_0) || defined(WEIGHT_Q5_1)
// One item per block: its 16 bytes of qs hold values j (low nibble of byte
// j) and j + 16 (high nibble). Q5: bit j of qh is the fifth bit of value j.
// Levels of values 4i.. in lo[i], of 16 + 4i.. in hi[i].
void levels32(uint row, uint g, uint b, out uvec4 lo, out uvec4 hi) {
    uvec4 q = P4(row + 16u * b);
    lo = q & 0x0F0F0F0Fu;
    hi = (q >> 4) & 0x0F0F0F0Fu;
#if defined(WEIGHT_Q5_0) || defined(WEIGHT_Q5_1)
    uint qh = W(F0 + 4u * g);
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        lo[i] |= spread4(qh >> (4u * i));
        hi[i] |= spread4(qh >> (16u + 4u * i));
    }
#endif
}

// The block's scale d and minimum m (0 for the types with an offset).
vec2 dm32(uint g) {
#if defined(WEIGHT_Q4_0)
    return vec2(half_at(F0 + 2u * g), 0.0);
#elif defined(WEIGHT_Q5_0)
    return vec2(half_at(F1 + 2u * g), 0.0);
#elif defined(WEIGHT_Q4_1)
    return unpackHalf2x16(W(F0 + 4u * g));
#else
    return unpackHalf2x16(W(F1 + 4u * g));
#endif
}

#elif defined(WEIGHT_Q2_K) || defined(WEIGHT_Q3_K)
// Four items per block: item k = 2n + kk takes the 16 qs bytes 32n + 16kk,
// whose bits 2j..2j+1 are value 128n + 32j + 16kk + l (l the byte), with
// scale 8n + 2j + kk. Q3_K: bit 4n + j of hmask byte 16kk + l is the
// value's third bit. Levels of group j in lv[j]; Q2_K: sc[j] the scale
// byte (low nibble the scale, high nibble the minimum); Q3_K: sc[j] the
// signed six-bit scale.
void levels_k23(uint row, uint g, uint b, uint k, out uvec4 lv[4], out ivec4 sc) {
    uint n = k >> 1, kk = k & 1u;
#ifdef WEIGHT_Q2_K
    uint blk = row + 80u * b;
    uvec4 q = P4(blk + 16u + 16u * k);
    uvec2 w = uvec2(W(blk + 8u * n), W(blk + 8u * n + 4u));
    [[unroll]] for (uint j = 0u; j < 4u; j++) {
        lv[j] = (q >> (2u * j)) & 0x03030303u;
        sc[j] = int((w[j >> 1] >> (8u * (kk + 2u * (j & 1u)))) & 0xFFu);
    }
#else
    uint blk = row + 96u * b;
    uvec4 q = P4(blk + 32u + 16u * k);
    uvec4 hm = P4(blk + 16u * kk);
    uvec3 w = uvec3(W(F0 + 12u * g), W(F0 + 12u * g + 4u), W(F0 + 12u * g + 8u));
    [[unroll]] for (uint j = 0u; j < 4u; j++) {
        // Six-bit scale 8n + m: four low bits from byte m (high nibble when n = 1), two high from byte 8 + (m & 3).
        uint m = 2u * j + kk, idx = 8u * n + m;
        uint low = (w[m >> 2] >> (8u * (m & 3u) + 4u * n)) & 0xFu;
        uint high = (w.z >> (8u * (idx & 3u) + 2u * (idx >> 2))) & 3u;
        lv[j] = ((q >> (2u * j)) & 0x03030303u) | (((hm >> (4u * n + j)) & 0x01010101u) << 2);
        sc[j] = int(low | (high << 4)) - 32;
    }
#endif
}

// The block's scale d and (Q2_K) minimum scale dmin.
vec2 dm_k23(uint g) {
#ifdef WEIGHT_Q2_K
    return unpackHalf2x16(W(F0 + 4u * g));
#else
    return vec2(half_at(F1 + 2u * g), 0.0);
#endif
}

#elif defined(WEIGHT_Q4_K) || defined(WEIGHT_Q5_K)
// Four items per block, one per group c of 64 values: item c takes the 32
// qs bytes 32c; byte l holds value 64c + l (low nibble, scale 2c) and
// 64c + 32 + l (high nibble, scale 2c + 1). Q5_K: bits 2c and 2c + 1 of qh
// byte l are their fifth bits. Field 0 is the 16-byte header (d, dmin, 12
// bytes of six-bit scales and minima), decoded once per item.

// Half h of item c: levels of values 64c + 16h.. (lo) and 32 further (hi).
void levels_k45_half(uint row, uint b, uint c, uint h, out uvec4 lo, out uvec4 hi) {
#ifdef WEIGHT_Q4_K
    uvec4 q = P4(row + 128u * b + 32u * c + 16u * h);
    lo = q & 0x0F0F0F0Fu;
    hi = (q >> 4) & 0x0F0F0F0Fu;
#else
    uint blk = row + 160u * b;
    uvec4 qh = P4(blk + 16u * h);
    uvec4 q = P4(blk + 32u + 32u * c + 16u * h);
    lo = (q & 0x0F0F0F0Fu) | (((qh >> (2u * c)) & 0x01010101u) << 4);
    hi = ((q >> 4) & 0x0F0F0F0Fu) | (((qh >> (2u * c + 1u)) & 0x01010101u) << 4);
#endif
}

// Item c's scales from block g's header: (d sc_2c, d sc_2c+1, dmin m_2c, dmin m_2c+1).
vec4 scales_k45(uint g, uint c) {
    uvec4 hd = P4(F0 + 16u * g);
    vec2 dm = unpackHalf2x16(hd.x);
    vec2 sm1 = scale_min(hd.yzw, 2u * c), sm2 = scale_min(hd.yzw, 2u * c + 1u);
    return vec4(dm.x * sm1.x, dm.x * sm2.x, dm.y * sm1.y, dm.y * sm2.y);
}

// Item c: levels of values 64c + 16h.. in lo[h], 32 further in hi[h], and
// its scales f (scales_k45).
void levels_k45(uint row, uint g, uint b, uint c, out uvec4 lo[2], out uvec4 hi[2], out vec4 f) {
    [[unroll]] for (uint h = 0u; h < 2u; h++) levels_k45_half(row, b, c, h, lo[h], hi[h]);
    f = scales_k45(g, c);
}

#elif defined(WEIGHT_Q6_K)
// Eight items per block: item k = 4hh + 2p + (k & 1) takes the 16 ql bytes
// 64hh + 32p + l0 (l0 = 16 (k & 1)) and the 16 qh bytes 128 + 32hh + l0:
// byte l holds value 128hh + 32p + l0 + l (low nibble, qh bits 2p, scale
// 8hh + (k & 1) + 2p) and the value 64 further (high nibble, qh bits
// 2p + 4, scale 4 further). The 16 int8 scales sit at 192 in the payload.
// Levels (six bits, offset 32) in lo and hi; sc = d times their scales.
void levels_q6k(uint row, uint g, uint b, uint k, out uvec4 lo, out uvec4 hi, out vec2 sc) {
    uint hh = k >> 2, p = (k >> 1) & 1u, l0 = 16u * (k & 1u);
    uint blk = row + 208u * b;
    uvec4 q = P4(blk + 64u * hh + 32u * p + l0);
    uvec4 qh = P4(blk + 128u + 32u * hh + l0);
    uint m = 8u * ((k & 1u) + 2u * p);
    sc = half_at(F0 + 2u * g)
       * vec2(bitfieldExtract(int(W(blk + 192u + 8u * hh)), int(m), 8), bitfieldExtract(int(W(blk + 196u + 8u * hh)), int(m), 8));
    lo = (q & 0x0F0F0F0Fu) | (((qh >> (2u * p)) & 0x03030303u) << 4);
    hi = ((q >> 4) & 0x0F0F0F0Fu) | (((qh >> (2u * p + 4u)) & 0x03030303u) << 4);
}
#endif

#ifdef FAST
#include "weights_int.glsl"
#else
// The exact kernels read the activations as they are.
void prepare_x(uint x, uint c0, uint c1) {}

#if defined(WEIGHT_F32) || defined(WEIGHT_F16) || defined(WEIGHT_BF16)
// Float rows are zero-padded to 16 bytes; the activations past `cols` are
// masked (they may be anything).
#define QK 1u
#define IPB 1u
#ifdef WEIGHT_F32
#define XV 1
#else
#define XV 2
#endif
struct Xs { vec4 v[XV]; };

vec4 xv_masked(uint x, uint col) {
    if (col + 4u <= pc.cols) return xv(x + col);
    vec4 v = vec4(0.0);
    [[unroll]] for (uint e = 0u; e < 4u; e++) if (col + e < pc.cols) v[e] = s[x + col + e];
    return v;
}

Xs load_x(uint x, uint b, uint k, uint v) {
    Xs r;
    [[unroll]] for (uint i = 0u; i < XV; i++) r.v[i] = xv_masked(x, 4u * (XV * b + i));
    return r;
}

float item_dot(uint row, uint g, uint b, uint k, Xs xs) {
    uvec4 u = P4(row + 16u * b);
#if defined(WEIGHT_F32)
    return dot(uintBitsToFloat(u), xs.v[0]);
#elif defined(WEIGHT_F16)
    return dot(vec4(unpackHalf2x16(u.x), unpackHalf2x16(u.y)), xs.v[0])
         + dot(vec4(unpackHalf2x16(u.z), unpackHalf2x16(u.w)), xs.v[1]);
#else
    return dot(uintBitsToFloat(uvec4(u.x << 16, u.x & 0xffff0000u, u.y << 16, u.y & 0xffff0000u)), xs.v[0])
         + dot(uintBitsToFloat(uvec4(u.z << 16, u.z & 0xffff0000u, u.w << 16, u.w & 0xffff0000u)), xs.v[1]);
#endif
}

#elif defined(WEIGHT_Q4_0) || defined(WEIGHT_Q4_1) || defined(WEIGHT_Q5_0) || defined(WEIGHT_Q5_1)
// One item per block (levels32).
#define QK 32u
#define IPB 1u
#define XV 8
#if defined(WEIGHT_Q4_0)
#define BIAS 8.0
#elif defined(WEIGHT_Q5_0)
#define BIAS 16.0
#else
#define BIAS 0.0
#endif
struct Xs { vec4 v[XV]; float sum; };

Xs load_x(uint x, uint b, uint k, uint v) {
    Xs r;
    r.sum = 0.0;
    [[unroll]] for (uint i = 0u; i < 8u; i++) {
        r.v[i] = xv(x + 32u * b + 4u * i);
        r.sum += hsum(r.v[i]);
    }
    return r;
}

float item_dot(uint row, uint g, uint b, uint k, Xs xs) {
    uvec4 lo, hi;
    levels32(row, g, b, lo, hi);
    float acc = 0.0;
    [[unroll]] for (uint i = 0u; i < 4u; i++) acc += dot(f4(lo[i], BIAS), xs.v[i]) + dot(f4(hi[i], BIAS), xs.v[4u + i]);
    vec2 dm = dm32(g);
    return dm.x * acc + dm.y * xs.sum;
}

#elif defined(WEIGHT_Q8_0)
// Two items per block, 16 signed bytes each.
#define QK 32u
#define IPB 2u
#define XV 4
struct Xs { vec4 v[XV]; };

Xs load_x(uint x, uint b, uint k, uint v) {
    Xs r;
    [[unroll]] for (uint i = 0u; i < 4u; i++) r.v[i] = xv(x + 32u * b + 16u * k + 4u * i);
    return r;
}

float item_dot(uint row, uint g, uint b, uint k, Xs xs) {
    uvec4 q = P4(row + 32u * b + 16u * k);
    float acc = 0.0;
    // Flipping the sign bit maps int8 v to the unsigned byte v + 128.
    [[unroll]] for (uint i = 0u; i < 4u; i++) acc += dot(f4(q[i] ^ 0x80808080u, 128.0), xs.v[i]);
    return half_at(F0 + 2u * g) * acc;
}

#elif defined(WEIGHT_Q2_K) || defined(WEIGHT_Q3_K)
// Four items per block (levels_k23).
#define QK 256u
#define IPB 4u
#define XV 16
struct Xs { vec4 v[XV]; vec4 sum; };

Xs load_x(uint x, uint b, uint k, uint v) {
    Xs r;
    uint c0 = x + 256u * b + 128u * (k >> 1) + 16u * (k & 1u);
    [[unroll]] for (uint j = 0u; j < 4u; j++) {
        r.sum[j] = 0.0;
        [[unroll]] for (uint i = 0u; i < 4u; i++) {
            r.v[4u * j + i] = xv(c0 + 32u * j + 4u * i);
            r.sum[j] += hsum(r.v[4u * j + i]);
        }
    }
    return r;
}

float item_dot(uint row, uint g, uint b, uint k, Xs xs) {
    uvec4 lv[4];
    ivec4 sc;
    levels_k23(row, g, b, k, lv, sc);
    float acc = 0.0, mins = 0.0;  // mins: Q2_K only
    [[unroll]] for (uint j = 0u; j < 4u; j++) {
        float t = 0.0;
#ifdef WEIGHT_Q2_K
        [[unroll]] for (uint i = 0u; i < 4u; i++) t += dot(f4(lv[j][i], 0.0), xs.v[4u * j + i]);
        acc += float(sc[j] & 0xF) * t;
        mins += float(sc[j] >> 4) * xs.sum[j];
#else
        [[unroll]] for (uint i = 0u; i < 4u; i++) t += dot(f4(lv[j][i], 4.0), xs.v[4u * j + i]);
        acc += float(sc[j]) * t;
#endif
    }
    vec2 dm = dm_k23(g);
    return dm.x * acc - dm.y * mins;
}

#elif defined(WEIGHT_Q4_K) || defined(WEIGHT_Q5_K)
// Four items per block, one per group of 64 values (levels_k45).
#define QK 256u
#define IPB 4u
#define XV 16
struct Xs { vec4 v[XV]; vec2 sum; };

Xs load_x(uint x, uint b, uint k, uint v) {
    Xs r;
    uint c0 = x + 256u * b + 64u * k;
    r.sum = vec2(0.0);
    [[unroll]] for (uint i = 0u; i < 8u; i++) {
        r.v[i] = xv(c0 + 4u * i);
        r.v[8u + i] = xv(c0 + 32u + 4u * i);
        r.sum += vec2(hsum(r.v[i]), hsum(r.v[8u + i]));
    }
    return r;
}

float item_dot(uint row, uint g, uint b, uint k, Xs xs) {
    uvec4 lo[2], hi[2];
    vec4 f;
    levels_k45(row, g, b, k, lo, hi, f);
    float l = 0.0, h = 0.0;
    [[unroll]] for (uint s = 0u; s < 2u; s++) {
        [[unroll]] for (uint i = 0u; i < 4u; i++) {
            l += dot(f4(lo[s][i], 0.0), xs.v[4u * s + i]);
            h += dot(f4(hi[s][i], 0.0), xs.v[8u + 4u * s + i]);
        }
    }
    return (f.x * l + f.y * h) - (f.z * xs.sum.x + f.w * xs.sum.y);
}

#elif defined(WEIGHT_Q6_K)
// Eight items per block (levels_q6k).
#define QK 256u
#define IPB 8u
#define XV 8
struct Xs { vec4 v[XV]; };

Xs load_x(uint x, uint b, uint k, uint v) {
    Xs r;
    uint c0 = x + 256u * b + 128u * (k >> 2) + 32u * ((k >> 1) & 1u) + 16u * (k & 1u);
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        r.v[i] = xv(c0 + 4u * i);
        r.v[4u + i] = xv(c0 + 64u + 4u * i);
    }
    return r;
}

float item_dot(uint row, uint g, uint b, uint k, Xs xs) {
    uvec4 lo, hi;
    vec2 sc;
    levels_q6k(row, g, b, k, lo, hi, sc);
    float l = 0.0, h = 0.0;
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        l += dot(f4(lo[i], 32.0), xs.v[i]);
        h += dot(f4(hi[i], 32.0), xs.v[4u + i]);
    }
    return sc.x * l + sc.y * h;
}

#else
#error "define one of the WEIGHT_* types"
#endif

// The exact kernels decode an item where they use it: its "weights" are
// where to find them, and w_dot is item_dot.
struct Wt { uint row, g; };
Wt item_w(uint row, uint g, uint b, uint k) { return Wt(row, g); }
float w_dot(Wt w, uint b, uint k, Xs xs) { return item_dot(w.row, w.g, b, k, xs); }
#endif
