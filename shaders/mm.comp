#version 450
#extension GL_NV_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_control_flow_attributes : require
// Y = W X for a pass of tokens on the tensor cores: the matrix-matrix twin
// of matvec.comp for its batches (same push constants, entries and
// epilogues), where the device has cooperative matrices
// (VK_NV_cooperative_matrix: 16x16x16, f16 inputs, f32 sums; the host runs
// this module only with subgroups of 32, eight to a workgroup).
//
// A workgroup computes a tile of BM = 128 output rows (SwiGLU: 64 gate rows
// and their 64 up rows) for BN consecutive entries of the dispatch
// (workgroup y-index: entries BN y .. BN y + BN - 1): 128 for a plain
// matrix (the tokens of a pass: each decoded weight serves up to 128 of
// them), 32 for the routed experts (src/vulkan/pipelines.rs: mm_entries).
// Entries of a tile that read different weights (the (token, expert) pairs
// of a pass, grouped by expert) run one after the other: each run of
// entries with the same slot sweeps the rows once. With moe_group.comp's
// tile table (tiles_off) a tile is instead one expert's pairs (up to BN):
// each expert's weights are decoded once for all its pairs, where tiles of
// BN consecutive pairs split an expert's run between two tiles.
//
// Each step of BK = 64 columns decodes the tile's weights into shared
// memory as f16 (weights.glsl's levels and scales, the exact dequantized
// value rounded once; Q8_0 in packed f16 arithmetic, which rounds the same
// product once) and stores the run's activations there as f16, then the
// eight subgroups multiply: subgroup (sr, sc) owns the 16-row blocks sr and
// sr + 4 and the 16-entry blocks sc, sc + 2, ... of the tile (plain
// matrices 2 x 4 blocks, experts 2 x 1), so a SwiGLU tile's gate block b
// and its up block b + 4 belong to the same subgroup. While a step's
// products run, the next step's activations are already loaded into
// registers and its weight bytes into the cache. The sums leave through a
// small staging region per subgroup to the epilogue (matvec.comp's modes 0
// to 4). Eight subgroups rather than four keep twice the loads in flight
// (docs/BENCHMARKS.md, "Workgroups of eight subgroups").
//
// Split rows (kcols != 0, plain matrices): a matrix of few row tiles and
// long rows (the hyper-connection projections: 3 tiles of 10,240 columns)
// would leave most of the GPU idle, so the grid's x has row tiles x splits
// workgroups, workgroup (tile, k) taking columns k kcols .. k kcols + kcols
// - 1 of its tile's rows and writing its sums to partial_off instead of the
// epilogue; split_sums.comp adds each output's splits in order and applies
// the epilogue.
//
// Not the exact path: each weight and each activation is rounded to f16
// (relative 2^-11 each; magnitudes past 65504 are clamped, Q8_0 scales
// past 511.75), the products summed in f32 in the tensor cores' order.
// src/vulkan/twins.rs states and tests the bound. The host takes it for the
// quantized types with rows of a multiple of 64 values, only with the fast
// kernels (FNX_GPU_KERNELS), where the device has cooperative matrices
// (FNX_VK_COOPMAT=0, LoadOptions::gpu_coopmat = Some(false) turn it off).
#define WG 256
#include "common.glsl"
#include "matvec_push.glsl"
#include "weights.glsl"
#include "epilogue.glsl"

