#version 450
#extension GL_NV_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_control_flow_attributes : require
// Y = W X for a pass of tokens on the tensor cores: the matrix-matrix twin
// of matvec.comp for its batches (same push constants, entries and
// epilogues), where the device has cooperative matrices
// (VK_NV_cooperative_matrix: 16x16x16, f16 inputs, f32 sums; the host runs
// this module only with subgroups of 32, four to a workgroup).
//
// A workgroup computes a tile of BM = 64 output rows (SwiGLU: 32 gate rows
// and their 32 up rows) for BN consecutive entries of the dispatch
// (workgroup y-index: entries BN y .. BN y + BN - 1): 64 for a plain matrix
// (the tokens of a pass: each decoded weight serves up to 64 of them), 32
// for the routed experts (src/vulkan/pipelines.rs: mm_entries). Entries of
// a tile that read different weights (the (token, expert) pairs of a pass,
// grouped by expert) run one after the other: each run of entries with the
// same slot sweeps the rows once. Each step of BK = 128 columns decodes the
// tile's weights into shared memory as f16 (weights.glsl's levels and
// scales, the exact dequantized value rounded once), copies the run's
// activations there as f16, and each subgroup multiplies its 16 rows with
// the run's 16-entry blocks; the sums (f32) go through shared memory to the
// epilogue.
//
// Not the exact path: each weight and each activation is rounded to f16
// (relative 2^-11 each; magnitudes past 65504 are clamped), the products
// summed in f32 in the tensor cores' order. src/vulkan/twins.rs states and
// tests the bound. The host takes it for the quantized types with rows of
// a multiple of 128 values, only with the fast kernels (FNX_GPU_KERNELS),
// where the device has cooperative matrices (FNX_VK_COOPMAT=0,
// LoadOptions::gpu_coopmat = Some(false) turn it off).
#define WG 128
#include "common.glsl"
#include "matvec_push.glsl"
#include "weights.glsl"

#define BM 64u
#ifdef ARENA
#define BN 32u
#else
#define BN 64u
#endif
#define BK 128u
// 16-entry blocks of a tile (one accumulator each per subgroup).
#define NB (BN / 16u)
// Cache warm-up loads per invocation and step (BM rows of up to 8 sectors:
// 128 columns of 2 bytes or less per value).
#define PF (BM * 8u / WG)
// Subgroups of a workgroup (of 32 invocations: one step's BK activations of
// an entry are one 16-byte load per invocation).
#define SUBGROUPS (WG / 32u)
// Shared rows padded by 8 halves (16 bytes) against bank conflicts.
#define LDW (BK + 8u)
#define LDC (BN + 4u)

// One shared region: the weight tile (BM rows of LDW halves) and the
// activation tile (BN rows) while the steps run, then the sums (BM rows of
// LDC floats) over both for the epilogue. Four halves per element (lowest
// first), so that four decoded values are one 8-byte store (four 2-byte
// stores each cost a shared-memory cycle, and rows 16 halves apart in bank
// order made them conflict); the cooperative loads and stores count offsets
// and strides in these elements (uvec2: the element types glslang's
// coopMatLoadNV takes are scalars and unsigned vectors). One region keeps a
// tile of 64 entries under the 48 KB a workgroup may have.
#define W_AT 0u
#define X_AT (BM * LDW / 4u)
#define TILES_END (X_AT + BN * LDW / 4u)
#define SUMS_END (BM * LDC / 2u)
shared uvec2 sm[TILES_END > SUMS_END ? TILES_END : SUMS_END];
// Where the run's entries' activations start (their x offsets).
shared uint xat[BN];

// Sum (tile row i, entry j) of the epilogue.
float sum_at(uint i, uint j) {
    uint f = i * LDC + j;
    return uintBitsToFloat(sm[f >> 1][f & 1u]);
}

uvec2 half4(vec4 v) {
    f16vec4 h = f16vec4(clamp(v, vec4(-65504.0), vec4(65504.0)));
    return uvec2(packFloat2x16(h.xy), packFloat2x16(h.zw));
}

// Four values into a shared tile at half `at` (a multiple of 4), as f16
// clamped to its range.
void put_w(uint at, vec4 v) { sm[W_AT + (at >> 2)] = half4(v); }
void put_x(uint at, vec4 v) { sm[X_AT + (at >> 2)] = half4(v); }

// Items of a row per step of BK columns.
#define IPS (BK * IPB / QK)

