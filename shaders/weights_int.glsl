// The fast matvec kernels (module suffix `_fast`, define FAST): the quantized
// types against activations rounded to 8 bits, with integer dot products of
// four packed bytes (SPV_KHR_integer_dot_product; NVIDIA's IDP4A). Included
// by weights.glsl in place of its float decoders; same layout, same items,
// same `Xs load_x(x, b, k, v)` / `Wt item_w(row, g, b, k)` /
// `float w_dot(w, b, k, xs)` contract: an item's weight levels and factors
// decoded once (`item_w`), then dotted with the activations of each entry
// that shares them (`w_dot`).
//
// Activations: each workgroup first rounds its x (pc.cols values, or its
// split's columns) into
// shared memory, in blocks of 32 (`prepare_x`; in a pass of several tokens
// act_int8.comp rounds them once for all workgroups and `copy_x` copies;
// the batch modules, BATCH, read that region in place): `x ~ d q` with
// `d = amax / 127`, `q = roundEven(x * 127 / amax)` in -127..127, as the
// CPU's fast path does (src/quant/dot/act.rs; finer than its 256-value
// blocks for the K-quants), plus the sum of the levels of every 16 values.
// A block holding a NaN or an infinity gets d = NaN, so the output is NaN,
// as on the exact path.
//
// Each work item then meets its 16-byte run of activation levels in
// integers: unsigned weight levels (the stored codes, before their offset)
// times signed activation levels, summed exactly in i32 by `sudot4`
// (Q8_0's signed levels by `sdot4`); offsets and minima multiply the level
// sums, so every product is the exact dot product of the dequantized
// weights with the rounded activations `d q`, and the error against the
// exact kernels is at most sum over blocks of (amax / 254) sum |w| (plus
// f32 rounding): the bound the twins check (src/vulkan/twins.rs).
//
// Rows longer than FAST_MAX_COLS use the exact pipelines (the recorder picks).

// OpSDot and OpSUDot on 32-bit words holding four 8-bit lanes
// (packed-vector format 0, PackedVectorFormat4x8Bit). Capabilities:
// DotProduct (6019), DotProductInput4x8BitPacked (6018).
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4450)
int sdot4(uint a, uint b, spirv_literal int packed_format);
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4452)
int sudot4(uint signed_a, uint unsigned_b, spirv_literal int packed_format);

// sum_i a_i b_i over four 16-byte runs: a signed, b unsigned (or both signed).
int sudot16(uvec4 a, uvec4 b) {
    return (sudot4(a.x, b.x, 0) + sudot4(a.y, b.y, 0)) + (sudot4(a.z, b.z, 0) + sudot4(a.w, b.w, 0));
}
int sdot16(uvec4 a, uvec4 b) {
    return (sdot4(a.x, b.x, 0) + sdot4(a.y, b.y, 0)) + (sdot4(a.z, b.z, 0) + sdot4(a.w, b.w, 0));
}

#include "act_int8.glsl"
#ifdef BATCH
// The batch modules read the region act_int8.comp rounded in place (an
// entry's vector `v` of the region at scratch float `x`): no shared copy,
// so nothing but the reductions' slots in shared memory.
uvec4 XQ(uint x, uint v, uint e) { return floatBitsToUint(xv(x + 4u * (v * (pc.cols >> 4) + e))); }
float XD(uint x, uint v, uint b) { return s[x + XQ_D + v * (pc.cols >> 5) + b]; }
int XS(uint x, uint v, uint e) { return floatBitsToInt(s[x + XQ_S + v * (pc.cols >> 4) + e]); }
#else
shared uvec4 xq[FAST_MAX_COLS / 16u];  // the levels, 16 per entry
shared float xd[FAST_MAX_COLS / 32u];  // the scale of each block of 32
shared int xs[FAST_MAX_COLS / 16u];    // the sum of each 16 levels
// The activations in shared memory (x and v unused).
uvec4 XQ(uint x, uint v, uint e) { return xq[e]; }
float XD(uint x, uint v, uint b) { return xd[b]; }
int XS(uint x, uint v, uint e) { return xs[e]; }