#define BM 128u
#define BK 64u
// Entry blocks of a subgroup (NCB) and of the tile (BN / 16).
#ifdef ARENA
#define NCB 1
#else
#define NCB 4
#endif
#define BN (32u * NCB)
#define SUBGROUPS (WG / 32u)
// Subgroup rows and columns: subgroup (sr, sc) owns row blocks sr and sr +
// NSR and entry blocks sc, sc + NSC, ...
#define NSR 4u
#define NSC 2u
#define RB 2u
#define CB uint(NCB)
// Shared rows of BK halves padded by 8 (16 bytes: consecutive rows start 4
// banks apart, so the fragment loads' eight 16-byte rows hit distinct banks),
// counted in uvec4 elements of eight halves (one 16-byte store per 8 values;
// glslang's coopMatLoadNV takes arrays of scalars and unsigned vectors).
#define LD (BK + 8u)
#define LDV (LD / 8u)
#define A_AT 0u
#define B_AT (BM * LDV)
#define TILES_END (B_AT + BN * LDV)
// The epilogue's staging: per subgroup two 16 x 16 blocks of floats (64
// uvec4 each), over the tiles once the products are done.
#define STAGE 128u
shared uvec4 sm[TILES_END > SUBGROUPS * STAGE ? TILES_END : SUBGROUPS * STAGE];
// Where the run's entries' activations start (their x offsets).
shared uint xat[BN];

uvec2 half4(vec4 v) {
    f16vec4 h = f16vec4(clamp(v, vec4(-65504.0), vec4(65504.0)));
    return uvec2(packFloat2x16(h.xy), packFloat2x16(h.zw));
}

// Eight values into the shared tiles at half `at` (a multiple of 8), as f16
// clamped to its range.
void put8(uint at, vec4 a, vec4 b) { sm[at >> 3] = uvec4(half4(a), half4(b)); }

// Work items of a row per step of BK columns (each writes 16 or 32 values;
// at least one per invocation).
#if defined(WEIGHT_Q4_0) || defined(WEIGHT_Q4_1) || defined(WEIGHT_Q5_0) || defined(WEIGHT_Q5_1)
#define IPS 2u
#elif defined(WEIGHT_Q8_0) || defined(WEIGHT_Q6_K)
#define IPS 4u
#elif defined(WEIGHT_Q2_K) || defined(WEIGHT_Q3_K)
#define IPS 2u
#elif defined(WEIGHT_Q4_K) || defined(WEIGHT_Q5_K)
#define IPS 2u
#else
#error "mm.comp takes the quantized types"
#endif

// Item j of the step at column s0 of the row at byte `row` (field index g0
// of its first block), dequantized into the weight tile from half `at` (the
// tile row's start).
void put_item(uint row, uint g0, uint s0, uint j, uint at) {
#if defined(WEIGHT_Q4_0) || defined(WEIGHT_Q4_1) || defined(WEIGHT_Q5_0) || defined(WEIGHT_Q5_1)
#if defined(WEIGHT_Q4_0)
    const float bias = 8.0;
#elif defined(WEIGHT_Q5_0)
    const float bias = 16.0;
#else
    const float bias = 0.0;
#endif
    // Block s0 / 32 + j: values 32 j .. 32 j + 31 of the step.
    uint b = s0 / 32u + j, g = g0 + b;
    uvec4 lo, hi;
    levels32(row, g, b, lo, hi);
    vec2 dm = dm32(g);
    [[unroll]] for (uint i = 0u; i < 4u; i += 2u) {
        put8(at + 32u * j + 4u * i, f4(lo[i], bias) * dm.x + dm.y, f4(lo[i + 1u], bias) * dm.x + dm.y);
        put8(at + 32u * j + 16u + 4u * i, f4(hi[i], bias) * dm.x + dm.y, f4(hi[i + 1u], bias) * dm.x + dm.y);
    }
#elif defined(WEIGHT_Q8_0)
    // Half kk of block s0 / 32 + j / 2: values 16 j .. 16 j + 15 of the step.
    uint b = s0 / 32u + j / 2u, kk = j & 1u, g = g0 + b;
    // In packed f16: (1024 + q + 128) - 1152 is q exactly, times the scale
    // one rounding (the exact product rounded once, as the other types); a
    // scale is clamped to 511.75 so that the products stay finite.
    uvec4 q = P4(row + 32u * b + 16u * kk) ^ 0x80808080u;
    f16vec2 d = f16vec2(float16_t(clamp(half_at(F0 + 2u * g), -511.75, 511.75)));
    uvec4 o[2];
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        // 1024 + byte as f16 (0x6400 | byte), bytes 0, 2 and 1, 3 of word i.
        f16vec2 e = (unpackFloat2x16((q[i] & 0x00FF00FFu) | 0x64006400u) - float16_t(1152.0)) * d;
        f16vec2 u = (unpackFloat2x16(((q[i] >> 8) & 0x00FF00FFu) | 0x64006400u) - float16_t(1152.0)) * d;
        o[i >> 1][2u * (i & 1u)] = packFloat2x16(f16vec2(e.x, u.x));
        o[i >> 1][2u * (i & 1u) + 1u] = packFloat2x16(f16vec2(e.y, u.y));
    }
    sm[(at + 16u * j) >> 3] = o[0];
    sm[(at + 16u * j + 8u) >> 3] = o[1];