// Item j of the step at column s0 of the row at byte `row` (field index g0
// of its first block), dequantized into the weight tile from `at` (the tile row's start).
void put_item(uint row, uint g0, uint s0, uint j, uint at) {
#if defined(WEIGHT_Q4_0) || defined(WEIGHT_Q4_1) || defined(WEIGHT_Q5_0) || defined(WEIGHT_Q5_1)
#if defined(WEIGHT_Q4_0)
    const float bias = 8.0;
#elif defined(WEIGHT_Q5_0)
    const float bias = 16.0;
#else
    const float bias = 0.0;
#endif
    uint b = s0 / 32u + j, g = g0 + b;
    uvec4 lo, hi;
    levels32(row, g, b, lo, hi);
    vec2 dm = dm32(g);
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        put_w(at + 32u * j + 4u * i, f4(lo[i], bias) * dm.x + dm.y);
        put_w(at + 32u * j + 16u + 4u * i, f4(hi[i], bias) * dm.x + dm.y);
    }
#elif defined(WEIGHT_Q8_0)
    uint b = s0 / 32u + j / 2u, kk = j & 1u, g = g0 + b;
    uvec4 q = P4(row + 32u * b + 16u * kk);
    float d = half_at(F0 + 2u * g);
    [[unroll]] for (uint i = 0u; i < 4u; i++) put_w(at + 32u * (j / 2u) + 16u * kk + 4u * i, f4(q[i] ^ 0x80808080u, 128.0) * d);
#elif defined(WEIGHT_Q2_K) || defined(WEIGHT_Q3_K)
    // Half n of block b: items 2n + j, group jj's values at 32 jj + 16 j.
    uint b = s0 / 256u, n = (s0 / 128u) & 1u, g = g0 + b;
    uvec4 lv[4];
    ivec4 sc;
    levels_k23(row, g, b, 2u * n + j, lv, sc);
    vec2 dm = dm_k23(g);
    [[unroll]] for (uint jj = 0u; jj < 4u; jj++) {
#ifdef WEIGHT_Q2_K
        float dl = dm.x * float(sc[jj] & 0xF), ml = dm.y * float(sc[jj] >> 4);
        [[unroll]] for (uint i = 0u; i < 4u; i++) put_w(at + 32u * jj + 16u * j + 4u * i, f4(lv[jj][i], 0.0) * dl - ml);
#else
        float dl = dm.x * float(sc[jj]);
        [[unroll]] for (uint i = 0u; i < 4u; i++) put_w(at + 32u * jj + 16u * j + 4u * i, f4(lv[jj][i], 4.0) * dl);
#endif
    }
#elif defined(WEIGHT_Q4_K) || defined(WEIGHT_Q5_K)
    // Group c = 2 h + j of 64 values (h the block's half).
    uint b = s0 / 256u, c = 2u * ((s0 / 128u) & 1u) + j, g = g0 + b;
    uvec4 lo[2], hi[2];
    vec4 f;
    levels_k45(row, g, b, c, lo, hi, f);
    [[unroll]] for (uint h = 0u; h < 2u; h++) {
        [[unroll]] for (uint i = 0u; i < 4u; i++) {
            put_w(at + 64u * j + 16u * h + 4u * i, f4(lo[h][i], 0.0) * f.x - f.z);
            put_w(at + 64u * j + 32u + 16u * h + 4u * i, f4(hi[h][i], 0.0) * f.y - f.w);
        }
    }
#elif defined(WEIGHT_Q6_K)
    // Half hh of block b: items 4 hh + j, values at 32 p + l0 and 64 further.
    uint b = s0 / 256u, hh = (s0 / 128u) & 1u, g = g0 + b;
    uint p = j >> 1, l0 = 16u * (j & 1u);
    uvec4 lo, hi;
    vec2 sc;
    levels_q6k(row, g, b, 4u * hh + j, lo, hi, sc);
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        put_w(at + 32u * p + l0 + 4u * i, f4(lo[i], 32.0) * sc.x);
        put_w(at + 64u + 32u * p + l0 + 4u * i, f4(hi[i], 32.0) * sc.y);
    }
#else
#error "mm.comp takes the quantized types"
#endif
}

