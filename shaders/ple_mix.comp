#version 450
// The PLE injection after its key/value projections (see src/cpu/ple.rs):
// per stream the gated value, its norm, the dilated depthwise conv over the
// history (a ring of `rows` rows by position in the layer state), the
// residual update and this token's row of the ring. One
// workgroup per stream (the streams share nothing but the value vector);
// each invocation owns the same elements in every pass.
#define WG 256
#include "common.glsl"

layout(push_constant) uniform Push {
    uint key_off;     // [C*H]
    uint value_off;   // [H]
    uint res_off;     // [C*H]
    uint tmp_off;     // [C*H] gated values
    uint norm_key;
    uint norm_query;
    uint norm_conv;
    uint conv;        // [C*H][Kp]
    uint h;
    uint streams;
    uint kernel;
    uint dilation;
    uint rows;        // ring rows (>= (kernel-1)*dilation + 1)
    uint pos;
    float eps;
} pc;

void main() {
    uint h = pc.h, ch = h * pc.streams, kp = pc.kernel, rows = pc.rows;
    {
        uint c = gl_WorkGroupID.x, b = c * h;
        float kss = 0.0, qss = 0.0;
        for (uint i = gl_LocalInvocationIndex; i < h; i += WG) {
            float kv = s[pc.key_off + b + i], qv = s[pc.res_off + b + i];
            kss += kv * kv;
            qss += qv * qv;
        }
        float rk = rms_scale(wg_sum(kss), h, pc.eps), rq = rms_scale(wg_sum(qss), h, pc.eps);
        float dot = 0.0;
        for (uint i = gl_LocalInvocationIndex; i < h; i += WG)
            dot += (s[pc.key_off + b + i] * rk * prm[pc.norm_key + b + i]) * (s[pc.res_off + b + i] * rq * prm[pc.norm_query + b + i]);
        float score = wg_sum(dot) / sqrt(float(h));
        float signed_sqrt = score == 0.0 ? 0.0 : sign(score) * sqrt(max(abs(score), 1e-6));
        float gate = sigmoid(signed_sqrt);
        float gss = 0.0;
        for (uint i = gl_LocalInvocationIndex; i < h; i += WG) {
            float g = gate * s[pc.value_off + i];
            s[pc.tmp_off + b + i] = g;
            gss += g * g;
        }
        float rg = rms_scale(wg_sum(gss), h, pc.eps);
        for (uint i = gl_LocalInvocationIndex; i < h; i += WG) {
            uint e = b + i;
            float gated = s[pc.tmp_off + e];
            float normed = gated * rg * prm[pc.norm_conv + e];
            float acc = prm[pc.conv + e * kp + kp - 1u] * normed;
            // Tap k reads the input (kp-1-k)*dilation positions back.
            for (uint k = 0u; k + 1u < kp; k++) {
                uint row = (pc.pos + rows - (kp - 1u - k) * pc.dilation) % rows;
                acc += prm[pc.conv + e * kp + k] * st[row * ch + e];
            }
            s[pc.res_off + e] += gated + silu(acc);
            st[(pc.pos % rows) * ch + e] = normed;
        }
    }
}
