#version 450
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_shuffle : require
// Gated DeltaNet delta rule for one value head per workgroup, then the gated
// RMSNorm, for the `n` tokens of a pass one after another. Column j of the
// head's [dk][dv] state belongs to the LANES invocations LANES j .. LANES j +
// LANES - 1 (adjacent lanes of a subgroup), each holding PER = 128 / LANES
// of its rows in registers from the first token to the last; their partial
// sums meet by shuffles (lane pairs, then pairs of pairs). Head dims up to
// 128. LANES is specialization constant 5 and the workgroup 128 LANES
// invocations (constant 6; the host sets both: src/vulkan/pipelines.rs,
// 4 on a GPU that allows 512 invocations, else 2): one column per
// invocation pair leaves most of a token's time to each invocation's serial
// work (measured on an H100: 20-23 us per head set with 2, 14-15 with 4,
// 16 with 8). The state is read from the plane of position `pos` and the
// state after each of the last `planes` tokens written to its position's
// plane (one per position of the rewind window; see src/model/backend.rs):
// the earlier ones would be overwritten by later tokens of the pass. A token
// waits at three barriers (its norms' sums, its q and k shared, its
// output's sum) and its inputs were loaded while the token before ran.
#define WG 512
#include "common.glsl"
layout(local_size_x_id = 6) in;
layout(constant_id = 5) const uint LANES = 4u;
#define PER (128u / LANES)

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

// The scaled, normed q and k of a token, two buffers by token parity: a
// token writes one while the invocations still behind read the other's.
shared float qs[2][128];
shared float ks[2][128];
// Slots of the two reductions per token that need no second barrier (each
// slot is rewritten only after barriers that every reader of it passes
// first).
shared vec2 red_qk[WG / 4];
shared float red_o[WG / 4];

// A token's inputs, loaded a token ahead: q, k and v of this column, the
// decay and beta logits of the head, the gate's input.
struct Inputs { float q, k, v, a, b, z; };

Inputs load(uint t, uint h, uint kh, uint j, bool on, bool first) {
    Inputs x = Inputs(0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    if (t >= pc.n) return x;
    uint a = t * pc.tok_stride, c = pc.conv_off + a, d = pc.d;
    if (on) {
        x.q = s[c + kh * d + j];
        x.k = s[c + pc.nk * d + kh * d + j];
        x.v = s[c + 2u * pc.nk * d + h * d + j];
        if (first) x.z = s[pc.z_off + a + h * d + j];
    }
    x.a = s[pc.a_off + a + h];
    x.b = s[pc.b_off + a + h];
    return x;
}

void main() {
    uint h = gl_WorkGroupID.x, lid = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID, d = pc.d;
    uint j = lid / LANES, i0 = (lid % LANES) * PER;
    bool on = j < d, first = lid % LANES == 0u;
    uint kh = h % pc.nk;
    uint plane = d * d * pc.nv;
    uint col = h * d * d + j;
    float S[64];  // PER of them used (LANES >= 2)
    uint from = pc.planes_off + (pc.pos % pc.planes) * plane + col;
    [[unroll]] for (uint i = 0u; i < PER; i++) S[i] = on && i0 + i < d ? st[from + (i0 + i) * d] : 0.0;
    Inputs x = load(0u, h, kh, j, on, first);
    for (uint t = 0u; t < pc.n; t++) {
        Inputs next = load(t + 1u, h, kh, j, on, first);
        uint a = t * pc.tok_stride, buf = t & 1u;
        // Each column's values count once in the norms.
        vec2 sq = subgroupAdd(first ? vec2(x.q * x.q, x.k * x.k) : vec2(0.0));
        if (subgroupElect()) red_qk[gl_SubgroupID] = sq;
        barrier();
        vec2 sums = vec2(0.0);
        for (uint i = 0u; i < gl_NumSubgroups; i++) sums += red_qk[i];
        float rq = 1.0 / sqrt(sums.x + 1e-6);
        float rk = 1.0 / sqrt(sums.y + 1e-6);
        if (first) {
            qs[buf][j] = x.q * rq * (1.0 / sqrt(float(d)));
            ks[buf][j] = x.k * rk;
        }
        barrier();
        float decay = exp(prm[pc.decay_a + h] * softplus(x.a + prm[pc.dt_bias + h]));
        float beta = sigmoid(x.b);
        float mem = 0.0;
        [[unroll]] for (uint i = 0u; i < PER; i++) if (i0 + i < d) mem += (S[i] * decay) * ks[buf][i0 + i];
        [[unroll]] for (uint o = 1u; o < LANES; o <<= 1) mem += subgroupShuffleXor(mem, o);
        float delta = (x.v - mem) * beta;
        float o = 0.0;
        [[unroll]] for (uint i = 0u; i < PER; i++) {
            if (i0 + i < d) {
                S[i] = S[i] * decay + ks[buf][i0 + i] * delta;
                o += S[i] * qs[buf][i0 + i];
            }
        }
        [[unroll]] for (uint m = 1u; m < LANES; m <<= 1) o += subgroupShuffleXor(o, m);
        if (on && t + pc.planes >= pc.n) {
            uint to = pc.planes_off + ((pc.pos + t + 1u) % pc.planes) * plane + col;
            [[unroll]] for (uint i = 0u; i < PER; i++) if (i0 + i < d) st[to + (i0 + i) * d] = S[i];
        }
        float so = subgroupAdd(first ? o * o : 0.0);
        if (subgroupElect()) red_o[gl_SubgroupID] = so;
        barrier();
        float sum_o = 0.0;
        for (uint i = 0u; i < gl_NumSubgroups; i++) sum_o += red_o[i];
        float r = rms_scale(sum_o, d, pc.eps);
        if (on && first) {
            float g = pc.gate_silu == 1u ? silu(x.z) : sigmoid(x.z);
            s[pc.y_off + a + h * d + j] = o * r * prm[pc.norm + j] * g;
        }
        x = next;
    }
}
