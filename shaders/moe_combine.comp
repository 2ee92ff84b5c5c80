#version 450
#extension GL_EXT_control_flow_attributes : require
// MoE output and residual write-back, WG columns per workgroup (each
// workgroup computes the shared-expert gate, a dot over h, itself):
// out = sum_k w_k y_k (+ sigmoid(shared_gate . x) * shared when the shared
// expert ran outside the arena) (+ the experts the host computed, already
// weighted and summed, with the expert cache); X_c += inject_c * out.
// Workgroup y-index t is the pass's token t (activations t * tok_stride further).
#define WG 256
// Loops over loads take them UN at a time, all in flight at once, then use
// them in order (a loop of loads and adds waits out each load in turn).
#define UN 8u
#include "common.glsl"
#include "dot_ahead.glsl"

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
    float g = pc.shared_separate == 1u ? dot_prm_ahead(pc.shared_gate, pc.x_off + a, h, t) : 0.0;
    float sg = sigmoid(wg_sum(g));
    uint d = gl_WorkGroupID.x * WG + t;
    if (d < h) {
        float out_d = 0.0;
        for (uint e0 = 0u; e0 < pc.k; e0 += UN) {
            float y[UN], w[UN];
            [[unroll]] for (uint u = 0u; u < UN; u++) {
                uint e = min(e0 + u, pc.k - 1u);
                y[u] = s[pc.y_off + a + e * h + d];
                w[u] = s[pc.w_off + a + e];
            }
            [[unroll]] for (uint u = 0u; u < UN; u++) if (e0 + u < pc.k) out_d += y[u] * w[u];
        }
        if (pc.shared_separate == 1u) out_d += sg * s[pc.shared_off + a + d];
        if (pc.partial_off != 0xffffffffu) out_d += s[pc.partial_off + a + d];
        for (uint c0 = 0u; c0 < pc.streams; c0 += 4u) {
            float r[4], j[4];
            [[unroll]] for (uint u = 0u; u < 4u; u++) {
                uint c = min(c0 + u, pc.streams - 1u);
                r[u] = s[pc.res_off + a + c * h + d];
                j[u] = s[pc.inject_off + a + c];
            }
            [[unroll]] for (uint u = 0u; u < 4u; u++) if (c0 + u < pc.streams) s[pc.res_off + a + (c0 + u) * h + d] = r[u] + j[u] * out_d;
        }
    }
}
