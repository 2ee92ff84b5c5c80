#version 450
// QSA top-k in one workgroup, linear in the block count: the `keep` best
// blocks by score (higher first; equal scores keep the earlier block, as the
// CPU's stable sort does) are written to sel[0..keep] in that order.
//
// 1. Scores become order-preserving unsigned keys (the order of the CPU's
//    `total_cmp`), and the keep-th largest key T is found a byte at a time
//    from the top (radix select): 4 passes over the blocks, each a
//    histogram of the next byte of the keys that share T's bytes so far
//    (workgroup atomics), whose bin holding the keep-th largest of them
//    (a workgroup prefix sum from the top bin down) is T's byte.
// 2. The blocks above T, and the earliest blocks equal to T until `keep` are
//    taken, are compacted in block order into shared memory (each
//    invocation scans a contiguous range; exclusive prefix sums place them).
// 3. Each chosen block's rank among the chosen (a `keep`-squared pass over
//    shared memory) is its place in sel.
// Up to MAX_KEEP blocks (contexts up to 4096 tokens at ratio 4) skip 1 and
// 2: every block is a candidate of 3, and those ranked below `keep` go to
// sel[rank]: the same selection in the same order, without the passes'
// barriers.
// One workgroup per token; `keep` is at most MAX_KEEP (checked at load).
// Workgroup y-index t is the t-th token of a run of a pass's tokens: its
// scores score_stride floats further, its selection sel_stride further,
// its blocks n_blocks + (phase + t) / ratio (ratio 0: one token, n_blocks).
#define WG 256
#define MAX_KEEP 1024u
#include "common.glsl"

layout(push_constant) uniform Push {
    uint score_off;
    uint sel_off;
    uint n_blocks;
    uint keep;
    uint ratio;
    uint phase;
    uint score_stride;
    uint sel_stride;
} pc;

uint score_at = 0u;

shared uint part[WG / 4];
shared uint hist[WG];
shared uint pick[2];
shared uint chosen_id[MAX_KEEP];
shared uint chosen_key[MAX_KEEP];

// Larger score, larger key; NaNs and signed zeros ordered as total_cmp does.
uint key_of(uint b) {
    uint u = floatBitsToUint(s[score_at + b]);
    return (u & 0x80000000u) != 0u ? ~u : u | 0x80000000u;
}

// Sum of `v` over the workgroup; every invocation must call it.
uint wg_total(uint v) {
    uint p = subgroupAdd(v);
    if (subgroupElect()) part[gl_SubgroupID] = p;
    barrier();
    uint r = 0u;
    for (uint i = 0u; i < gl_NumSubgroups; i++) r += part[i];
    barrier();
    return r;
}

// Sum of `v` over the invocations before this one; every invocation must call it.
uint wg_before(uint v) {
    uint p = subgroupAdd(v);
    if (subgroupElect()) part[gl_SubgroupID] = p;
    barrier();
    uint r = subgroupExclusiveAdd(v);
    for (uint i = 0u; i < gl_SubgroupID; i++) r += part[i];
    barrier();
    return r;
}

void main() {
    uint t = gl_LocalInvocationIndex;
    uint y = gl_WorkGroupID.y;
    uint n = pc.ratio == 0u ? pc.n_blocks : pc.n_blocks + (pc.phase + y) / pc.ratio;
    score_at = pc.score_off + y * pc.score_stride;
    uint sel = pc.sel_off + y * pc.sel_stride;
    uint keep = min(min(pc.keep, n), MAX_KEEP);
    if (keep == 0u) return;
    // The candidates ranked at the end: every block where they fit, else
    // the `keep` the radix select chose.
    uint m = keep;
    if (n <= MAX_KEEP) {
        for (uint b = t; b < n; b += WG) {
            chosen_id[b] = b;
            chosen_key[b] = key_of(b);
        }
        m = n;
    } else {
        uint per = (n + WG - 1u) / WG;
        uint lo = min(t * per, n), hi = min(lo + per, n);

        uint T = 0u, left = keep;
        for (int pass = 3; pass >= 0; pass--) {
            uint shift = uint(pass) * 8u;
            uint above_mask = pass == 3 ? 0u : ~0u << (shift + 8u);
            hist[t] = 0u;
            barrier();
            for (uint b = lo; b < hi; b++) {
                uint k = key_of(b);
                if ((k & above_mask) == (T & above_mask)) atomicAdd(hist[(k >> shift) & 255u], 1u);
            }
            barrier();
            // Invocation t holds byte d = 255 - t: `above` keys of the prefix
            // have a larger byte; the keep-th largest has byte d where `above`
            // falls short of `left` (of `keep`, those not above the prefix) and
            // `above` + its count does not.
            uint d = 255u - t, count = hist[d];
            uint above = wg_before(count);
            if (above < left && above + count >= left) {
                pick[0] = d;
                pick[1] = above;
            }
            barrier();
            T |= pick[0] << shift;
            left -= pick[1];
            barrier();
        }

        uint gt = 0u, eq = 0u;
        for (uint b = lo; b < hi; b++) {
            uint k = key_of(b);
            gt += k > T ? 1u : 0u;
            eq += k == T ? 1u : 0u;
        }
        uint need = keep - wg_total(gt);
        uint eq_seen = wg_before(eq);
        uint taken = gt + min(eq, need - min(need, eq_seen));
        uint at = wg_before(taken);
        for (uint b = lo; b < hi; b++) {
            uint k = key_of(b);
            bool take = k > T;
            if (k == T) {
                take = eq_seen < need;
                eq_seen++;
            }
            if (take) {
                chosen_id[at] = b;
                chosen_key[at] = k;
                at++;
            }
        }
    }
    barrier();

    for (uint i = t; i < m; i += WG) {
        uint k = chosen_key[i], b = chosen_id[i], rank = 0u;
        for (uint j = 0u; j < m; j++) {
            uint kj = chosen_key[j];
            rank += (kj > k || (kj == k && chosen_id[j] < b)) ? 1u : 0u;
        }
        if (rank < keep) s[sel + rank] = uintBitsToFloat(b);
    }
}
