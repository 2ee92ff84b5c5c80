#version 450
// QSA block scores: score[b] = sum_h relu(q_h . key_b) * scale, one
// invocation per complete block.
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
} pc;

void main() {
    uint b = gl_GlobalInvocationID.x;
    if (b >= pc.n_blocks) return;
    float total = 0.0;
    for (uint h = 0u; h < pc.heads; h++) {
        float dot = 0.0;
        for (uint i = 0u; i < pc.id; i++) dot += s[pc.query_off + h * pc.id + i] * st[pc.block_keys + b * pc.id + i];
        total += max(dot, 0.0);
    }
    s[pc.score_off + b] = total * pc.scale;
}
