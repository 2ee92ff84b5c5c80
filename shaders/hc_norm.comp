#version 450
// Grouped RMSNorm of the hyper-connection streams. Workgroup (c, p) writes
// elements [WG p, WG (p + 1)) of stream c: each sums the squares of its
// whole stream (every workgroup of a stream the same sum, in the same
// order), so a stream's elements are written by many workgroups at once
// rather than one looping over them. Workgroup z-index t is the pass's
// token t, whose activations are t * tok_stride floats further.
#define WG 256
#include "common.glsl"

layout(push_constant) uniform Push {
    uint x_off;
    uint gamma;   // params offset, spans all streams
    uint y_off;
    uint n;       // stream length
    float eps;
    uint tok_stride;
} pc;

void main() {
    uint c = gl_WorkGroupID.x, base = c * pc.n + gl_WorkGroupID.z * pc.tok_stride;
    float ss = 0.0;
    for (uint i = gl_LocalInvocationIndex; i < pc.n; i += WG) ss += s[pc.x_off + base + i] * s[pc.x_off + base + i];
    float r = rms_scale(wg_sum(ss), pc.n, pc.eps);
    uint i = gl_WorkGroupID.y * WG + gl_LocalInvocationIndex;
    if (i < pc.n) s[pc.y_off + base + i] = s[pc.x_off + base + i] * r * prm[pc.gamma + c * pc.n + i];
}