void main() {
    uint wg = gl_WorkGroupID.x + gl_WorkGroupID.z * gl_NumWorkGroups.x;
    bool swiglu = pc.mode == 4u;
    uint tile_rows = swiglu ? BM / 2u : BM;
    uint r0 = wg * tile_rows;
    if (r0 >= pc.rows) return;  // the whole workgroup is past the end
    uint t = gl_LocalInvocationID.x, sg = gl_SubgroupID;
    uint nb = pc.cols / QK;
    uint up_row = pc.rows * pc.row_bytes, up_blk = pc.rows * nb;
    uint k0 = gl_WorkGroupID.y * BN;
    uint end = min(k0 + BN, pc.ntok);
    uint lane = t % 32u;
    // Payload bytes of a block, and 32-byte sectors of a tile row's step.
    uint block_bytes = pc.row_bytes / nb, sectors = max(BK * block_bytes / QK / 32u, 1u);
    uint ahead[PF], warm = 0u;
    [[unroll]] for (uint i = 0u; i < PF; i++) ahead[i] = 0u;
    [[dont_unroll]] for (uint e = k0; e < end;) {
        // The run: this entry and those after it that read the same weights.
        Entry first = entry(e);
        uint n = 1u;
        while (e + n < end && entry(e + n).slot == first.slot) n++;
        uint base = 0u;
#ifdef ARENA
        g_slab = first.slot / pc.slots_per_slab;
        base = (first.slot % pc.slots_per_slab) * pc.slot_bytes + pc.part_off;
#endif
        F0 = base + pc.fld0;
        F1 = base + pc.fld1;
        // (Read after the first step's barrier; the run before is done with them.)
        if (t < n) {
            Entry en = entry(e + t);
            xat[t] = pc.x_off + en.tok + en.k * pc.x_stride;
        }
        // The 16-entry blocks the run fills.
        uint blocks = (n + 15u) / 16u;
        fcoopmatNV<32, gl_ScopeSubgroup, 16, 16> acc[NB];
        [[unroll]] for (uint c = 0u; c < NB; c++) acc[c] = fcoopmatNV<32, gl_ScopeSubgroup, 16, 16>(0.0);
        for (uint s0 = 0u; s0 < pc.cols; s0 += BK) {
            // The step before (or the run before's epilogue) is done with the tiles.
            barrier();
            for (uint q = t; q < BM * IPS; q += WG) {
                uint lr = q / IPS, j = q % IPS;
                // Tile rows past the end repeat the last row (never stored).
                bool up = swiglu && lr >= BM / 2u;
                uint r = min(r0 + (up ? lr - BM / 2u : lr), pc.rows - 1u);
                put_item(base + r * pc.row_bytes + (up ? up_row : 0u), r * nb + (up ? up_blk : 0u), s0, j, lr * LDW);
            }
            // Subgroup sg copies entries sg, sg + SUBGROUPS, ...: a row of the
            // tile per load, each invocation four values (the loads coalesced,
            // the stores in consecutive banks; unrolled, so that the loads are
            // all in flight before the first store).
            [[unroll]] for (uint i = 0u; i < BN / SUBGROUPS; i++) {
                uint j = sg + SUBGROUPS * i;
                if (j < n) put_x(j * LDW + 4u * lane, xv(xat[j] + s0 + 4u * lane));
            }
            // The next step's weight bytes into the cache while this step's
            // products run: one 4-byte load per 32-byte sector of each tile
            // row's next BK columns, kept in registers and folded into `warm`
            // a step later, so that nothing waits on them.
            [[unroll]] for (uint i = 0u; i < PF; i++) warm ^= ahead[i];
            if (s0 + BK < pc.cols) {
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
                fcoopmatNV<16, gl_ScopeSubgroup, 16, 16> a, b;
                coopMatLoadNV(a, sm, W_AT + (sg * 16u * LDW + kk) / 4u, LDW / 4u, false);
                [[unroll]] for (uint c = 0u; c < NB; c++) {
                    if (c < blocks) {
                        coopMatLoadNV(b, sm, X_AT + (16u * c * LDW + kk) / 4u, LDW / 4u, true);
                        acc[c] = coopMatMulAddNV(a, b, acc[c]);
                    }
                }
            }
        }
        // Sums of tile row i, entry j at float i * LDC + j, over the tiles
        // (once every subgroup is done with them).
        barrier();
        [[unroll]] for (uint c = 0u; c < NB; c++) {
            if (c < blocks) coopMatStoreNV(acc[c], sm, (sg * 16u * LDC + 16u * c) / 2u, LDC / 2u, false);
        }
        barrier();
        for (uint q = t; q < tile_rows * n; q += WG) {
            uint i = q % tile_rows, j = q / tile_rows;
            uint r = r0 + i;
            if (r >= pc.rows) continue;
            Entry en = entry(e + j);
            float v = sum_at(i, j);
            uint y = pc.y_off + en.tok + en.k * pc.y_stride + pc.row_base + r;
            if (pc.mode == 3u) {
                // Residual write-back: stream c gets its token's weight times the row.
                for (uint c = 0u; c < pc.aux_n; c++) s[y + c * pc.total_rows] += s[pc.aux_off + en.k * pc.y_stride + c] * v;
            } else if (pc.mode == 0u) {
                s[y] = v;
            } else if (pc.mode == 1u) {
                s[y] = pc.row_base + r < pc.split_row ? silu(v * pc.scale) : 2.0 * sigmoid(v * pc.scale);
            } else {
                s[y] = silu(v) * sum_at(i + BM / 2u, j);
            }
        }
        e += n;
    }
    // Never true (a workgroup of a dispatch without rows returned above):
    // keeps the warm-up loads, which nothing else reads.
    if (warm == 0x9e3779b9u && pc.rows == 0u) s[pc.y_off] = 0.0;
}
