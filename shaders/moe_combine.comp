#version 450
// MoE output and residual write-back, WG columns per workgroup (each
// workgroup computes the shared-expert gate, a dot over h, itself):
// out = sum_k w_k y_k (+ sigmoid(shared_gate . x) * shared when the shared
// expert ran outside the arena) (+ the experts the host computed, already
// weighted and summed, with the expert cache); X_c += inject_c * out.
// Workgroup y-index t is the pass's token t (activations t * tok_stride further).
#define WG 256
#include "common.glsl"

layout(push_constant) uniform Push {
    uint y_off;       // [k][h] routed expert outputs
    uint w_off;       // [k]
    uint shared_off;  // [h]
    uint x_off;       // [h] MoE input
    uint shared_gate; // params [h]
    uint res_off;
    uint inject_off;  // [streams]
    uint h;
    uint k;
    uint streams;
    uint shared_separate;
    uint partial_off; // [h] the host's weighted sum of the experts it computed; ~0: none
    uint tok_stride;
} pc;

void main() {
    uint t = gl_LocalInvocationIndex, h = pc.h, a = gl_WorkGroupID.y * pc.tok_stride;
    float g = 0.0;
    if (pc.shared_separate == 1u)
        for (uint i = t; i < h; i += WG) g += prm[pc.shared_gate + i] * s[pc.x_off + a + i];
    float sg = sigmoid(wg_sum(g));
    uint d = gl_WorkGroupID.x * WG + t;
    if (d < h) {
        float out_d = 0.0;
        for (uint e = 0u; e < pc.k; e++) out_d += s[pc.y_off + a + e * h + d] * s[pc.w_off + a + e];
        if (pc.shared_separate == 1u) out_d += sg * s[pc.shared_off + a + d];
        if (pc.partial_off != 0xffffffffu) out_d += s[pc.partial_off + a + d];
        for (uint c = 0u; c < pc.streams; c++) s[pc.res_off + a + c * h + d] += s[pc.inject_off + a + c] * out_d;
    }
}
