#version 450
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_shuffle : require
// Gated DeltaNet delta rule, then the gated RMSNorm, for the `n` tokens of a
// pass one after another. The value heads' columns are independent given
// the token's q, k, decay and beta (column j of a head's [dk][dv] state
// meets only v_j), so a head is cut into `parts` workgroups of d / parts
// columns each (workgroup x = head * parts + part): one token's state,
// 64 KB a head, is read and written by that many SMs instead of one. In a
// workgroup, invocation `lid` owns column lid % cw of the part (cw = d /
// parts) and rows lid / cw + m * ipc, which it keeps in registers from the
// first token to the last: ipc invocations per column, as many as the
// workgroup holds but no more than leave each 8 rows (fewer partial sums
// to meet); the ipc partial sums of a column meet in shared memory. A
// subgroup's lanes hold consecutive columns of one row, so every state
// load and store is a contiguous run. Head dims up to WG / 2.
//
// The gated RMSNorm needs the whole head's output. With one part the
// workgroup applies it per token; with several, each writes its columns'
// raw outputs and their sum of squares (ss_off: [tokens][nv][parts]), and
// the last of the head's workgroups to finish (an arrival counter per head
// at count_off, zero before the dispatch and reset to zero by that
// workgroup) normalises the head's outputs of every token (with q_off, one
// token's, also rounded for the out projection's fast kernels, as
// act_int8.comp would round them). The host cuts heads only for one token
// (the deferred norm is one workgroup's loop over the pass's tokens).
//
// The state is read from the plane of position `pos` and the state after
// each of the last `planes` tokens written to its position's plane (one per
// position of the rewind window; see src/model/backend.rs): the earlier
// ones would be overwritten by later tokens of the pass.
#define WG 256
// Rows an invocation holds at most: d <= WG / 2 rows, at least two invocations per column.
#define MAXR (WG / 4)
#include "common.glsl"
#include "act_int8.glsl"

// The scratch again, for what one workgroup writes and another reads (the
// deferred norm's inputs) and the arrival counters.
layout(set = 0, binding = 0) coherent buffer ScratchShared { float sc[]; };
layout(set = 0, binding = 0) coherent buffer ScratchCount { uint su[]; };

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
    uint parts;      // workgroups per head (a power of two dividing d)
    uint ss_off;     // parts > 1: [nv][parts] sums of squares per token (tok_stride apart)
    uint count_off;  // parts > 1: [nv] arrival counters (uint bits), zero before the dispatch
    uint q_off;      // parts > 1, one token, d a multiple of 32: the outputs also rounded
                     // to 8 bits here for the out projection (act_int8.glsl); 0: not
} pc;

shared float qs[WG / 2];
shared float ks[WG / 2];
// The columns' partial sums: of the memory read (mem), then of the output (out).
shared float part_mem[WG];
shared float part_out[WG];
shared vec2 red2[WG / 4];
shared uint arrival;

// wg_sum of two values at once (each summed in wg_sum's order).
vec2 wg_sum2(vec2 v) {
    vec2 p = subgroupAdd(v);
    if (subgroupElect()) red2[gl_SubgroupID] = p;
    barrier();
    vec2 r = vec2(0.0);
    for (uint i = 0u; i < gl_NumSubgroups; i++) r += red2[i];
    barrier();
    return r;
}

float gate(float z) { return pc.gate_silu == 1u ? silu(z) : sigmoid(z); }