#elif defined(WEIGHT_Q2_K) || defined(WEIGHT_Q3_K)
    // Half n of block b holds groups jj of 32 values at 128 n + 32 jj, item
    // 2 n + kk the 16 at 16 kk of each; the step is groups 2 m and 2 m + 1.
    uint b = s0 / 256u, n = (s0 / 128u) & 1u, m = (s0 / 64u) & 1u, g = g0 + b;
    uvec4 lv[4];
    ivec4 sc;
    levels_k23(row, g, b, 2u * n + j, lv, sc);
    vec2 dm = dm_k23(g);
    [[unroll]] for (uint h = 0u; h < 2u; h++) {
        // Group 2 m + h, chosen without indexing by a variable (registers).
        uvec4 l = m == 0u ? lv[h] : lv[2u + h];
        int c = m == 0u ? sc[h] : sc[2u + h];
#ifdef WEIGHT_Q2_K
        float dl = dm.x * float(c & 0xF), ml = dm.y * float(c >> 4);
        [[unroll]] for (uint i = 0u; i < 4u; i += 2u) put8(at + 32u * h + 16u * j + 4u * i, f4(l[i], 0.0) * dl - ml, f4(l[i + 1u], 0.0) * dl - ml);
#else
        float dl = dm.x * float(c);
        [[unroll]] for (uint i = 0u; i < 4u; i += 2u) put8(at + 32u * h + 16u * j + 4u * i, f4(l[i], 4.0) * dl, f4(l[i + 1u], 4.0) * dl);
#endif
    }
#elif defined(WEIGHT_Q4_K) || defined(WEIGHT_Q5_K)
    // Half j of group c of 64 values (the whole step): values 16 j .. 16 j +
    // 15 (low nibbles) and 32 further (high nibbles).
    uint b = s0 / 256u, c = (s0 / 64u) & 3u, g = g0 + b;
    uvec4 lo, hi;
    levels_k45_half(row, b, c, j, lo, hi);
    vec4 f = scales_k45(g, c);
    [[unroll]] for (uint i = 0u; i < 4u; i += 2u) {
        put8(at + 16u * j + 4u * i, f4(lo[i], 0.0) * f.x - f.z, f4(lo[i + 1u], 0.0) * f.x - f.z);
        put8(at + 32u + 16u * j + 4u * i, f4(hi[i], 0.0) * f.y - f.w, f4(hi[i + 1u], 0.0) * f.y - f.w);
    }
#elif defined(WEIGHT_Q6_K)
    // Half hh of block b: items 4 hh + j hold values 128 hh + 32 p + l0 + l
    // (lo) and 64 further (hi); the step is the lo (m = 0) or hi values.
    uint b = s0 / 256u, hh = (s0 / 128u) & 1u, m = (s0 / 64u) & 1u, g = g0 + b;
    uint p = j >> 1, l0 = 16u * (j & 1u);
    uvec4 lo, hi;
    vec2 sc;
    levels_q6k(row, g, b, 4u * hh + j, lo, hi, sc);
    uvec4 l = m == 0u ? lo : hi;
    float d = m == 0u ? sc.x : sc.y;
    [[unroll]] for (uint i = 0u; i < 4u; i += 2u) put8(at + 32u * p + l0 + 4u * i, f4(l[i], 32.0) * d, f4(l[i + 1u], 32.0) * d);
