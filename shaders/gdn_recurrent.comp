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
#define WG 128
#include "common.glsl"
layout(constant_id = 5) const uint LANES = 4u;
#define PER (128u / LANES)
#define COLS (WG / LANES)

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

layout(set = 0, binding = 0) readonly buffer ScratchVec4 { vec4 s4[]; };

// A token's inputs: this invocation's PER rows of q and k, its share of
// the subgroup's sums of q and k squares over the head, the column's v, the
// head's decay and beta logits.
struct Inputs {
    vec4 q[16], k[16];  // PER / 4 of them used (LANES >= 2)
    vec2 sq;
    float v, a, b;
};

vec4 at4(uint i) { return s4[i >> 2]; }

Inputs load(uint t, uint h, uint kh, uint j, uint i0, bool on) {
    Inputs x;
    uint tb = min(t, pc.n - 1u) * pc.tok_stride, d = pc.d;
    uint c = pc.conv_off + tb, qa = c + kh * d, ka = c + pc.nk * d + kh * d;
    [[unroll]] for (uint i = 0u; i < PER / 4u; i++) {
        bool in_d = i0 + 4u * i < d;
        x.q[i] = in_d ? at4(qa + i0 + 4u * i) : vec4(0.0);
        x.k[i] = in_d ? at4(ka + i0 + 4u * i) : vec4(0.0);
    }
    x.sq = vec2(0.0);
    for (uint l = 4u * gl_SubgroupInvocationID; l < d; l += 4u * gl_SubgroupSize) {
        vec4 q = at4(qa + l), k = at4(ka + l);
        x.sq += vec2(dot(q, q), dot(k, k));
    }
    x.v = on ? s[c + 2u * pc.nk * d + h * d + j] : 0.0;
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
    Inputs x = load(0u, h, kh, j, i0, on);
    vec2 sums = subgroupAdd(x.sq);
    for (uint t = 0u; t < pc.n; t++) {
        Inputs next = load(t + 1u, h, kh, j, i0, on);
        float rq = 1.0 / sqrt(sums.x + 1e-6);
        float rk = 1.0 / sqrt(sums.y + 1e-6);
        float decay = exp(decay_a * softplus(x.a + dt_bias));
        float beta = sigmoid(x.b);
        // This column's rows of S k (the state decayed first), in four chains.
        vec4 mem4 = vec4(0.0);
        [[unroll]] for (uint i = 0u; i < PER / 4u; i++) {
            vec4 sd = vec4(S[4u * i], S[4u * i + 1u], S[4u * i + 2u], S[4u * i + 3u]) * decay;
            mem4 += sd * (x.k[i] * rk);
        }
        float mem = (mem4.x + mem4.y) + (mem4.z + mem4.w);
        [[unroll]] for (uint o = 1u; o < LANES; o <<= 1) mem += subgroupShuffleXor(mem, o);
        float delta = (x.v - mem) * beta;
        vec4 o4 = vec4(0.0);
        [[unroll]] for (uint i = 0u; i < PER / 4u; i++) {
            vec4 kn = x.k[i] * rk, qn = x.q[i] * rq * qscale;
            [[unroll]] for (uint e = 0u; e < 4u; e++) {
                S[4u * i + e] = S[4u * i + e] * decay + kn[e] * delta;
                o4[e] += S[4u * i + e] * qn[e];
            }
        }
        float o = (o4.x + o4.y) + (o4.z + o4.w);
        [[unroll]] for (uint m = 1u; m < LANES; m <<= 1) o += subgroupShuffleXor(o, m);
        if (on && t + pc.planes >= pc.n) {
            uint to = pc.planes_off + ((pc.pos + t + 1u) % pc.planes) * plane + col;
            [[unroll]] for (uint i = 0u; i < PER; i++) if (i0 + i < d) st[to + (i0 + i) * d] = S[i];
        }
        if (on && first) s[pc.y_off + t * pc.tok_stride + h * d + j] = o;
        // The next token's sums of squares (its loads were issued above).
        sums = subgroupAdd(next.sq);
        x = next;
    }
}
