#version 450
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_shuffle : require
// Gated DeltaNet delta rule for the `n` tokens of a pass one after another
// (its gated RMSNorm is shaders/gdn_norm.comp's, one dispatch over the
// pass's tokens after this one). Workgroup (h, y) takes COLS = 128 / LANES
// columns of value head h's [dk][dv] state, from column COLS y on; column j
// belongs to the LANES invocations LANES j' .. LANES j' + LANES - 1
// (adjacent lanes of a subgroup, j' = j - COLS y), each holding PER =
// 128 / LANES of its rows in registers from the first token to the last;
// their partial sums meet by shuffles. Head dims up to 128, a multiple of 4.
//
// Nothing waits at a workgroup barrier, so the heads' columns spread over
// every SM and a token costs the chain of its own arithmetic: each
// subgroup sums a token's q and k squares itself (its invocations read the
// head's q and k, four values at a time; subgroupAdd), a token ahead, and each
// invocation reads its rows of q and k. LANES is specialization constant 5
// (the host sets it: src/vulkan/pipelines.rs). The state is read from the
// plane of position `pos` and the state after each of the last `planes`
// tokens written to its position's plane (one per position of the rewind
// window; see src/model/backend.rs): the earlier ones would be overwritten
// by later tokens of the pass. The output `o` is written unnormalised.
//
// TOKEN (module gdn_token): one token's whole mixer after its input
// projections in one dispatch, with the three stages' bits. Each workgroup
// computes the conv outputs it reads itself (gdn.glsl's gdn_conv_at, from
// the projection and the ring: its key head's q and k once into shared
// memory, its columns' v), and the token's ring row is written by the
// workgroups that own its channels (q and k of key head h by workgroup
// (h, 0), h < nk; v of a column by the column's first lane): the conv
// reads only earlier rows. After the delta rule each workgroup writes its
// columns' o through a coherent view of the scratch and counts its arrival
// in head h's counter; the last of the head's workgroups applies the gated
// norm (gdn.glsl's gdn_gated_norm, gdn_norm.comp's) to the head in place
// and zeroes the counter.
#define WG 128
#include "common.glsl"
#include "gdn.glsl"
layout(constant_id = 5) const uint LANES = 4u;
#define PER (128u / LANES)
#define COLS (WG / LANES)

#ifndef TOKEN
layout(push_constant) uniform Push {
    uint conv_off;   // [2*nk*d + nv*d] conv output: q | k | v (token 0's; tok_stride apart; multiples of 4)
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
} pc;

#define N pc.n
#define TOK_STRIDE pc.tok_stride
#else
layout(push_constant) uniform Push {
    uint x_off;      // [Dc] the input projection q | k | v, before the conv
    uint taps;       // params [Dc][Kc], the conv's
    uint dc;
    uint kc;
    uint rows;       // conv ring rows (>= Kc), at the layer state's start
    uint b_off;      // [nv]
    uint a_off;      // [nv]
    uint y_off;      // [nv*d]
    uint z_off;      // [nv*d] the gates
    uint nk;
    uint nv;
    uint d;
    uint planes_off; // layer-state offset of plane 0 of the [planes][nv][d][d] states
    uint planes;     // planes (the rewind window + 1)
    uint pos;        // the token's position
    uint decay_a;    // params: -exp(A_log) [nv]
    uint dt_bias;    // params [nv]
    uint norm;       // params [d]
    uint gate_silu;  // 1 = SiLU gate, 0 = sigmoid
    float eps;
    uint counts_off; // scratch offset of nv arrival counters (zero before and after)
} pc;
#define N 1u
#define TOK_STRIDE 0u
#endif

layout(set = 0, binding = 0) readonly buffer ScratchVec4 { vec4 s4[]; };

// A token's inputs: this invocation's PER rows of q and k, its share of
// the subgroup's sums of q and k squares over the head, the column's v, the
// head's decay and beta logits.
struct Inputs {
    vec4 q[16], k[16];  // PER / 4 of them used (LANES >= 2)
    vec2 sq;
    float v, a, b;
};

#ifdef TOKEN
// Channel c of the conv's output (q | k | v), from the projection and the ring.
float conv(uint c) { return gdn_conv_at(pc.x_off, 0u, 0u, pc.pos, c, pc.dc, pc.kc, pc.rows, pc.taps); }
// The key head's q | k after the conv, computed once by the workgroup.
shared float qk[256];
vec4 in4(uint tb, uint c) { return vec4(qk[c], qk[c + 1u], qk[c + 2u], qk[c + 3u]); }
float in1(uint tb, uint c) { return conv(c); }
#define QA(kh) 0u
#define KA(kh) d
// The o of every column and the heads' counters, seen across workgroups.
layout(set = 0, binding = 0) coherent buffer ScratchC { float sc[]; };
layout(set = 0, binding = 0) coherent buffer Counts { uint sn[]; };
shared bool head_last;
#else
vec4 in4(uint tb, uint c) { return s4[(pc.conv_off + tb + c) >> 2]; }
float in1(uint tb, uint c) { return s[pc.conv_off + tb + c]; }
#define QA(kh) (kh * d)
#define KA(kh) (pc.nk * d + kh * d)
#endif