#endif
}

#define ACC fcoopmatNV<32, gl_ScopeSubgroup, 16, 16>
#define FRAG fcoopmatNV<16, gl_ScopeSubgroup, 16, 16>
// Entry block sc + NSC cb of the tile times row blocks sr and sr + NSR
// (fragments a0, a1) into accumulators C0 and C1, when the run fills it.
#define PRODUCTS(cb, C0, C1) \
    if (sc + NSC * cb < blocks) { \
        FRAG bb; \
        coopMatLoadNV(bb, sm, B_AT + 16u * (sc + NSC * cb) * LDV + kk / 8u, LDV, true); \
        C0 = coopMatMulAddNV(a0, bb, C0); \
        C1 = coopMatMulAddNV(a1, bb, C1); \
    }

// Accumulator i (a constant once the epilogue's loops unroll) into the
// subgroup's staging at `at`, column-major.
void store_acc(uint i, uint at, ACC c0, ACC c1, ACC c2, ACC c3, ACC c4, ACC c5, ACC c6, ACC c7) {
    switch (i) {
    case 0u: coopMatStoreNV(c0, sm, at, 4u, true); break;
    case 1u: coopMatStoreNV(c1, sm, at, 4u, true); break;
    case 2u: coopMatStoreNV(c2, sm, at, 4u, true); break;
    case 3u: coopMatStoreNV(c3, sm, at, 4u, true); break;
    case 4u: coopMatStoreNV(c4, sm, at, 4u, true); break;
    case 5u: coopMatStoreNV(c5, sm, at, 4u, true); break;
    case 6u: coopMatStoreNV(c6, sm, at, 4u, true); break;
    default: coopMatStoreNV(c7, sm, at, 4u, true); break;
    }
}

// Activations per invocation and step: pairs of vec4s (BN entries of BK
// values, eight values per shared element).
#define XR (BN * BK / 8u / WG)

