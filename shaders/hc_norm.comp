#version 450
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_control_flow_attributes : require
// Grouped RMSNorm of the hyper-connection streams. Workgroup (c, p) writes
// elements [WG p, WG (p + 1)) of stream c: each sums the squares of its
// whole stream (every workgroup of a stream the same sum, in the same
// order), so a stream's elements are written by many workgroups at once
// rather than one looping over them. Workgroup z-index t is the pass's
// token t, whose activations are t * tok_stride floats further.
//
// With q_off (one token; the stream length a multiple of 32) the normalised
// streams, one vector of C * n values, are also rounded to 8 bits into the
// region at q_off for the fast matvec that reads them (act_int8.glsl's
// layout and values, as act_int8.comp would write from the floats written
// here): each workgroup's blocks of 32 by four invocations each.
#define WG 256
#define UN 16u
#include "common.glsl"
#include "act_int8.glsl"

layout(push_constant) uniform Push {
    uint x_off;
    uint gamma;   // params offset, spans all streams
    uint y_off;
    uint n;       // stream length
    float eps;
    uint tok_stride;
    uint q_off;   // 0: no rounded copy
} pc;

void main() {
    uint c = gl_WorkGroupID.x, base = c * pc.n + gl_WorkGroupID.z * pc.tok_stride;
    // The stream's values loaded UN at a time, all in flight at once, then
    // added in order (a loop of loads and adds waits out each load in turn).
    float ss = 0.0;
    for (uint i0 = gl_LocalInvocationIndex; i0 < pc.n; i0 += UN * WG) {
        float v[UN];
        [[unroll]] for (uint u = 0u; u < UN; u++) v[u] = i0 + u * WG < pc.n ? s[pc.x_off + base + i0 + u * WG] : 0.0;
        [[unroll]] for (uint u = 0u; u < UN; u++) if (i0 + u * WG < pc.n) ss += v[u] * v[u];
    }
    float r = rms_scale(wg_sum(ss), pc.n, pc.eps);
    uint i = gl_WorkGroupID.y * WG + gl_LocalInvocationIndex;
    if (i < pc.n) s[pc.y_off + base + i] = s[pc.x_off + base + i] * r * prm[pc.gamma + c * pc.n + i];
    if (pc.q_off == 0u) return;
    // Numbered by subgroup, so each block's four invocations share one.
    uint t = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID, quarter = t & 3u;
    uint first = gl_WorkGroupID.y * WG + 32u * (t >> 2) + 8u * quarter;
    bool live = t < WG / 8u && first < pc.n;
    vec4 v[2];
    [[unroll]] for (uint h = 0u; h < 2u; h++) {
        [[unroll]] for (uint e = 0u; e < 4u; e++) {
            uint k = live ? first + 4u * h + e : 0u;
            v[h][e] = live ? s[pc.x_off + base + k] * r * prm[pc.gamma + c * pc.n + k] : 0.0;
        }
    }
    uint w0, w1;
    int sum;
    float d;
    round_block(v[0], v[1], w0, w1, sum, d);
    if (live) store_block(pc.q_off, (c * pc.n + first) >> 5, quarter, w0, w1, sum, d);
}
