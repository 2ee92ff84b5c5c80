#version 450
// Grouped RMSNorm of the hyper-connection streams: one workgroup per stream.
#define WG 256
#include "common.glsl"

layout(push_constant) uniform Push {
    uint x_off;
    uint gamma;   // params offset, spans all streams
    uint y_off;
    uint n;       // stream length
    float eps;
} pc;

void main() {
    uint c = gl_WorkGroupID.x, base = c * pc.n;
    float ss = 0.0;
    for (uint i = gl_LocalInvocationIndex; i < pc.n; i += WG) ss += s[pc.x_off + base + i] * s[pc.x_off + base + i];
    float r = rms_scale(wg_sum(ss), pc.n, pc.eps);
    for (uint i = gl_LocalInvocationIndex; i < pc.n; i += WG)
        s[pc.y_off + base + i] = s[pc.x_off + base + i] * r * prm[pc.gamma + base + i];
}