void main() {
    uint wg = gl_WorkGroupID.x + gl_WorkGroupID.z * gl_NumWorkGroups.x;
    bool swiglu = pc.mode == 4u;
    uint tile_rows = swiglu ? BM / 2u : BM;
    // With split rows, workgroup wg is split wg / (row tiles) of its row tile.
    uint row_tiles = (pc.rows + tile_rows - 1u) / tile_rows, split = 0u;
    uint c_begin = 0u, c_end = pc.cols;
    if (pc.kcols != 0u) {
        split = wg / row_tiles;
        wg -= split * row_tiles;
        c_begin = split * pc.kcols;
        c_end = min(pc.cols, c_begin + pc.kcols);
        if (c_begin >= pc.cols) return;
    }
    uint r0 = wg * tile_rows;
    if (r0 >= pc.rows) return;  // the whole workgroup is past the end
    uint t = gl_LocalInvocationID.x, sg = gl_SubgroupID, lane = gl_SubgroupInvocationID;
    uint sr = sg % NSR, sc = sg / NSR;
    uint nb = pc.cols / QK;
    uint up_row = pc.rows * pc.row_bytes, up_blk = pc.rows * nb;
    uint k0 = gl_WorkGroupID.y * BN;
    uint end = min(k0 + BN, pc.ntok);
#ifdef ARENA
    if (pc.tiles_off != 0u) {
        // moe_group.comp's tile y: one expert's pairs (the grid has room for the most tiles a pass can have).
        uint y = gl_WorkGroupID.y;
        if (y >= floatBitsToUint(s[pc.tiles_off])) return;
        k0 = floatBitsToUint(s[pc.tiles_off + 1u + 2u * y]);
        end = k0 + floatBitsToUint(s[pc.tiles_off + 2u + 2u * y]);
    }
#endif
    // Payload bytes of a block, and 32-byte sectors of a tile row's step.
    uint block_bytes = pc.row_bytes / nb, sectors = max(BK * block_bytes / QK / 32u, 1u);
    // Cache warm-up loads per invocation and step (BM rows of up to 4 sectors).
    const uint PF = BM * 4u / WG;
    uint ahead[PF], warm = 0u;
    [[unroll]] for (uint i = 0u; i < PF; i++) ahead[i] = 0u;
    [[dont_unroll]] for (uint e = k0; e < end;) {
        // The run: this entry and those after it that read the same weights.
        Entry first = entry(e);
        uint n = 1u;
#ifdef ARENA
        // A tile of moe_group's table is one expert's pairs: one run.
        if (pc.tiles_off != 0u) n = end - e;
#endif
        while (e + n < end && entry(e + n).slot == first.slot) n++;
        uint base = 0u;
#ifdef ARENA
        g_slab = first.slot / pc.slots_per_slab;
        base = (first.slot % pc.slots_per_slab) * pc.slot_bytes + pc.part_off;
#endif
        F0 = base + pc.fld0;
        F1 = base + pc.fld1;
        if (t < n) {
            Entry en = entry(e + t);
            xat[t] = pc.x_off + en.tok + en.k * pc.x_stride;
        }
        // xat is written, and the run before's epilogue is done with the staging.
        barrier();
        // The 16-entry blocks the run fills.
        uint blocks = (n + 15u) / 16u;
        // Invocation t's activations of a step: entry q / (BK / 8), values
        // 8 (q % (BK / 8)) .. + 7 for q = t + WG i (coalesced rows).
        vec4 xr[2u * XR];
        [[unroll]] for (uint i = 0u; i < XR; i++) {
            uint q = t + WG * i, j = q / (BK / 8u), at = c_begin + 8u * (q % (BK / 8u));
            xr[2u * i] = j < n ? xv(xat[j] + at) : vec4(0.0);
            xr[2u * i + 1u] = j < n ? xv(xat[j] + at + 4u) : vec4(0.0);
        }
        // The accumulators as named variables (block (rb, cb) is c<CB rb + cb>):
        // an array of them lived in local memory on NVIDIA (its compiler
        // kept the array's dynamic indexing), every product a round trip.
        // (The experts' tiles use c0 and c1.)
        ACC c0 = ACC(0.0), c1 = ACC(0.0), c2 = ACC(0.0), c3 = ACC(0.0);
        ACC c4 = ACC(0.0), c5 = ACC(0.0), c6 = ACC(0.0), c7 = ACC(0.0);
        for (uint s0 = c_begin; s0 < c_end; s0 += BK) {
            // The step before is done with the tiles.
            if (s0 > c_begin) barrier();
            [[unroll]] for (uint i = 0u; i < XR; i++) {
                uint q = t + WG * i;
                sm[B_AT + (q / (BK / 8u)) * LDV + q % (BK / 8u)] = uvec4(half4(xr[2u * i]), half4(xr[2u * i + 1u]));
            }
            // A fixed number of items per invocation, unrolled, so that every
            // item's loads are issued before the first one's stores.
            [[unroll]] for (uint it = 0u; it < BM * IPS / WG; it++) {
                uint q = t + WG * it, lr = q / IPS, j = q % IPS;
                // Tile rows past the end repeat the last row (never stored).
                bool up = swiglu && lr >= BM / 2u;
                uint r = min(r0 + (up ? lr - BM / 2u : lr), pc.rows - 1u);
                put_item(base + r * pc.row_bytes + (up ? up_row : 0u), r * nb + (up ? up_blk : 0u), s0, j, lr * LD);
            }
            [[unroll]] for (uint i = 0u; i < PF; i++) warm ^= ahead[i];
            if (s0 + BK < c_end) {
                // The next step's activations into registers, its weight
                // bytes into the cache (one 4-byte load per 32-byte sector of
                // each tile row, folded into `warm` a step later).
                [[unroll]] for (uint i = 0u; i < XR; i++) {
                    uint q = t + WG * i, j = q / (BK / 8u), at = s0 + BK + 8u * (q % (BK / 8u));
                    xr[2u * i] = j < n ? xv(xat[j] + at) : vec4(0.0);
                    xr[2u * i + 1u] = j < n ? xv(xat[j] + at + 4u) : vec4(0.0);
                }
                uint from = (s0 + BK) / QK * block_bytes + (s0 + BK) % QK * block_bytes / QK;
                [[unroll]] for (uint i = 0u; i < PF; i++) {
                    uint q = t + WG * i, lr = q / sectors;
                    bool up = swiglu && lr >= BM / 2u;
                    uint r = min(r0 + (up ? lr - BM / 2u : lr), pc.rows - 1u);
                    ahead[i] = lr < BM ? W(base + r * pc.row_bytes + (up ? up_row : 0u) + from + 32u * (q % sectors)) : 0u;
                }
            }
            barrier();
            [[unroll]] for (uint kk = 0u; kk < BK; kk += 16u) {
                FRAG a0, a1;
                coopMatLoadNV(a0, sm, A_AT + 16u * sr * LDV + kk / 8u, LDV, false);
                coopMatLoadNV(a1, sm, A_AT + 16u * (sr + NSR) * LDV + kk / 8u, LDV, false);
                // Block (rb, cb) is accumulator c<CB rb + cb>.
#if NCB == 1
                PRODUCTS(0u, c0, c1)
#else
                PRODUCTS(0u, c0, c4)
                PRODUCTS(1u, c1, c5)
                PRODUCTS(2u, c2, c6)
                PRODUCTS(3u, c3, c7)
#endif
            }
        }
        // Every subgroup is done with the tiles; each stages its blocks in
        // its own region (column-major: entry jj's 16 rows consecutive).
        barrier();
        uint stage = sg * STAGE;
        // Row blocks stored: all, or with SwiGLU the gate blocks (the up block
        // of gate block rb is rb + RB / 2).
        uint out_rb = swiglu ? RB / 2u : RB;
        [[unroll]] for (uint cb = 0u; cb < CB; cb++) {
            uint c = sc + NSC * cb;
            if (c >= blocks) continue;
            [[unroll]] for (uint rb = 0u; rb < RB; rb++) {
                if (rb >= out_rb) continue;
                store_acc(rb * CB + cb, stage, c0, c1, c2, c3, c4, c5, c6, c7);
                if (swiglu) store_acc((rb + RB / 2u) * CB + cb, stage + 64u, c0, c1, c2, c3, c4, c5, c6, c7);
                subgroupMemoryBarrierShared();
                subgroupBarrier();
                // Lane: row i of the block, entries jj = lane / 16 + 2 q
                // (sixteen lanes write sixteen consecutive rows of an entry).
                uint i = lane & 15u, r = r0 + 16u * (sr + NSR * rb) + i;
                [[unroll]] for (uint q = 0u; q < 8u; q++) {
                    uint jj = (lane >> 4) + 2u * q, j = 16u * c + jj;
                    if (j >= n || r >= pc.rows) continue;
                    uint f = jj * 16u + i, f2 = 256u + f;
                    float v = uintBitsToFloat(sm[stage + (f >> 2)][f & 3u]);
                    float u = swiglu ? uintBitsToFloat(sm[stage + (f2 >> 2)][f2 & 3u]) : 0.0;
                    if (pc.kcols != 0u) {
                        // A split's sums, for split_sums.comp (entry e + j of the dispatch).
                        uint at = pc.partial_off + (split * pc.ntok + e + j) * (swiglu ? 2u * pc.rows : pc.rows) + r;
                        s[at] = v;
                        if (swiglu) s[at + pc.rows] = u;
                    } else {
                        mm_store(entry(e + j), r, v, u);
                    }
                }
                subgroupBarrier();
            }
        }
        e += n;
    }
    // Never true (a workgroup of a dispatch without rows returned above):
    // keeps the warm-up loads, which nothing else reads.
    if (warm == 0x9e3779b9u && pc.rows == 0u) s[pc.y_off] = 0.0;
}
