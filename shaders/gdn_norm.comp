#version 450
// The Gated DeltaNet's gated RMSNorm after its delta rule
// (shaders/gdn_recurrent.comp), in place: workgroup (h, t) takes value
// head h of token t of a pass, y = o * rms(o) * norm * gate(z) over the
// head's d values (d <= 128; one invocation each).
#define WG 128
#include "common.glsl"
#include "gdn.glsl"

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
    float z = j < d ? s[pc.z_off + a] : 0.0;
    float y = gdn_gated_norm(o, z, j, d, pc.norm, pc.gate_silu, pc.eps);
    if (j < d) s[pc.y_off + a] = y;
}
