#version 450
// Block input from the streams: y[d] = mean_c sigmoid(mix[c][d]) * xn[c][d].
#define WG 64
#include "common.glsl"

layout(push_constant) uniform Push {
    uint mix_off;
    uint xn_off;
    uint y_off;
    uint n;
    uint streams;
} pc;

void main() {
    uint d = gl_GlobalInvocationID.x;
    if (d >= pc.n) return;
    float acc = 0.0;
    for (uint c = 0u; c < pc.streams; c++) acc += sigmoid(s[pc.mix_off + c * pc.n + d]) * s[pc.xn_off + c * pc.n + d];
    s[pc.y_off + d] = acc / float(pc.streams);
}
