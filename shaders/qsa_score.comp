#version 450
// QSA block scores: score[b] = sum_h relu(q_h . key_b) * scale, one
// workgroup per complete block (grid x, then z past the grid's width): its
// invocations read the block's key and the query heads together
// (coalesced, four heads' loads in flight), each head's dot summed over the
// workgroup. Workgroup y-index t is the t-th token of a run of a pass's
// tokens: its query tok_stride floats further, its scores score_stride
// further, its blocks those complete at its position,
// n_blocks + (phase + t) / ratio (ratio 0: one token, n_blocks).
#define WG 64
#include "common.glsl"

layout(push_constant) uniform Push {
    uint query_off;   // [heads*id]
    uint block_keys;  // layer-state offset
    uint score_off;
    uint n_blocks;
    uint heads;
    uint id;
    float scale;
    uint ratio;       // tokens per block (0: one token)
    uint phase;       // (first token's position + 1) % ratio
    uint tok_stride;
    uint score_stride;
} pc;

void main() {
    uint b = gl_WorkGroupID.x + gl_WorkGroupID.z * gl_NumWorkGroups.x, t = gl_WorkGroupID.y, i = gl_LocalInvocationIndex;
    uint n_blocks = pc.ratio == 0u ? pc.n_blocks : pc.n_blocks + (pc.phase + t) / pc.ratio;
    if (b >= n_blocks) return;
    uint q = pc.query_off + t * pc.tok_stride, k = pc.block_keys + b * pc.id;
    float total = 0.0;
    for (uint h0 = 0u; h0 < pc.heads; h0 += 4u) {
        float dot[4] = float[4](0.0, 0.0, 0.0, 0.0);
        for (uint j = i; j < pc.id; j += WG) {
            float kj = st[k + j];
            for (uint u = 0u; u < 4u; u++)
                if (h0 + u < pc.heads) dot[u] += s[q + (h0 + u) * pc.id + j] * kj;
        }
        for (uint u = 0u; u < 4u; u++)
            if (h0 + u < pc.heads) total += max(wg_sum(dot[u]), 0.0);
    }
    if (i == 0u) s[pc.score_off + t * pc.score_stride + b] = total * pc.scale;
}
