#version 450
#extension GL_KHR_shader_subgroup_shuffle : require
// Activations rounded to 8 bits once per pass for the fast matvecs after it
// (act_int8.glsl; matvec.comp's copy_x reads them): for token y (tok_stride
// floats apart) the `count` vectors of `cols` values at x_off + j * x_stride
// (an expert pair's inputs: count = k), as one run of count * cols values,
// into the token's region at q_off. Four invocations per block of 32.
#define WG 128
#include "common.glsl"
#include "act_int8.glsl"

layout(push_constant) uniform Push {
    uint x_off;
    uint x_stride;    // floats between a token's vectors
    uint tok_stride;
    uint cols;        // a multiple of 32
    uint count;       // vectors per token; count * cols <= FAST_MAX_COLS
    uint q_off;       // token 0's region
} pc;

vec4 at4(uint i) { return vec4(s[i], s[i + 1u], s[i + 2u], s[i + 3u]); }

void main() {
    uint t = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;
    uint quarter = t & 3u;
    uint per = pc.cols >> 5, nb = per * pc.count;
    uint b = gl_WorkGroupID.x * (WG / 4u) + (t >> 2);
    // Every invocation runs the shuffles; those past the end take a zero block.
    bool live = b < nb;
    uint c = min(b, nb - 1u);
    uint tok = gl_WorkGroupID.y * pc.tok_stride;
    uint at = pc.x_off + tok + (c / per) * pc.x_stride + 32u * (c % per) + 8u * quarter;
    vec4 v0 = live ? at4(at) : vec4(0.0), v1 = live ? at4(at + 4u) : vec4(0.0);
    uint w0, w1;
    int sum;
    float d;
    round_block(v0, v1, w0, w1, sum, d);
    if (live) store_block(pc.q_off + tok, b, quarter, w0, w1, sum, d);
}