void main() {
    uint d = pc.d, parts = pc.parts, cw = d / parts, ipc = min(WG / cw, max(d / 8u, 1u));
    uint h = gl_WorkGroupID.x / parts, p = gl_WorkGroupID.x % parts;
    uint lid = gl_LocalInvocationIndex, jj = lid % cw, sub = lid / cw;
    // Invocations past ipc * cw (cw not dividing WG) hold nothing.
    bool on = sub < ipc;
    uint j = p * cw + jj, rows = (d + ipc - 1u) / ipc;
    uint kh = h % pc.nk;
    uint plane = d * d * pc.nv;
    uint col = h * d * d + j;
    float S[MAXR];
    uint from = pc.planes_off + (pc.pos % pc.planes) * plane + col;
    [[unroll]] for (uint m = 0u; m < MAXR; m++) {
        uint i = sub + m * ipc;
        S[m] = m < rows && on && i < d ? st[from + i * d] : 0.0;
    }
    for (uint t = 0u; t < pc.n; t++) {
        uint a = t * pc.tok_stride;
        uint c = pc.conv_off + a;
        float q = lid < d ? s[c + kh * d + lid] : 0.0;
        float k = lid < d ? s[c + pc.nk * d + kh * d + lid] : 0.0;
        float v = on ? s[c + 2u * pc.nk * d + h * d + j] : 0.0;
        vec2 sq = wg_sum2(vec2(q * q, k * k));
        if (lid < d) {
            qs[lid] = q * (1.0 / sqrt(sq.x + 1e-6)) * (1.0 / sqrt(float(d)));
            ks[lid] = k * (1.0 / sqrt(sq.y + 1e-6));
        }
        barrier();
        float decay = exp(prm[pc.decay_a + h] * softplus(s[pc.a_off + a + h] + prm[pc.dt_bias + h]));
        float beta = sigmoid(s[pc.b_off + a + h]);
        float mem = 0.0;
        [[unroll]] for (uint m = 0u; m < MAXR; m++) {
            uint i = sub + m * ipc;
            if (m < rows && i < d) mem += (S[m] * decay) * ks[i];
        }
        part_mem[lid] = mem;
        barrier();
        mem = 0.0;
        for (uint u = 0u; u < ipc; u++) mem += part_mem[u * cw + jj];
        float delta = (v - mem) * beta;
        float o = 0.0;
        [[unroll]] for (uint m = 0u; m < MAXR; m++) {
            uint i = sub + m * ipc;
            if (m < rows && i < d) {
                S[m] = S[m] * decay + ks[i] * delta;
                o += S[m] * qs[i];
            }
        }
        part_out[lid] = o;
        barrier();
        // Invocations lid < cw (sub 0) hold the part's columns' outputs.
        o = 0.0;
        if (sub == 0u) for (uint u = 0u; u < ipc; u++) o += part_out[u * cw + jj];
        if (on && t + pc.planes >= pc.n) {
            uint to = pc.planes_off + ((pc.pos + t + 1u) % pc.planes) * plane + col;
            [[unroll]] for (uint m = 0u; m < MAXR; m++) {
                uint i = sub + m * ipc;
                if (m < rows && i < d) st[to + i * d] = S[m];
            }
        }
        // Each column's output counts once in the norm. wg_sum's barriers
        // also order this token's reads of qs, ks, part_mem and part_out
        // before the next token's writes.
        float ss = wg_sum(sub == 0u ? o * o : 0.0);
        uint y = pc.y_off + a + h * d + j;
        if (parts == 1u) {
            if (sub == 0u) s[y] = o * rms_scale(ss, d, pc.eps) * prm[pc.norm + j] * gate(s[pc.z_off + a + h * d + j]);
        } else {
            if (sub == 0u) sc[y] = o;
            if (lid == 0u) sc[pc.ss_off + a + h * parts + p] = ss;
        }
    }
    if (parts == 1u) return;
    // The last of the head's workgroups to get here normalises its outputs.
    memoryBarrierBuffer();
    barrier();
    if (lid == 0u) arrival = atomicAdd(su[pc.count_off + h], 1u);
    barrier();
    if (arrival != parts - 1u) return;
    memoryBarrierBuffer();
    if (lid == 0u) su[pc.count_off + h] = 0u;
    if (pc.q_off != 0u) {
        // One token: eight columns per invocation, numbered by subgroup so a
        // block's four share one, each block rounded from the floats written.
        float ss = 0.0;
        for (uint q = 0u; q < parts; q++) ss += sc[pc.ss_off + h * parts + q];
        float r = rms_scale(ss, d, pc.eps);
        uint t8 = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;
        bool live = t8 < d / 8u;
        uint j0 = 8u * min(t8, d / 8u - 1u);
        vec4 v[2];
        [[unroll]] for (uint hv = 0u; hv < 2u; hv++) {
            [[unroll]] for (uint e = 0u; e < 4u; e++) {
                uint jx = j0 + 4u * hv + e, y = pc.y_off + h * d + jx;
                float o = sc[y] * r * prm[pc.norm + jx] * gate(s[pc.z_off + h * d + jx]);
                if (live) sc[y] = o;
                v[hv][e] = live ? o : 0.0;
            }
        }
        uint w0, w1;
        int sum;
        float dq;
        round_block(v[0], v[1], w0, w1, sum, dq);
        if (live) {
            uint col = h * d + j0, b = col >> 5, quarter = t8 & 3u;
            uint e = 2u * b + (quarter >> 1), w = 2u * (quarter & 1u);
            s[pc.q_off + 4u * e + w] = uintBitsToFloat(w0);
            s[pc.q_off + 4u * e + w + 1u] = uintBitsToFloat(w1);
            if ((quarter & 1u) == 0u) s[pc.q_off + XQ_S + e] = intBitsToFloat(sum);
            if (quarter == 0u) s[pc.q_off + XQ_D + b] = dq;
        }
        return;
    }
    for (uint t = 0u; t < pc.n; t++) {
        uint a = t * pc.tok_stride;
        float ss = 0.0;
        for (uint q = 0u; q < parts; q++) ss += sc[pc.ss_off + a + h * parts + q];
        float r = rms_scale(ss, d, pc.eps);
        for (uint jx = lid; jx < d; jx += WG) {
            uint y = pc.y_off + a + h * d + jx;
            sc[y] = sc[y] * r * prm[pc.norm + jx] * gate(s[pc.z_off + a + h * d + jx]);
        }
    }
}
