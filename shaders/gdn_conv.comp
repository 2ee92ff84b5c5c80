#version 450
// Gated DeltaNet depthwise causal conv + SiLU over [history, current]; the
// history (first (Kc-1)*Dc floats of the layer state) shifts by one token.
#define WG 64
#include "common.glsl"

layout(push_constant) uniform Push {
    uint x_off;   // [Dc] qkv projection
    uint y_off;   // [Dc]
    uint taps;    // params offset, [Dc][Kc]
    uint dc;
    uint kc;
} pc;

void main() {
    uint c = gl_GlobalInvocationID.x;
    if (c >= pc.dc) return;
    uint kc = pc.kc;
    float x = s[pc.x_off + c];
    float acc = prm[pc.taps + c * kc + kc - 1u] * x;
    for (uint k = 0u; k + 1u < kc; k++) acc += prm[pc.taps + c * kc + k] * st[k * pc.dc + c];
    s[pc.y_off + c] = silu(acc);
    for (uint k = 0u; k + 2u < kc; k++) st[k * pc.dc + c] = st[(k + 1u) * pc.dc + c];
    if (kc > 1u) st[(kc - 2u) * pc.dc + c] = x;
}
