#version 450
// Sparse gated attention, split over the keys: workgroup (h, y, z) takes
// query head h of token y of the run (grid y: `tok_stride` floats after
// token 0's q, gates and output; its selection `sel_stride` floats further)
// and split z of the keys that token attends: the selected blocks (sel[0..keep],
// `ratio` tokens each) then the tail tokens tail_start..n_tokens. Token y
// attends to n_tokens = n_first + y keys: with QSA (`qsa`) its complete
// blocks n_tokens / ratio, of which it keeps up to `keep`, then the rest as
// the tail; dense attention (ratio 1, qsa 0) reads every key as the tail.
//
// A token attending n keys splits them into runs of split_keys(n) (whole
// units of 64 keys, at most MAX_SPLITS runs): a function of n alone, so
// each (head, token) is computed as when the token runs alone. A split's
// workgroup keeps its keys' scores in workgroup memory, a tile of WG keys
// at a time (online softmax across tiles: the running maximum and sum
// rescaled), and writes its partial (its maximum m, its sum l of
// exp(score - m), and the values weighted by those exponentials) to
// (token, head)'s region of the scratch, `tmp_stride` floats per head,
// `tmp_tok` per token. The splits are combined in a fixed order (every
// partial scaled by exp(m - max m), the values' sum divided by the sums'),
// then the sigmoid output gate:
// - with arrival counters (`counts_off` != 0: one per token and head, zero
//   before and after) by the last of the token's head's splits to finish;
// - without (`counts_off` 0), by a second dispatch with `combine` 1 (grid
//   nh x tokens), the same code.
// One decode token's attention is then as many workgroups as heads times
// splits, not one per head with a chain of dependent loads per key.
#define WG 256
#define MAX_SPLITS 16u
#define SPLIT_UNIT 64u
#include "common.glsl"

layout(push_constant) uniform Push {
    uint q_off;       // [nh*hd]
    uint qg_off;      // gates at qg[h*2*hd + hd + j]
    uint keys_off;    // layer-state offsets
    uint values_off;
    uint sel_off;
    uint tmp_off;     // [token][nh][split] partials of hd + 2 floats
    uint tmp_stride;  // floats per head: the most splits x (hd + 2)
    uint y_off;       // [nh*hd]
    uint keep;        // most blocks a token keeps
    uint ratio;
    uint n_first;     // keys token 0 of the run attends to (its position + 1)
    uint qsa;         // 1: QSA blocks and tail, 0: dense
    uint hd;
    uint nh;
    uint nkv;
    float scale;
    uint tok_stride;  // floats between the run's tokens' q, gates, y
    uint sel_stride;  // ... selections
    uint tmp_tok;     // ... partial regions
    uint counts_off;  // [token][nh] arrival counters; 0: none (combine apart)
    uint combine;     // 1: only combine each (head, token)'s splits
} pc;

// The partials and the counters, seen coherently across workgroups.
layout(set = 0, binding = 0) coherent buffer ScratchC { float sc[]; };
layout(set = 0, binding = 0) coherent buffer Counts { uint sn[]; };

// This workgroup's token: its selection, blocks kept and tail.
uint g_sel, g_keep, g_tail_start;

shared float p_sh[WG];
shared uint v_sh[WG];
shared bool last;

uint token(uint i) {
    uint nb = g_keep * pc.ratio;
    return i < nb ? floatBitsToUint(s[g_sel + i / pc.ratio]) * pc.ratio + i % pc.ratio : g_tail_start + (i - nb);
}

// Keys per split of a token attending `n` keys (src/vulkan/blocks.rs: `attention_splits`).
uint split_keys(uint n) {
    return SPLIT_UNIT * ((n + SPLIT_UNIT * MAX_SPLITS - 1u) / (SPLIT_UNIT * MAX_SPLITS));
}

// Head h of token y from its `splits` partials at `part`.
void combine(uint h, uint y, uint splits, uint part) {
    uint t = gl_LocalInvocationIndex, hd = pc.hd, stride = hd + 2u;
    float m = -1.0 / 0.0;
    for (uint z = 0u; z < splits; z++) m = max(m, sc[part + z * stride]);
    float w[MAX_SPLITS];
    float den = 0.0;
    for (uint z = 0u; z < splits; z++) {
        w[z] = exp(sc[part + z * stride] - m);
        den += sc[part + z * stride + 1u] * w[z];
    }
    for (uint c = 0u; c < 4u; c++) {
        uint j = t + c * WG;
        if (j >= hd) break;
        float a = 0.0;
        for (uint z = 0u; z < splits; z++) a += sc[part + z * stride + 2u + j] * w[z];
        s[pc.y_off + y * pc.tok_stride + h * hd + j] = a / den * sigmoid(s[pc.qg_off + y * pc.tok_stride + h * 2u * hd + hd + j]);
    }
}

