#version 450
// Sparse gated attention, one workgroup per query head: the selected blocks
// (sel[0..keep], `ratio` tokens each) then the tail tokens
// tail_start..tail_start+n_tail; softmax; values; sigmoid output gate.
// Scores are computed a subgroup per key row; probabilities go through
// scratch, each slot written and re-read by the same invocation, and are
// shared in tiles through workgroup memory.
#define WG 256
#include "common.glsl"

layout(push_constant) uniform Push {
    uint q_off;       // [nh*hd]
    uint qg_off;      // gates at qg[h*2*hd + hd + j]
    uint keys_off;    // layer-state offsets
    uint values_off;
    uint sel_off;
    uint tmp_off;     // [nh][tmp_stride] probabilities
    uint tmp_stride;
    uint y_off;       // [nh*hd]
    uint keep;
    uint ratio;
    uint tail_start;
    uint n_tail;
    uint hd;
    uint nh;
    uint nkv;
    float scale;
} pc;

shared float p_sh[WG];

uint token(uint i) {
    uint nb = pc.keep * pc.ratio;
    return i < nb ? floatBitsToUint(s[pc.sel_off + i / pc.ratio]) * pc.ratio + i % pc.ratio : pc.tail_start + (i - nb);
}

void main() {
    uint h = gl_WorkGroupID.x, t = gl_LocalInvocationIndex, hd = pc.hd;
    uint kvh = h / (pc.nh / pc.nkv), stride = pc.nkv * hd;
    uint n = pc.keep * pc.ratio + pc.n_tail, tmp = pc.tmp_off + h * pc.tmp_stride;
    // Scores, WG tokens per tile: a subgroup reads each key row together
    // (coalesced) and sums it with subgroupAdd into workgroup memory; then
    // invocation t keeps slot base + t, which it alone reads back below.
    float m = -1.0 / 0.0;
    uint lane = gl_SubgroupInvocationID;
    for (uint base = 0u; base < n; base += WG) {
        for (uint x = gl_SubgroupID; x < WG && base + x < n; x += gl_NumSubgroups) {
            uint k = pc.keys_off + token(base + x) * stride + kvh * hd;
            float dot = 0.0;
            for (uint j = lane; j < hd; j += gl_SubgroupSize) dot += s[pc.q_off + h * hd + j] * st[k + j];
            float score = subgroupAdd(dot) * pc.scale;
            if (subgroupElect()) p_sh[x] = score;
        }
        barrier();
        if (base + t < n) {
            s[tmp + base + t] = p_sh[t];
            m = max(m, p_sh[t]);
        }
        barrier();
    }
    m = wg_max(m);
    float sum = 0.0;
    for (uint i = t; i < n; i += WG) {
        float e = exp(s[tmp + i] - m);
        s[tmp + i] = e;
        sum += e;
    }
    sum = wg_sum(sum);
    float acc[4] = float[4](0.0, 0.0, 0.0, 0.0);  // columns t, t+WG, ... (hd <= 4*WG)
    for (uint base = 0u; base < n; base += WG) {
        if (base + t < n) p_sh[t] = s[tmp + base + t] / sum;
        barrier();
        for (uint i = base; i < min(base + WG, n); i++) {
            uint v = pc.values_off + token(i) * stride + kvh * hd;
            for (uint c = 0u; c < 4u; c++) {
                uint j = t + c * WG;
                if (j < hd) acc[c] += p_sh[i - base] * st[v + j];
            }
        }
        barrier();
    }
    for (uint c = 0u; c < 4u; c++) {
        uint j = t + c * WG;
        if (j < hd) s[pc.y_off + h * hd + j] = acc[c] * sigmoid(s[pc.qg_off + h * 2u * hd + hd + j]);
    }
}
