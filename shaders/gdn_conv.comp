#version 450
// Gated DeltaNet depthwise causal conv + SiLU over the inputs of positions
// pos-Kc+1..pos, for the `n` tokens of a pass. The history is a ring of
// `rows` rows by position (the first rows*Dc floats of the layer state; see
// src/model/backend.rs), and a token's input goes to row pos % rows.
//
// A workgroup owns 64 channels (x) and spreads the pass's tokens over its
// eight invocations of a channel (y): a token reads the inputs of the
// tokens before it in the pass where they are (the pass's inputs) and only
// the earlier positions from the ring, so the tokens are independent; after
// a barrier the last `rows` tokens write their inputs into the ring (what
// token-by-token writes leave there). Each sum runs in token-by-token
// decoding's order (gdn.glsl's, which one token's fused step shares): a
// pass gives its values bit for bit.
#define WG 64
#include "common.glsl"
#include "gdn.glsl"
layout(local_size_y = 8) in;

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
    uint c = gl_GlobalInvocationID.x, lanes = gl_WorkGroupSize.y;
    bool live = c < pc.dc;
    uint rows = pc.rows;
    for (uint t = gl_LocalInvocationID.y; live && t < pc.n; t += lanes) {
        s[pc.y_off + t * pc.tok_stride + c] = gdn_conv_at(pc.x_off, pc.tok_stride, t, pc.pos + t, c, pc.dc, pc.kc, pc.rows, pc.taps);
    }
    // Every read of the ring's earlier rows is done before they are overwritten.
    memoryBarrierBuffer();
    barrier();
    for (uint t = gl_LocalInvocationID.y; live && t < pc.n; t += lanes) {
        if (t + rows >= pc.n) st[((pc.pos + t) % rows) * pc.dc + c] = s[pc.x_off + t * pc.tok_stride + c];
    }
}