// Rounds columns c0 .. c1 - 1 of x (multiples of 32: the whole row, or a
// split of it, matvec.comp's kcols) into shared memory at their own
// indices; every invocation of the workgroup must call it. Four invocations
// share a block of 32, eight values each (act_int8.glsl).
void prepare_x(uint x, uint c0, uint c1) {
    uint b1 = c1 >> 5;
    // Numbered by subgroup, as in matvec.comp, so each four share a subgroup.
    uint t = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;
    uint quarter = t & 3u;
    for (uint b0 = c0 >> 5; b0 < b1; b0 += gl_WorkGroupSize.x >> 2) {
        uint b = b0 + (t >> 2);
        // Every invocation runs the shuffles; those past the end take a zero block.
        bool live = b < b1;
        uint at = x + 32u * min(b, b1 - 1u) + 8u * quarter;
        vec4 v0 = live ? xv(at) : vec4(0.0), v1 = live ? xv(at + 4u) : vec4(0.0);
        uint w0, w1;
        int sum;
        float d;
        round_block(v0, v1, w0, w1, sum, d);
        if (live) {
            uint e = 2u * b + (quarter >> 1), w = 2u * (quarter & 1u);
            xq[e][w] = w0;
            xq[e][w + 1u] = w1;
            if ((quarter & 1u) == 0u) xs[e] = sum;
            if (quarter == 0u) xd[b] = d;
        }
    }
    barrier();
}

// Copies activations act_int8.comp rounded into shared memory, the same
// values prepare_x would make, for columns c0 .. c1 - 1 (multiples of 32):
// vector `v` (of pc.cols values) of the region at scratch float `q` (levels
// as words, then scales at XQ_D, then the sums of 16 at XQ_S). Every
// invocation of the workgroup must call it.
void copy_x(uint q, uint v, uint c0, uint c1) {
    uint t = gl_LocalInvocationIndex, ne = pc.cols >> 4, nb = pc.cols >> 5;
    uint e0 = v * ne, b0 = v * nb;
    for (uint e = (c0 >> 4) + t; e < (c1 >> 4); e += gl_WorkGroupSize.x) {
        xq[e] = floatBitsToUint(xv(q + 4u * (e0 + e)));
        xs[e] = floatBitsToInt(s[q + XQ_S + e0 + e]);
    }
    for (uint b = (c0 >> 5) + t; b < (c1 >> 5); b += gl_WorkGroupSize.x) xd[b] = s[q + XQ_D + b0 + b];
    barrier();
}
#endif

#if defined(WEIGHT_Q4_0) || defined(WEIGHT_Q4_1) || defined(WEIGHT_Q5_0) || defined(WEIGHT_Q5_1)
// One item per block (levels32): values j and 16 + j.
#define QK 32u
#define IPB 1u
struct Xs { uvec4 lo, hi; float d; int sum; };

struct Wt { uvec4 lo, hi; vec2 dm; };

Xs load_x(uint x, uint b, uint k, uint v) {
    uint e = 2u * b;
    return Xs(XQ(x, v, e), XQ(x, v, e + 1u), XD(x, v, b), XS(x, v, e) + XS(x, v, e + 1u));
}

Wt item_w(uint row, uint g, uint b, uint k) {
    Wt w;
    levels32(row, g, b, w.lo, w.hi);
    w.dm = dm32(g);
    return w;
}

float w_dot(Wt w, uint b, uint k, Xs xs) {
    int s = sudot16(xs.lo, w.lo) + sudot16(xs.hi, w.hi);
    vec2 dm = w.dm;
#if defined(WEIGHT_Q4_0)
    s -= 8 * xs.sum;
#elif defined(WEIGHT_Q5_0)
    s -= 16 * xs.sum;
#endif
    return xs.d * (dm.x * float(s) + dm.y * float(xs.sum));
}

#elif defined(WEIGHT_Q8_0)
// Two items per block, 16 signed bytes each.
#define QK 32u
#define IPB 2u
struct Xs { uvec4 q; float d; };

struct Wt { uvec4 q; float d; };

Xs load_x(uint x, uint b, uint k, uint v) { return Xs(XQ(x, v, 2u * b + k), XD(x, v, b)); }

Wt item_w(uint row, uint g, uint b, uint k) { return Wt(P4(row + 32u * b + 16u * k), half_at(F0 + 2u * g)); }

float w_dot(Wt w, uint b, uint k, Xs xs) { return w.d * xs.d * float(sdot16(w.q, xs.q)); }

#elif defined(WEIGHT_Q2_K) || defined(WEIGHT_Q3_K)
// Four items per block (levels_k23): group j of item k = 2n + kk is the
// activation run 16b + 8n + 2j + kk.
#define QK 256u
#define IPB 4u
struct Xs { uvec4 q[4]; vec4 d; ivec4 s; };

