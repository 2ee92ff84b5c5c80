#version 450
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_control_flow_attributes : require
#ifdef FAST
#extension GL_EXT_spirv_intrinsics : require
#endif
// y = W x with an epilogue chosen by `mode`, for weights in the device
// layout of src/vulkan/layout.rs (shaders/weights.glsl reads them).
//
// Work split: a workgroup of WG invocations (specialization constant 1) is
// cut into WG / TPR row sets of TPR = 1 << tpr_shift invocations (a push
// constant, so the host picks it per matrix shape); each row set computes
// ROWS consecutive output rows (specialization constant 2), so a workgroup
// covers (WG / TPR) * ROWS rows. The TPR invocations of a set stride over
// the row's work items (16 bytes of quantized weights each: one aligned
// 16-byte load per row, see weights.glsl), UNROLL items per pass
// (specialization constant 3); each item's activations are read once and
// used for all ROWS rows (and their up rows in SwiGLU mode).
// Partial sums are reduced across the set with subgroupAdd when TPR is the
// subgroup size, subgroupAdd plus shared memory when it is larger, and a
// subgroupShuffleXor butterfly when it is smaller.
//
// Invocations are numbered by subgroup (gl_SubgroupID, gl_SubgroupInvocationID),
// so a set never straddles subgroups unnecessarily; WG must be a power of two
// and a multiple of the subgroup size (the host ensures both).
//
// With FAST (the quantized types' fast kernels, shaders/weights_int.glsl)
// each workgroup first rounds its activations to 8 bits in shared memory
// (`prepare_x`), or in a pass of tokens copies them from the region
// act_int8.comp rounded once for every workgroup (`xq_off`, the same
// values), and the items are integer dot products; the exact kernels'
// `prepare_x` does nothing.
//
// Entry k of a batch (a token of a plain matrix) reads x at x_off + k * x_stride
// and writes y at y_off + k * y_stride (the residual epilogue's injection
// weights at aux_off + k * y_stride too). Workgroup y-index g takes entries
// g * tile .. g * tile + tile - 1 (below ntok) one after the other, the same
// loop body for each, so an entry's sums are added in the same order whatever
// the tile: the tile's entries meet the workgroup's weight rows while they
// are in L1, and a pass of tokens streams each matrix from memory once per
// tile instead of once per token. tile 0 means one entry per workgroup.
// With BATCH (fast kernels for a pass of tokens) up to NT consecutive
// entries of a tile that read the same weights (a plain matrix's tokens,
// the pairs of one expert; at most SHARE), their activations read in place
// from the region act_int8.comp rounded, go through the rows together:
// each work item's weights are decoded once (`item_w`) and dotted with each
// entry's activations (`w_dot`), each entry's sums still added in its own
// order, so an entry's result is the one it gets alone. Without BATCH
// (NT = 1) an item's activations are loaded once for all ROWS rows instead.
// Mode 5 (one token, no BATCH) is the hyper-connection up projection with
// its combine as the epilogue: rows are walked stream-interleaved (output r
// is matrix row (r mod C) * H + r / C), so each workgroup holds all C mix
// logits of its d and writes y[d] = mean_c sigmoid(mix[c][d]) * xn[c][d]
// itself, as shaders/hc_combine.comp would.
// Split rows (kcols != 0; plain matrices of quantized types, not mode 5): a
// matrix of few rows and long ones (the hyper-connection down projections:
// 324 rows of 10,240 values) fills few workgroups, so the grid's x holds its
// row groups once per split, workgroup (group, k) taking columns k kcols ..
// k kcols + kcols - 1 (whole blocks) of its rows: it rounds or copies only
// those activations, sums only their items, and writes each entry's sums to
// partial_off ([split][entry][rows], SwiGLU's up rows after the gate rows)
// instead of the epilogue. With a counter region (expert_off != 0: a plain
// matrix has no expert ids) the workgroup of a row group's splits that
// finishes last adds them (each output's splits in order) and applies the
// epilogue itself: every workgroup counts its arrival in the row group's
// counter (per tile of entries) after its partial sums are visible, and the
// one that brings it to the number of splits reads them all back (through
// a coherent view of the scratch) and resets the counter for the next
// dispatch. Without one, shaders/split_sums.comp adds them in a dispatch
// of its own, in the same order and with the same epilogue
// (epilogue.glsl), so both give the same bits. A token and a pass split a
// matrix alike (the host's rule depends on its shape alone), so they still
// sum alike.
// With ARENA (routed experts): k reads expert id s[expert_off + k], finds
// its arena slot through the slot table, and reads x and writes y at
// k * stride. With kdiv > 0 (a batch of tokens' experts) k is a pair:
// token k / kdiv's expert k % kdiv, the token's ids, x and y tok_stride
// floats further per token; with order_off, entry k is the k-th pair of
// the order moe_group.comp (or the host) wrote (grouped by expert), from
// entry order_base on (the expert cache's rounds of a pass), so a tile's entries
// mostly share their expert's rows.
#define WG 128
#include "common.glsl"
layout(local_size_x_id = 1) in;
#ifdef BATCH
// Fixed here (the host's tuning gives these modules ROWS 2), so that every
// loop over rows and entries unrolls at compile time into registers.
const uint ROWS = 2u;
#else
layout(constant_id = 2) const uint ROWS = 2u;
#endif
layout(constant_id = 3) const uint UNROLL = 1u;
// Entries sharing each weight decode: BATCH (the fast kernels' batch
// modules) 8, else 1; a compile-time constant so the loops over entries
// unroll into registers. SHARE (specialization constant 4) caps it lower.
#ifdef BATCH
#define NT 8u
#else
#define NT 1u
#endif
layout(constant_id = 4) const uint SHARE = 8u;

