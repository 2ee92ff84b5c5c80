#version 450
// Gated DeltaNet delta rule for one value head per workgroup, then the gated
// RMSNorm. Invocation j owns column j of the head's [dk][dv] state, so the
// state update needs no reduction. Head dims up to WG. The state is read
// from one plane and written to another (one per position of the rewind
// window; see src/model/backend.rs).
#define WG 128
#include "common.glsl"

layout(push_constant) uniform Push {
    uint conv_off;  // [2*nk*d + nv*d] conv output: q | k | v
    uint z_off;     // [nv*d]
    uint b_off;     // [nv]
    uint a_off;     // [nv]
    uint y_off;     // [nv*d]
    uint nk;
    uint nv;
    uint d;
    uint rec_in;    // layer-state offset of the [nv][d][d] state before this token
    uint rec_out;   // ... and of the plane it writes
    uint decay_a;   // params: -exp(A_log) [nv]
    uint dt_bias;   // params [nv]
    uint norm;      // params [d]
    uint gate_silu; // 1 = SiLU gate, 0 = sigmoid
    float eps;
} pc;

shared float qs[WG];
shared float ks[WG];

void main() {
    uint h = gl_WorkGroupID.x, j = gl_LocalInvocationIndex, d = pc.d;
    uint kh = h % pc.nk;
    bool on = j < d;
    float q = on ? s[pc.conv_off + kh * d + j] : 0.0;
    float k = on ? s[pc.conv_off + pc.nk * d + kh * d + j] : 0.0;
    float v = on ? s[pc.conv_off + 2u * pc.nk * d + h * d + j] : 0.0;
    float rq = 1.0 / sqrt(wg_sum(q * q) + 1e-6);
    float rk = 1.0 / sqrt(wg_sum(k * k) + 1e-6);
    qs[j] = q * rq * (1.0 / sqrt(float(d)));
    ks[j] = k * rk;
    barrier();
    float decay = exp(prm[pc.decay_a + h] * softplus(s[pc.a_off + h] + prm[pc.dt_bias + h]));
    float beta = sigmoid(s[pc.b_off + h]);
    uint from = pc.rec_in + h * d * d + j, to = pc.rec_out + h * d * d + j;
    float o = 0.0;
    if (on) {
        float mem = 0.0;
        for (uint i = 0u; i < d; i++) mem += (st[from + i * d] * decay) * ks[i];
        float delta = (v - mem) * beta;
        for (uint i = 0u; i < d; i++) {
            float x = st[from + i * d] * decay + ks[i] * delta;
            st[to + i * d] = x;
            o += x * qs[i];
        }
    }
    float r = rms_scale(wg_sum(o * o), d, pc.eps);
    if (!on) return;
    float z = s[pc.z_off + h * d + j];
    float g = pc.gate_silu == 1u ? silu(z) : sigmoid(z);
    s[pc.y_off + h * d + j] = o * r * prm[pc.norm + j] * g;
}
