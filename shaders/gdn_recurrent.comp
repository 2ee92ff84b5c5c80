#version 450
#extension GL_EXT_control_flow_attributes : require
// Gated DeltaNet delta rule for one value head per workgroup, then the gated
// RMSNorm, for the `n` tokens of a pass one after another. Invocation j owns
// column j of the head's [dk][dv] state, held in registers from the first
// token to the last, so the state update needs no reduction. Head dims up
// to WG. The state is read from the plane of position `pos` and the state
// after each of the last `planes` tokens written to its position's plane
// (one per position of the rewind window; see src/model/backend.rs): the
// earlier ones would be overwritten by later tokens of the pass.
#define WG 128
#include "common.glsl"

layout(push_constant) uniform Push {
    uint conv_off;   // [2*nk*d + nv*d] conv output: q | k | v (token 0's; tok_stride apart)
    uint z_off;      // [nv*d]
    uint b_off;      // [nv]
    uint a_off;      // [nv]
    uint y_off;      // [nv*d]
    uint nk;
    uint nv;
    uint d;
    uint planes_off; // layer-state offset of plane 0 of the [planes][nv][d][d] states
    uint planes;     // planes (the rewind window + 1)
    uint pos;        // position of the first token
    uint n;          // tokens
    uint tok_stride; // floats between tokens' activations
    uint decay_a;    // params: -exp(A_log) [nv]
    uint dt_bias;    // params [nv]
    uint norm;       // params [d]
    uint gate_silu;  // 1 = SiLU gate, 0 = sigmoid
    float eps;
} pc;

shared float qs[WG];
shared float ks[WG];

void main() {
    uint h = gl_WorkGroupID.x, j = gl_LocalInvocationIndex, d = pc.d;
    uint kh = h % pc.nk;
    bool on = j < d;
    uint plane = d * d * pc.nv;
    uint col = h * d * d + j;
    float S[WG];
    uint from = pc.planes_off + (pc.pos % pc.planes) * plane + col;
    [[unroll]] for (uint i = 0u; i < WG; i++) S[i] = on && i < d ? st[from + i * d] : 0.0;
    for (uint t = 0u; t < pc.n; t++) {
        uint a = t * pc.tok_stride;
        uint c = pc.conv_off + a;
        float q = on ? s[c + kh * d + j] : 0.0;
        float k = on ? s[c + pc.nk * d + kh * d + j] : 0.0;
        float v = on ? s[c + 2u * pc.nk * d + h * d + j] : 0.0;
        float rq = 1.0 / sqrt(wg_sum(q * q) + 1e-6);
        float rk = 1.0 / sqrt(wg_sum(k * k) + 1e-6);
        qs[j] = q * rq * (1.0 / sqrt(float(d)));
        ks[j] = k * rk;
        barrier();
        float decay = exp(prm[pc.decay_a + h] * softplus(s[pc.a_off + a + h] + prm[pc.dt_bias + h]));
        float beta = sigmoid(s[pc.b_off + a + h]);
        float o = 0.0;
        float mem = 0.0;
        [[unroll]] for (uint i = 0u; i < WG; i++) if (i < d) mem += (S[i] * decay) * ks[i];
        float delta = (v - mem) * beta;
        [[unroll]] for (uint i = 0u; i < WG; i++) {
            if (i < d) {
                S[i] = S[i] * decay + ks[i] * delta;
                o += S[i] * qs[i];
            }
        }
        if (on && t + pc.planes >= pc.n) {
            uint to = pc.planes_off + ((pc.pos + t + 1u) % pc.planes) * plane + col;
            [[unroll]] for (uint i = 0u; i < WG; i++) if (i < d) st[to + i * d] = S[i];
        }
        float r = rms_scale(wg_sum(o * o), d, pc.eps);
        if (on) {
            float z = s[pc.z_off + a + h * d + j];
            float g = pc.gate_silu == 1u ? silu(z) : sigmoid(z);
            s[pc.y_off + a + h * d + j] = o * r * prm[pc.norm + j] * g;
        }
        // qs and ks are rewritten by the next token.
        barrier();
    }
}