#include "matvec_push.glsl"

#include "weights.glsl"
#include "epilogue.glsl"

// Split rows' partial sums and arrival counters, seen coherently across the
// dispatch's workgroups (the same binding as the scratch).
layout(set = 0, binding = 0) coherent buffer SplitSums { float sp[]; };
layout(set = 0, binding = 0) coherent buffer SplitCounts { uint sn[]; };
shared bool split_last;
#define SPLITS_AHEAD 16u

// One slot per subgroup (at least 4 invocations wide) for each accumulator
// of each entry: ROWS rows, and as many up rows in SwiGLU mode.
shared float red_mv[gl_WorkGroupSize.x / 4u * 2u * ROWS * NT];

void main() {
    const uint NACC = 2u * ROWS;
    uint tpr = 1u << pc.tpr_shift;
    uint sets = gl_WorkGroupSize.x >> pc.tpr_shift;
    uint wg = gl_WorkGroupID.x + gl_WorkGroupID.z * gl_NumWorkGroups.x;
    // With split rows, workgroup wg is split wg / (row groups) of its group.
    uint split = 0u, c_begin = 0u, c_end = pc.cols;
    uint groups = (pc.rows + sets * ROWS - 1u) / (sets * ROWS);
    if (pc.kcols != 0u) {
        split = wg / groups;
        wg -= split * groups;
        c_begin = split * pc.kcols;
        c_end = min(pc.cols, c_begin + pc.kcols);
        if (c_begin >= pc.cols) return;  // past the last split
    }
    if (wg * sets * ROWS >= pc.rows) return;  // the whole workgroup is past the end
    uint t = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;
    uint lane = t & (tpr - 1u);
    uint r0 = (wg * sets + (t >> pc.tpr_shift)) * ROWS;
    uint k0 = gl_WorkGroupID.y * max(pc.tile, 1u);
    uint end = pc.tile > 1u ? min(k0 + pc.tile, pc.ntok) : k0 + 1u;
    uint cap = min(NT, SHARE);
    bool swiglu = pc.mode == 4u;
    uint n_acc = swiglu ? NACC : ROWS;
    // Blocks per row (the float types: 16-byte items per row), and the
    // items of this workgroup's columns (a split's whole blocks: quantized
    // types only).
    uint nb = QK == 1u ? pc.row_bytes >> 4 : pc.cols / QK;
    uint item0 = c_begin / QK * IPB, items = pc.kcols != 0u ? c_end / QK * IPB : nb * IPB;
    uint up_row = pc.rows * pc.row_bytes, up_blk = pc.rows * nb;
    // Every value here is the same for the whole workgroup.
    [[dont_unroll]] for (uint e = k0; e < end;) {
        // The entries before have read the shared activations and partial sums.
        if (e > k0) barrier();
        // This entry and those after it that read the same weights, up to cap.
        Entry en[NT];
        en[0] = entry(e);
        uint n = 1u;
        [[unroll]] for (uint j = 1u; j < NT; j++) {
            if (n == j && e + j < end && j < cap) {
                Entry f = entry(e + j);
                if (f.slot == en[0].slot) {
                    en[j] = f;
                    n++;
                }
            }
        }
        uint base = 0u;
#ifdef ARENA
        g_slab = en[0].slot / pc.slots_per_slab;
        base = (en[0].slot % pc.slots_per_slab) * pc.slot_bytes + pc.part_off;
#endif
        F0 = base + pc.fld0;
        F1 = base + pc.fld1;
        // Entry j's activations: at x[j] (FAST: in shared memory; with BATCH
        // vector v[j] of the rounded region at x[j], read in place).
        uint x[NT], v[NT];
        [[unroll]] for (uint j = 0u; j < NT; j++) if (j < n) {
            uint k = en[j].k, tok = en[j].tok;
            x[j] = pc.x_off + tok + k * pc.x_stride;
            v[j] = 0u;
#if defined(FAST) && defined(BATCH)
            // The host runs batch modules only on a rounded region.
#ifdef ARENA
            // An expert pair's own input when they differ, else the token's one vector.
            x[j] = pc.xq_off + tok;
            v[j] = pc.x_stride == 0u ? 0u : k;
#else
            x[j] = pc.xq_off + k * pc.x_stride;
#endif
#elif defined(FAST)
            if (pc.xq_off != 0u) {
#ifdef ARENA
                copy_x(pc.xq_off + tok, pc.x_stride == 0u ? 0u : k, c_begin, c_end);
#else
                copy_x(pc.xq_off + k * pc.x_stride, 0u, c_begin, c_end);
#endif
            } else {
                prepare_x(x[j], c_begin, c_end);
            }
#else
            prepare_x(x[j], c_begin, c_end);
#endif
        }
        // Rows past the end repeat the last row (their sums are not stored), so
        // every invocation runs the same loop and reaches the reductions.
        uint row[ROWS];
        uint blk[ROWS];
        [[unroll]] for (uint i = 0u; i < ROWS; i++) {
            uint r = min(r0 + i, pc.rows - 1u);
            // Mode 5 walks the rows stream-interleaved: output r is row
            // (r mod C) * H + r / C, so a workgroup holds every stream of its d.
            if (pc.mode == 5u) r = (r % pc.aux_n) * (pc.total_rows / pc.aux_n) + r / pc.aux_n;
            row[i] = base + r * pc.row_bytes;
            blk[i] = r * nb;
        }
        // Entry j's accumulators at j * NACC: its rows, then its up rows.
        float acc[NT * NACC];
        [[unroll]] for (uint i = 0u; i < NT * NACC; i++) acc[i] = 0.0;
        // UNROLL items per pass, their loads unconditional (a missing item
        // rereads the last one and adds nothing), so all can be in flight at once.
        for (uint c0 = item0 + lane; c0 < items; c0 += UNROLL * tpr) {
            [[unroll]] for (uint u = 0u; u < UNROLL; u++) {
                uint c = c0 + u * tpr;
                bool ok = c < items;
                c = min(c, items - 1u);
                uint b = c / IPB, kk = c % IPB;
                if (NT == 1u) {
                    Xs xs = load_x(x[0], b, kk, v[0]);
                    [[unroll]] for (uint i = 0u; i < ROWS; i++) {
                        float d = w_dot(item_w(row[i], blk[i] + b, b, kk), b, kk, xs);
                        acc[i] += ok ? d : 0.0;
                    }
                    if (swiglu) {
                        [[unroll]] for (uint i = 0u; i < ROWS; i++) {
                            float d = w_dot(item_w(row[i] + up_row, blk[i] + up_blk + b, b, kk), b, kk, xs);
                            acc[ROWS + i] += ok ? d : 0.0;
                        }
                    }
                } else {
                    [[unroll]] for (uint i = 0u; i < ROWS; i++) {
                        Wt w = item_w(row[i], blk[i] + b, b, kk);
                        [[unroll]] for (uint j = 0u; j < NT; j++) if (j < n) {
                            float d = w_dot(w, b, kk, load_x(x[j], b, kk, v[j]));
                            acc[j * NACC + i] += ok ? d : 0.0;
                        }
                    }
                    if (swiglu) {
                        [[unroll]] for (uint i = 0u; i < ROWS; i++) {
                            Wt w = item_w(row[i] + up_row, blk[i] + up_blk + b, b, kk);
                            [[unroll]] for (uint j = 0u; j < NT; j++) if (j < n) {
                                float d = w_dot(w, b, kk, load_x(x[j], b, kk, v[j]));
                                acc[j * NACC + ROWS + i] += ok ? d : 0.0;
                            }
                        }
                    }
                }
            }
        }
        // Each entry's sums over the row set's lanes. Accumulator a is entry
        // a / NACC's; every loop over them is one loop of constant length
        // innermost, so it unrolls at compile time and acc stays in registers.
        if (tpr >= gl_SubgroupSize) {
            [[unroll]] for (uint a = 0u; a < NT * NACC; a++) {
                if (a / NACC < n && a % NACC < n_acc) acc[a] = subgroupAdd(acc[a]);
            }
            if (tpr > gl_SubgroupSize) {
                if (subgroupElect()) {
                    [[unroll]] for (uint a = 0u; a < NT * NACC; a++) {
                        if (a / NACC < n) red_mv[gl_SubgroupID * NT * NACC + a] = acc[a];
                    }
                }
                barrier();
                if (lane == 0u) {
                    for (uint q = 1u; q < tpr / gl_SubgroupSize; q++) {
                        [[unroll]] for (uint a = 0u; a < NT * NACC; a++) {
                            if (a / NACC < n) acc[a] += red_mv[(gl_SubgroupID + q) * NT * NACC + a];
                        }
                    }
                }
            }
        } else {
            // Butterfly over the set's lanes (a set lies inside one subgroup).
            for (uint o = tpr >> 1; o > 0u; o >>= 1) {
                [[unroll]] for (uint a = 0u; a < NT * NACC; a++) {
                    if (a / NACC < n && a % NACC < n_acc) acc[a] += subgroupShuffleXor(acc[a], o);
                }
            }
        }
        if (pc.kcols != 0u) {
            // A split's sums, for split_sums.comp (entry e + j of the dispatch).
            if (lane == 0u) {
                uint stride = swiglu ? 2u * pc.rows : pc.rows;
                [[unroll]] for (uint a = 0u; a < NT * ROWS; a++) {
                    uint j = a / ROWS, i = a % ROWS;
                    if (j < n && r0 + i < pc.rows) {
                        uint at = pc.partial_off + (split * pc.ntok + e + j) * stride + r0 + i;
                        sp[at] = acc[j * NACC + i];
                        if (swiglu) sp[at + pc.rows] = acc[j * NACC + ROWS + i];
                    }
                }
            }
        } else
#ifndef BATCH
        if (pc.mode == 5u) {
            // Hyper-connection up with its combine (one entry, a workgroup's
            // rows a multiple of C, TPR >= 2 so they fit red_mv; the host
            // checks): the mix logits through shared memory, then
            // y[d] = mean_c sigmoid(mix[c][d]) * xn[c][d] with xn at aux_off,
            // added as shaders/hc_combine.comp adds them.
            barrier();
            if (lane == 0u) {
                [[unroll]] for (uint i = 0u; i < ROWS; i++) red_mv[(t >> pc.tpr_shift) * ROWS + i] = acc[i];
            }
            barrier();
            uint h = pc.total_rows / pc.aux_n, d = (wg * sets * ROWS) / pc.aux_n + t;
            if (t < sets * ROWS / pc.aux_n && d < h) {
                uint a = en[0].tok + en[0].k * pc.y_stride;
                precise float mixed = 0.0;
                for (uint c = 0u; c < pc.aux_n; c++) mixed += sigmoid(red_mv[t * pc.aux_n + c]) * s[pc.aux_off + a + c * h + d];
                s[pc.y_off + a + d] = mixed / float(pc.aux_n);
            }
        } else
#endif
        if (lane == 0u) {
            // Output a of entry a / ROWS: row r0 + a % ROWS.
            uint y[NT];
            [[unroll]] for (uint j = 0u; j < NT; j++) y[j] = j < n ? pc.y_off + en[j].tok + en[j].k * pc.y_stride + pc.row_base + r0 : 0u;
            if (pc.mode == 3u) {
                // Residual write-back: stream c of each row gets its token's weight times the row.
                for (uint c = 0u; c < pc.aux_n; c++) {
                    [[unroll]] for (uint a = 0u; a < NT * ROWS; a++) {
                        uint j = a / ROWS, i = a % ROWS;
                        if (j < n && r0 + i < pc.rows) {
                            // One fused multiply-add in every module (the
                            // compilers contract the plain form in some and not
                            // others, breaking passes' bit equality with tokens).
                            uint at = y[j] + i + c * pc.total_rows;
                            s[at] = fma(s[pc.aux_off + en[j].k * pc.y_stride + c], acc[j * NACC + i], s[at]);
                        }
                    }
                }
            } else {
                [[unroll]] for (uint a = 0u; a < NT * ROWS; a++) {
                    uint j = a / ROWS, i = a % ROWS;
                    if (j < n && r0 + i < pc.rows) {
                        float v = acc[j * NACC + i];
                        if (pc.mode == 0u) {
                            s[y[j] + i] = v;
                        } else if (pc.mode == 1u) {
                            s[y[j] + i] = pc.row_base + r0 + i < pc.split_row ? silu(v * pc.scale) : 2.0 * sigmoid(v * pc.scale);
                        } else {
                            s[y[j] + i] = silu(v) * acc[j * NACC + ROWS + i];
                        }
                    }
                }
            }
        }
        e += n;
    }
#ifndef ARENA
    if (pc.kcols != 0u && pc.expert_off != 0u) {
        // This workgroup's partial sums are written; the last split of its
        // row group (and tile of entries) to get here adds them all.
        memoryBarrierBuffer();
        barrier();
        uint splits = (pc.cols + pc.kcols - 1u) / pc.kcols;
        if (gl_LocalInvocationIndex == 0u) {
            uint c = pc.expert_off + gl_WorkGroupID.y * groups + wg;
            split_last = atomicAdd(sn[c], 1u) == splits - 1u;
            if (split_last) sn[c] = 0u;
        }
        barrier();
        if (!split_last) return;
        memoryBarrierBuffer();
        uint stride = swiglu ? 2u * pc.rows : pc.rows, first = wg * sets * ROWS;
        uint nrows = min(sets * ROWS, pc.rows - first), outs = nrows * (end - k0);
        for (uint q = gl_LocalInvocationIndex; q < outs; q += gl_WorkGroupSize.x) {
            uint r = first + q % nrows, k = k0 + q / nrows;
            // The splits' sums loaded SPLITS_AHEAD at a time, all in flight
            // at once, then added in order.
            float v = 0.0, u = 0.0;
            for (uint p0 = 0u; p0 < splits; p0 += SPLITS_AHEAD) {
                float pv[SPLITS_AHEAD], pu[SPLITS_AHEAD];
                [[unroll]] for (uint i = 0u; i < SPLITS_AHEAD; i++) {
                    uint at = pc.partial_off + (min(p0 + i, splits - 1u) * pc.ntok + k) * stride + r;
                    pv[i] = sp[at];
                    pu[i] = swiglu ? sp[at + pc.rows] : 0.0;
                }
                [[unroll]] for (uint i = 0u; i < SPLITS_AHEAD; i++) {
                    if (p0 + i < splits) {
                        v += pv[i];
                        u += pu[i];
                    }
                }
            }
            mm_store(entry(k), r, v, u);
        }
    }
#endif
}