struct Wt { uvec4 lv[4]; ivec4 sc; vec2 dm; };

Xs load_x(uint x, uint b, uint k, uint v) {
    Xs r;
    uint i0 = 16u * b + 8u * (k >> 1) + (k & 1u);
    [[unroll]] for (uint j = 0u; j < 4u; j++) {
        r.q[j] = XQ(x, v, i0 + 2u * j);
        r.s[j] = XS(x, v, i0 + 2u * j);
        r.d[j] = XD(x, v, (i0 + 2u * j) >> 1);
    }
    return r;
}

Wt item_w(uint row, uint g, uint b, uint k) {
    Wt w;
    levels_k23(row, g, b, k, w.lv, w.sc);
    w.dm = dm_k23(g);
    return w;
}

float w_dot(Wt w, uint b, uint k, Xs xs) {
    float acc = 0.0, mins = 0.0;  // mins: Q2_K only
    [[unroll]] for (uint j = 0u; j < 4u; j++) {
        int t = sudot16(xs.q[j], w.lv[j]);
#ifdef WEIGHT_Q2_K
        acc += xs.d[j] * float((w.sc[j] & 0xF) * t);
        mins += xs.d[j] * float((w.sc[j] >> 4) * xs.s[j]);
#else
        acc += xs.d[j] * float(w.sc[j] * (t - 4 * xs.s[j]));
#endif
    }
    return w.dm.x * acc - w.dm.y * mins;
}

#elif defined(WEIGHT_Q4_K) || defined(WEIGHT_Q5_K)
// Four items per block (levels_k45): item c's low values are the
// activation runs 16b + 4c and the next, its high values two runs further.
#define QK 256u
#define IPB 4u
struct Xs { uvec4 lo[2], hi[2]; vec2 d; ivec2 s; };

struct Wt { uvec4 lo[2], hi[2]; vec4 f; };

Xs load_x(uint x, uint b, uint k, uint v) {
    uint i = 16u * b + 4u * k;
    return Xs(uvec4[2](XQ(x, v, i), XQ(x, v, i + 1u)), uvec4[2](XQ(x, v, i + 2u), XQ(x, v, i + 3u)),
              vec2(XD(x, v, i >> 1), XD(x, v, (i >> 1) + 1u)),
              ivec2(XS(x, v, i) + XS(x, v, i + 1u), XS(x, v, i + 2u) + XS(x, v, i + 3u)));
}

Wt item_w(uint row, uint g, uint b, uint k) {
    Wt w;
    levels_k45(row, g, b, k, w.lo, w.hi, w.f);
    return w;
}

float w_dot(Wt w, uint b, uint k, Xs xs) {
    vec2 t = xs.d * vec2(sudot16(xs.lo[0], w.lo[0]) + sudot16(xs.lo[1], w.lo[1]), sudot16(xs.hi[0], w.hi[0]) + sudot16(xs.hi[1], w.hi[1]));
    vec2 sums = xs.d * vec2(xs.s);
    return (w.f.x * t.x + w.f.y * t.y) - (w.f.z * sums.x + w.f.w * sums.y);
}

#elif defined(WEIGHT_Q6_K)
// Eight items per block (levels_q6k): item k = 4hh + 2p + (k & 1), low
// values in activation run 16b + 8hh + 2p + (k & 1), high values four runs
// further.
#define QK 256u
#define IPB 8u
struct Xs { uvec4 lo, hi; vec2 d; ivec2 s; };

struct Wt { uvec4 lo, hi; vec2 sc; };

Xs load_x(uint x, uint b, uint k, uint v) {
    uint i = 16u * b + 8u * (k >> 2) + 2u * ((k >> 1) & 1u) + (k & 1u);
    return Xs(XQ(x, v, i), XQ(x, v, i + 4u), vec2(XD(x, v, i >> 1), XD(x, v, (i >> 1) + 2u)), ivec2(XS(x, v, i), XS(x, v, i + 4u)));
}

Wt item_w(uint row, uint g, uint b, uint k) {
    Wt w;
    levels_q6k(row, g, b, k, w.lo, w.hi, w.sc);
    return w;
}

float w_dot(Wt w, uint b, uint k, Xs xs) {
    vec2 t = xs.d * vec2(sudot16(xs.lo, w.lo) - 32 * xs.s.x, sudot16(xs.hi, w.hi) - 32 * xs.s.y);
    return w.sc.x * t.x + w.sc.y * t.y;
}

#else
#error "the fast kernels cover the quantized types only"
#endif
