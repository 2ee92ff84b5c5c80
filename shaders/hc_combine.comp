#version 450
// Block input from the streams: y[d] = mean_c sigmoid(mix[c][d]) * xn[c][d].
// Workgroup y-index t is the pass's token t (activations t * tok_stride further).
#define WG 64
#include "common.glsl"

layout(push_constant) uniform Push {
    uint mix_off;
    uint xn_off;
    uint y_off;
    uint n;
    uint streams;
    uint tok_stride;
} pc;

void main() {
    uint d = gl_GlobalInvocationID.x;
    if (d >= pc.n) return;
    uint a = gl_WorkGroupID.y * pc.tok_stride;
    // precise: added as the up projection's fused epilogue adds them
    // (shaders/matvec.comp, mode 5), bit for bit.
    precise float acc = 0.0;
    for (uint c = 0u; c < pc.streams; c++) acc += sigmoid(s[pc.mix_off + a + c * pc.n + d]) * s[pc.xn_off + a + c * pc.n + d];
    s[pc.y_off + a + d] = acc / float(pc.streams);
}
