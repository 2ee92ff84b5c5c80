#version 450
// QSA block scores: score[b] = sum_h relu(q_h . key_b) * scale, one
// invocation per complete block. Workgroup y-index t is the t-th token of a
// run of a pass's tokens: its query tok_stride floats further, its scores
// score_stride further, its blocks those complete at its position,
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
    uint b = gl_GlobalInvocationID.x, t = gl_WorkGroupID.y;
    uint n_blocks = pc.ratio == 0u ? pc.n_blocks : pc.n_blocks + (pc.phase + t) / pc.ratio;
    if (b >= n_blocks) return;
    uint q = pc.query_off + t * pc.tok_stride;
    float total = 0.0;
    for (uint h = 0u; h < pc.heads; h++) {
        float dot = 0.0;
        for (uint i = 0u; i < pc.id; i++) dot += s[q + h * pc.id + i] * st[pc.block_keys + b * pc.id + i];
        total += max(dot, 0.0);
    }
    s[pc.score_off + t * pc.score_stride + b] = total * pc.scale;
}
