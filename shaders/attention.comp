#version 450
// Sparse gated attention, one workgroup per query head and token of a run
// (grid y: token y of the run, `tok_stride` floats after token 0's q, gates
// and output; its selection `sel_stride` floats further, its probabilities
// `tmp_tok`): the selected blocks (sel[0..keep], `ratio` tokens each) then
// the tail tokens tail_start..n_tokens; softmax; values; sigmoid output gate.
// Token y attends to n_tokens = n_first + y keys: with QSA (`qsa`) its
// complete blocks n_tokens / ratio, of which it keeps up to `keep`, then the
// rest as the tail; dense attention (ratio 1, qsa 0) reads every key as the
// tail. Each (head, token) is computed as when the token runs alone.
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
    uint tmp_tok;     // ... probability regions
} pc;

// This workgroup's token: its selection, blocks kept and tail.
uint g_sel, g_keep, g_tail_start;

shared float p_sh[WG];
shared uint v_sh[WG];

uint token(uint i) {
    uint nb = g_keep * pc.ratio;
    return i < nb ? floatBitsToUint(s[g_sel + i / pc.ratio]) * pc.ratio + i % pc.ratio : g_tail_start + (i - nb);
}

void main() {
    uint h = gl_WorkGroupID.x, y = gl_WorkGroupID.y, t = gl_LocalInvocationIndex, hd = pc.hd;
    uint kvh = h / (pc.nh / pc.nkv), stride = pc.nkv * hd;
    uint n_tokens = pc.n_first + y;
    uint n_complete = pc.qsa != 0u ? n_tokens / pc.ratio : 0u;
    g_keep = min(pc.keep, n_complete);
    g_tail_start = n_complete * pc.ratio;
    g_sel = pc.sel_off + y * pc.sel_stride;
    uint q_off = pc.q_off + y * pc.tok_stride;
    uint n = g_keep * pc.ratio + (n_tokens - g_tail_start), tmp = pc.tmp_off + y * pc.tmp_tok + h * pc.tmp_stride;
    // Scores, WG tokens per tile: a subgroup reads each key row together
    // (coalesced) and sums it with subgroupAdd into workgroup memory; then
    // invocation t keeps slot base + t, which it alone reads back below.
    float m = -1.0 / 0.0;
    uint lane = gl_SubgroupInvocationID;
    for (uint base = 0u; base < n; base += WG) {
        // Four key rows in flight per subgroup (independent loads).
        for (uint x = gl_SubgroupID; x < WG && base + x < n; x += 4u * gl_NumSubgroups) {
            float dot[4] = float[4](0.0, 0.0, 0.0, 0.0);
            uint k[4];
            for (uint u = 0u; u < 4u; u++) {
                uint xi = min(x + u * gl_NumSubgroups, n - 1u - base);
                k[u] = pc.keys_off + token(base + xi) * stride + kvh * hd;
            }
            for (uint j = lane; j < hd; j += gl_SubgroupSize) {
                float qj = s[q_off + h * hd + j];
                for (uint u = 0u; u < 4u; u++) dot[u] += qj * st[k[u] + j];
            }
            for (uint u = 0u; u < 4u; u++) {
                float score = subgroupAdd(dot[u]) * pc.scale;
                uint xu = x + u * gl_NumSubgroups;
                if (subgroupElect() && xu < WG && base + xu < n) p_sh[xu] = score;
            }
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
        // The tile's probabilities and value-row offsets, then four rows in
        // flight per step (independent loads).
        if (base + t < n) {
            p_sh[t] = s[tmp + base + t] / sum;
            v_sh[t] = pc.values_off + token(base + t) * stride + kvh * hd;
        }
        barrier();
        uint end = min(WG, n - base), i = 0u;
        for (; i + 4u <= end; i += 4u) {
            for (uint c = 0u; c < 4u; c++) {
                uint j = t + c * WG;
                if (j < hd)
                    acc[c] += p_sh[i] * st[v_sh[i] + j] + p_sh[i + 1u] * st[v_sh[i + 1u] + j]
                            + p_sh[i + 2u] * st[v_sh[i + 2u] + j] + p_sh[i + 3u] * st[v_sh[i + 3u] + j];
            }
        }
        for (; i < end; i++) {
            for (uint c = 0u; c < 4u; c++) {
                uint j = t + c * WG;
                if (j < hd) acc[c] += p_sh[i] * st[v_sh[i] + j];
            }
        }
        barrier();
    }
    for (uint c = 0u; c < 4u; c++) {
        uint j = t + c * WG;
        if (j < hd) s[pc.y_off + y * pc.tok_stride + h * hd + j] = acc[c] * sigmoid(s[pc.qg_off + y * pc.tok_stride + h * 2u * hd + hd + j]);
    }
}
