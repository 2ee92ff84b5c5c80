#version 450
// Gated DeltaNet depthwise causal conv + SiLU over the inputs of positions
// pos-Kc+1..pos, for the `n` tokens of a pass one after another (each
// invocation owns a channel, so a token reads the ring rows the ones before
// it wrote without a barrier); the history is a ring of `rows` rows by
// position (the first rows*Dc floats of the layer state; see
// src/model/backend.rs), and a token's input goes to row pos % rows.
#define WG 64
#include "common.glsl"

layout(push_constant) uniform Push {
    uint x_off;      // [Dc] qkv projection (token 0's; tok_stride apart)
    uint y_off;      // [Dc]
    uint taps;       // params offset, [Dc][Kc]
    uint dc;
    uint kc;
    uint rows;       // ring rows (>= Kc)
    uint pos;        // position of the first token
    uint n;          // tokens
    uint tok_stride; // floats between tokens' activations
} pc;

void main() {
    uint c = gl_GlobalInvocationID.x;
    if (c >= pc.dc) return;
    uint kc = pc.kc, rows = pc.rows;
    for (uint t = 0u; t < pc.n; t++) {
        uint pos = pc.pos + t;
        float x = s[pc.x_off + t * pc.tok_stride + c];
        float acc = prm[pc.taps + c * kc + kc - 1u] * x;
        // Tap k reads the input kc-1-k positions back (rows before the start hold zeros).
        for (uint k = 0u; k + 1u < kc; k++) {
            uint row = (pos + rows - (kc - 1u - k)) % rows;
            acc += prm[pc.taps + c * kc + k] * st[row * pc.dc + c];
        }
        s[pc.y_off + t * pc.tok_stride + c] = silu(acc);
        st[(pos % rows) * pc.dc + c] = x;
    }
}
