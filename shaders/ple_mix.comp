#version 450
// The PLE injection after its key/value projections (see src/cpu/ple.rs):
// per stream the gated value, its norm, the dilated depthwise conv over the
// history (a ring of `rows` rows by position in the layer state), the
// residual update and the token's row of the ring. One workgroup per stream
// (the streams share nothing but the value vector); each invocation owns the
// same elements in every loop.
//
// `phase` 3: one token, all of it (n = 1). A run of `n` tokens (workgroup
// y: token y, offsets `tok_stride` floats apart from the first's, position
// pos + y) takes three dispatches, each token's values computed as alone:
//   0  the gated value into tmp, its norm over the key (which only this
//      phase reads);
//   1  the conv, its taps from the run's norms where they lie in the run and
//      from the ring before it, and the residual update;
//   2  the ring rows of the run's last `rows` tokens (workgroup y: token
//      n - min(n, rows) + y).
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
    uint pos;         // (the run's first token's)
    float eps;
    uint phase;
    uint n;
    uint tok_stride;
} pc;

void main() {
    uint h = pc.h, ch = h * pc.streams, kp = pc.kernel, rows = pc.rows;
    uint c = gl_WorkGroupID.x, b = c * h;
    // One token (phase 3) runs the three phases' code in turn, so that it
    // computes what a run computes, operation for operation.
    bool one = pc.phase == 3u;
    if (one || pc.phase == 0u) {
        uint tok = gl_WorkGroupID.y * pc.tok_stride;
        float kss = 0.0, qss = 0.0;
        for (uint i = gl_LocalInvocationIndex; i < h; i += WG) {
            float kv = s[pc.key_off + tok + b + i], qv = s[pc.res_off + tok + b + i];
            kss += kv * kv;
            qss += qv * qv;
        }
        float rk = rms_scale(wg_sum(kss), h, pc.eps), rq = rms_scale(wg_sum(qss), h, pc.eps);
        float dot = 0.0;
        for (uint i = gl_LocalInvocationIndex; i < h; i += WG)
            dot += (s[pc.key_off + tok + b + i] * rk * prm[pc.norm_key + b + i]) * (s[pc.res_off + tok + b + i] * rq * prm[pc.norm_query + b + i]);
        float score = wg_sum(dot) / sqrt(float(h));
        float signed_sqrt = score == 0.0 ? 0.0 : sign(score) * sqrt(max(abs(score), 1e-6));
        float gate = sigmoid(signed_sqrt);
        float gss = 0.0;
        for (uint i = gl_LocalInvocationIndex; i < h; i += WG) {
            float g = gate * s[pc.value_off + tok + i];
            s[pc.tmp_off + tok + b + i] = g;
            gss += g * g;
        }
        float rg = rms_scale(wg_sum(gss), h, pc.eps);
        // (Each invocation overwrites only the key elements it read above.)
        for (uint i = gl_LocalInvocationIndex; i < h; i += WG) {
            uint e = b + i;
            s[pc.key_off + tok + e] = s[pc.tmp_off + tok + e] * rg * prm[pc.norm_conv + e];
        }
    }
    if (one || pc.phase == 1u) {
        uint y = gl_WorkGroupID.y, tok = y * pc.tok_stride, pos = pc.pos + y;
        for (uint i = gl_LocalInvocationIndex; i < h; i += WG) {
            uint e = b + i;
            float acc = prm[pc.conv + e * kp + kp - 1u] * s[pc.key_off + tok + e];
            // Tap k reads the norm (kp-1-k)*dilation positions back: in the
            // run from its first token on, in the ring before.
            for (uint k = 0u; k + 1u < kp; k++) {
                uint back = (kp - 1u - k) * pc.dilation;
                float tap = back <= y ? s[pc.key_off + (y - back) * pc.tok_stride + e] : st[((pos + rows - back) % rows) * ch + e];
                acc += prm[pc.conv + e * kp + k] * tap;
            }
            s[pc.res_off + tok + e] += s[pc.tmp_off + tok + e] + silu(acc);
        }
    }
    if (one || pc.phase == 2u) {
        // (One token: its ring row is none of the rows its taps read.)
        uint y = pc.n - min(pc.n, rows) + gl_WorkGroupID.y, tok = y * pc.tok_stride;
        for (uint i = gl_LocalInvocationIndex; i < h; i += WG) st[((pc.pos + y) % rows) * ch + b + i] = s[pc.key_off + tok + b + i];
    }
}
