#version 450
// QSA top-k: block b's rank is the number of blocks with a higher score or
// an equal score and a lower index (earlier blocks win ties); the `keep`
// best are written to sel[rank]. Quadratic in the block count.
#define WG 64
#include "common.glsl"

layout(push_constant) uniform Push {
    uint score_off;
    uint sel_off;
    uint n_blocks;
    uint keep;
} pc;

void main() {
    uint b = gl_GlobalInvocationID.x;
    if (b >= pc.n_blocks) return;
    float mine = s[pc.score_off + b];
    uint rank = 0u;
    for (uint o = 0u; o < pc.n_blocks; o++) {
        float v = s[pc.score_off + o];
        rank += (v > mine || (v == mine && o < b)) ? 1u : 0u;
    }
    if (rank < pc.keep) s[pc.sel_off + rank] = uintBitsToFloat(b);
}