void main() {
    uint h = gl_WorkGroupID.x, y = gl_WorkGroupID.y, z = gl_WorkGroupID.z, t = gl_LocalInvocationIndex, hd = pc.hd;
    uint kvh = h / (pc.nh / pc.nkv), stride = pc.nkv * hd;
    uint n_tokens = pc.n_first + y;
    uint n_complete = pc.qsa != 0u ? n_tokens / pc.ratio : 0u;
    g_keep = min(pc.keep, n_complete);
    g_tail_start = n_complete * pc.ratio;
    g_sel = pc.sel_off + y * pc.sel_stride;
    uint n = g_keep * pc.ratio + (n_tokens - g_tail_start);
    uint per = split_keys(n), splits = (n + per - 1u) / per;
    uint part = pc.tmp_off + y * pc.tmp_tok + h * pc.tmp_stride;
    if (pc.combine != 0u) {
        combine(h, y, splits, part);
        return;
    }
    if (z >= splits) return;
    uint q_off = pc.q_off + y * pc.tok_stride + h * hd;
    uint k0 = z * per, k1 = min(n, k0 + per);
    uint lane = gl_SubgroupInvocationID;
    float m = -1.0 / 0.0, l = 0.0;
    float acc[4] = float[4](0.0, 0.0, 0.0, 0.0);  // columns t, t+WG, ... (hd <= 4*WG)
    for (uint base = k0; base < k1; base += WG) {
        uint cnt = min(WG, k1 - base);
        // Scores: a subgroup reads each key row together (coalesced), four
        // rows in flight, and sums it with subgroupAdd into workgroup memory.
        for (uint x = gl_SubgroupID; x < cnt; x += 4u * gl_NumSubgroups) {
            float dot[4] = float[4](0.0, 0.0, 0.0, 0.0);
            uint k[4];
            for (uint u = 0u; u < 4u; u++) {
                uint xi = min(x + u * gl_NumSubgroups, cnt - 1u);
                k[u] = pc.keys_off + token(base + xi) * stride + kvh * hd;
            }
            for (uint j = lane; j < hd; j += gl_SubgroupSize) {
                float qj = s[q_off + j];
                for (uint u = 0u; u < 4u; u++) dot[u] += qj * st[k[u] + j];
            }
            for (uint u = 0u; u < 4u; u++) {
                float score = subgroupAdd(dot[u]) * pc.scale;
                uint xu = x + u * gl_NumSubgroups;
                if (subgroupElect() && xu < cnt) p_sh[xu] = score;
            }
        }
        barrier();
        float score = t < cnt ? p_sh[t] : -1.0 / 0.0;
        float m_new = max(m, wg_max(score));
        float r = exp(m - m_new);
        float e = t < cnt ? exp(score - m_new) : 0.0;
        l = l * r + wg_sum(e);
        m = m_new;
        // The tile's weights and value-row offsets, then eight rows in
        // flight per step (independent loads).
        if (t < cnt) {
            p_sh[t] = e;
            v_sh[t] = pc.values_off + token(base + t) * stride + kvh * hd;
        }
        barrier();
        for (uint c = 0u; c < 4u; c++) {
            uint j = t + c * WG;
            if (j >= hd) break;
            float a = acc[c] * r;
            uint i = 0u;
            for (; i + 8u <= cnt; i += 8u) {
                a += p_sh[i] * st[v_sh[i] + j] + p_sh[i + 1u] * st[v_sh[i + 1u] + j]
                   + p_sh[i + 2u] * st[v_sh[i + 2u] + j] + p_sh[i + 3u] * st[v_sh[i + 3u] + j]
                   + p_sh[i + 4u] * st[v_sh[i + 4u] + j] + p_sh[i + 5u] * st[v_sh[i + 5u] + j]
                   + p_sh[i + 6u] * st[v_sh[i + 6u] + j] + p_sh[i + 7u] * st[v_sh[i + 7u] + j];
            }
            for (; i < cnt; i++) a += p_sh[i] * st[v_sh[i] + j];
            acc[c] = a;
        }
        barrier();
    }
    // The split's partial, then (with counters) the last split combines.
    uint at = part + z * (hd + 2u);
    if (t == 0u) {
        sc[at] = m;
        sc[at + 1u] = l;
    }
    for (uint c = 0u; c < 4u; c++) {
        uint j = t + c * WG;
        if (j < hd) sc[at + 2u + j] = acc[c];
    }
    if (pc.counts_off == 0u) return;
    memoryBarrierBuffer();
    barrier();
    if (t == 0u) {
        uint counter = pc.counts_off + y * pc.nh + h;
        last = atomicAdd(sn[counter], 1u) == splits - 1u;
        if (last) sn[counter] = 0u;
    }
    barrier();
    if (!last) return;
    memoryBarrierBuffer();
    combine(h, y, splits, part);
}
