#version 450
// MoE router after its matvec, one workgroup: softmax over the expert
// logits (in place, and in shared memory), top-k by probability (ties to
// the lower expert id; ranks within groups of experts, then among the
// groups' picks), weights renormalised over the chosen k. Writes ids (as float bits) and
// weights. With `shared_in_arena` the shared expert follows as expert k:
// id n_experts (its slot-table entry), weight sigmoid(shared_gate . x).
// Workgroup y-index t is the pass's token t (activations t * tok_stride further).
#define WG 256
#define MAX_K 64
#define MAX_EXPERTS 1024
#include "common.glsl"

layout(push_constant) uniform Push {
    uint logits_off;
    uint ids_off;
    uint w_off;
    uint n_experts;
    uint k;
    uint shared_in_arena;
    uint x_off;        // [h] MoE input
    uint shared_gate;  // params [h]
    uint h;
    uint tok_stride;
} pc;

shared float prob[MAX_EXPERTS];
shared float chosen[MAX_K];
// Experts are ranked first within groups of GROUP (see below), each group's
// k best kept as candidates.
#define GROUP 32u
#define GROUPS (WG / GROUP)
shared float cand_v[GROUPS * MAX_K];
shared uint cand_i[GROUPS * MAX_K];

void main() {
    uint t = gl_LocalInvocationIndex, n = pc.n_experts, a = gl_WorkGroupID.y * pc.tok_stride, l = pc.logits_off + a;
    float m = -1.0 / 0.0;
    for (uint i = t; i < n; i += WG) m = max(m, s[l + i]);
    m = wg_max(m);
    float sum = 0.0;
    for (uint i = t; i < n; i += WG) {
        float e = exp(s[l + i] - m);
        prob[i] = e;
        sum += e;
    }
    sum = wg_sum(sum);
    for (uint i = t; i < n; i += WG) {
        prob[i] /= sum;
        s[l + i] = prob[i];
    }
    barrier();
    // Empty candidate slots (a group with fewer than k experts) lose to every expert.
    uint nc = GROUPS * pc.k;
    for (uint c = t; c < nc; c += WG) {
        cand_v[c] = -2.0;
        cand_i[c] = 0xffffffffu;
    }
    barrier();
    // Top-k in two stages of ranks, each expert's rank the count of those
    // before it: probability descending, then expert id ascending (a tie
    // keeps the lower id, as the CPU), so ranks are distinct. First within
    // each of GROUPS groups of experts (expert i in group (i mod WG) / GROUP),
    // whose k first become the group's candidates in rank order; then among
    // all candidates, whose k first are the choice. Every global top-k
    // expert is among its group's top-k, so the two stages choose what one
    // would. No loop over k: the comparisons run side by side.
    for (uint i = t; i < n; i += WG) {
        float v = prob[i];
        uint g = (i % WG) / GROUP, rank = 0u;
        for (uint m = 0u; m * WG < n; m++) {
            for (uint l = 0u; l < GROUP; l++) {
                uint o = m * WG + g * GROUP + l;
                if (o < n) {
                    float u = prob[o];
                    rank += (u > v || (u == v && o < i)) ? 1u : 0u;
                }
            }
        }
        if (rank < pc.k) {
            cand_v[g * pc.k + rank] = v;
            cand_i[g * pc.k + rank] = i;
        }
    }
    barrier();
    for (uint c = t; c < nc; c += WG) {
        float v = cand_v[c];
        uint i = cand_i[c], rank = 0u;
        for (uint o = 0u; o < nc; o++) {
            float u = cand_v[o];
            uint j = cand_i[o];
            rank += (u > v || (u == v && j < i)) ? 1u : 0u;
        }
        if (rank < pc.k) {
            chosen[rank] = v;
            s[pc.ids_off + a + rank] = uintBitsToFloat(i);
        }
    }
    barrier();
    if (pc.shared_in_arena == 1u) {
        float g = 0.0;
        for (uint i = t; i < pc.h; i += WG) g += prm[pc.shared_gate + i] * s[pc.x_off + a + i];
        g = wg_sum(g);
        if (t == 0u) {
            s[pc.ids_off + a + pc.k] = uintBitsToFloat(pc.n_experts);
            s[pc.w_off + a + pc.k] = sigmoid(g);
        }
    }
    if (t != 0u) return;
    float total = 0.0;
    for (uint r = 0u; r < pc.k; r++) total += chosen[r];
    for (uint r = 0u; r < pc.k; r++) s[pc.w_off + a + r] = chosen[r] / total;
}