Inputs load(uint t, uint h, uint kh, uint j, uint i0, bool on) {
    Inputs x;
    uint tb = min(t, N - 1u) * TOK_STRIDE, d = pc.d;
    uint qa = QA(kh), ka = KA(kh);
    [[unroll]] for (uint i = 0u; i < PER / 4u; i++) {
        bool in_d = i0 + 4u * i < d;
        x.q[i] = in_d ? in4(tb, qa + i0 + 4u * i) : vec4(0.0);
        x.k[i] = in_d ? in4(tb, ka + i0 + 4u * i) : vec4(0.0);
    }
    x.sq = vec2(0.0);
    for (uint l = 4u * gl_SubgroupInvocationID; l < d; l += 4u * gl_SubgroupSize) {
        vec4 q = in4(tb, qa + l), k = in4(tb, ka + l);
        x.sq += vec2(dot(q, q), dot(k, k));
    }
    x.v = on ? in1(tb, 2u * pc.nk * d + h * d + j) : 0.0;
    x.a = s[pc.a_off + tb + h];
    x.b = s[pc.b_off + tb + h];
    return x;
}

void main() {
    uint h = gl_WorkGroupID.x, lid = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID, d = pc.d;
    uint j = gl_WorkGroupID.y * COLS + lid / LANES, i0 = (lid % LANES) * PER;
    bool on = j < d, first = lid % LANES == 0u;
    uint kh = h % pc.nk;
    uint plane = d * d * pc.nv;
    uint col = h * d * d + min(j, d - 1u);
    float S[64];  // PER of them used
    uint from = pc.planes_off + (pc.pos % pc.planes) * plane + col;
    [[unroll]] for (uint i = 0u; i < PER; i++) S[i] = on && i0 + i < d ? st[from + (i0 + i) * d] : 0.0;
    float qscale = 1.0 / sqrt(float(d));
    float decay_a = prm[pc.decay_a + h], dt_bias = prm[pc.dt_bias + h];
#ifdef TOKEN
    for (uint c = lid; c < 2u * d; c += WG) qk[c] = conv(c < d ? kh * d + c : pc.nk * d + kh * d + c - d);
    barrier();
#endif
    Inputs x = load(0u, h, kh, j, i0, on);
    vec2 sums = subgroupAdd(x.sq);
    for (uint t = 0u; t < N; t++) {
#ifdef TOKEN
        Inputs next = x;
#else
        Inputs next = load(t + 1u, h, kh, j, i0, on);
#endif
        float rq = 1.0 / sqrt(sums.x + 1e-6);
        float rk = 1.0 / sqrt(sums.y + 1e-6);
        float decay = exp(decay_a * softplus(x.a + dt_bias));
        float beta = sigmoid(x.b);
        // This column's rows of S k (the state decayed first), in four chains.
        // (Every multiply-add is an explicit fma: the pass's module and one
        // token's compile to the same roundings.)
        vec4 mem4 = vec4(0.0);
        [[unroll]] for (uint i = 0u; i < PER / 4u; i++) {
            vec4 sd = vec4(S[4u * i], S[4u * i + 1u], S[4u * i + 2u], S[4u * i + 3u]) * decay;
            mem4 = fma(sd, x.k[i] * rk, mem4);
        }
        float mem = (mem4.x + mem4.y) + (mem4.z + mem4.w);
        [[unroll]] for (uint o = 1u; o < LANES; o <<= 1) mem += subgroupShuffleXor(mem, o);
        float delta = (x.v - mem) * beta;
        vec4 o4 = vec4(0.0);
        [[unroll]] for (uint i = 0u; i < PER / 4u; i++) {
            vec4 kn = x.k[i] * rk, qn = x.q[i] * rq * qscale;
            [[unroll]] for (uint e = 0u; e < 4u; e++) {
                S[4u * i + e] = fma(kn[e], delta, S[4u * i + e] * decay);
                o4[e] = fma(S[4u * i + e], qn[e], o4[e]);
            }
        }
        float o = (o4.x + o4.y) + (o4.z + o4.w);
        [[unroll]] for (uint m = 1u; m < LANES; m <<= 1) o += subgroupShuffleXor(o, m);
        if (on && t + pc.planes >= N) {
            uint to = pc.planes_off + ((pc.pos + t + 1u) % pc.planes) * plane + col;
            [[unroll]] for (uint i = 0u; i < PER; i++) if (i0 + i < d) st[to + (i0 + i) * d] = S[i];
        }
#ifdef TOKEN
        if (on && first) sc[pc.y_off + h * d + j] = o;
#else
        if (on && first) s[pc.y_off + t * pc.tok_stride + h * d + j] = o;
#endif
        // The next token's sums of squares (its loads were issued above).
        sums = subgroupAdd(next.sq);
        x = next;
    }
#ifdef TOKEN
    // The token's ring row (the conv read only earlier rows).
    uint row = (pc.pos % pc.rows) * pc.dc;
    if (h < pc.nk && gl_WorkGroupID.y == 0u) {
        for (uint c = gl_LocalInvocationIndex; c < 2u * d; c += WG) {
            uint ch = c < d ? h * d + c : pc.nk * d + h * d + c - d;
            st[row + ch] = s[pc.x_off + ch];
        }
    }
    if (on && first) st[row + 2u * pc.nk * d + h * d + j] = s[pc.x_off + 2u * pc.nk * d + h * d + j];
    // The head's last workgroup to finish normalises it.
    memoryBarrierBuffer();
    barrier();
    if (gl_LocalInvocationIndex == 0u) {
        head_last = atomicAdd(sn[pc.counts_off + h], 1u) == gl_NumWorkGroups.y - 1u;
        if (head_last) sn[pc.counts_off + h] = 0u;
    }
    barrier();
    if (!head_last) return;
    memoryBarrierBuffer();
    uint v = gl_LocalInvocationIndex, a = pc.y_off + h * d + v;
    float o = v < d ? sc[a] : 0.0;
    float z = v < d ? s[pc.z_off + h * d + v] : 0.0;
    float y = gdn_gated_norm(o, z, v, d, pc.norm, pc.gate_silu, pc.eps);
    if (v < d) sc[a] = y;
#endif
}
