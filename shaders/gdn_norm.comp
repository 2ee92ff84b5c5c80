#version 450
// The Gated DeltaNet's gated RMSNorm after its delta rule
// (shaders/gdn_recurrent.comp), in place: workgroup (h, t) takes value
// head h of token t of a pass, y = o * rms(o) * norm * gate(z) over the
// head's d values (d <= 128; one invocation each).
#define WG 128
#include "common.glsl"

layout(push_constant) uniform Push {
    uint y_off;      // [nv*d] the delta rule's output (token 0's; tok_stride apart)
    uint z_off;      // [nv*d]
    uint d;
    uint norm;       // params [d]
    uint gate_silu;  // 1 = SiLU gate, 0 = sigmoid
    float eps;
    uint tok_stride; // floats between tokens' activations
} pc;

void main() {
    uint h = gl_WorkGroupID.x, j = gl_LocalInvocationID.x, d = pc.d;
    uint a = gl_WorkGroupID.y * pc.tok_stride + h * d + j;
    float o = j < d ? s[pc.y_off + a] : 0.0;
    float r = rms_scale(wg_sum(o * o), d, pc.eps);
    if (j < d) {
        float z = s[pc.z_off + a];
        float g = pc.gate_silu == 1u ? silu(z) : sigmoid(z);
        s[pc.y_off + a] = o * r * prm[pc.norm + j] * g;
    }
}
