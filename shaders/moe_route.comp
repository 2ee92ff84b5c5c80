#version 450
#extension GL_EXT_control_flow_attributes : require
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
#define UN 8u
#include "common.glsl"
#include "dot_ahead.glsl"

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

// Stage two's ranks: each candidate's count split over RP invocations
// (integer sums, so any order), added here.
shared uint cand_rank[GROUPS * MAX_K];

void main() {
    uint t = gl_LocalInvocationIndex, n = pc.n_experts, a = gl_WorkGroupID.y * pc.tok_stride, l = pc.logits_off + a;
    // The shared expert's gate first (its loads need nothing of the logits).
    float gate = pc.shared_in_arena == 1u ? dot_prm_ahead(pc.shared_gate, pc.x_off + a, pc.h, t) : 0.0;
    // Each invocation's logits kept in registers (at most MAX_EXPERTS / WG).
    float lv[MAX_EXPERTS / WG];
    float m = -1.0 / 0.0;
    [[unroll]] for (uint j = 0u; j < MAX_EXPERTS / WG; j++) {
        uint i = t + j * WG;
        lv[j] = i < n ? s[l + i] : 0.0;
        if (i < n) m = max(m, lv[j]);
    }
    m = wg_max(m);
    float sum = 0.0;
    [[unroll]] for (uint j = 0u; j < MAX_EXPERTS / WG; j++) {
        uint i = t + j * WG;
        if (i < n) {
            float e = exp(lv[j] - m);
            prob[i] = e;
            sum += e;
        }
    }
    sum = wg_sum(sum);
    // Empty candidate slots (a group with fewer than k experts) lose to every expert.
    uint nc = GROUPS * pc.k;
    for (uint c = t; c < nc; c += WG) {
        cand_v[c] = -2.0;
        cand_i[c] = 0xffffffffu;
        cand_rank[c] = 0u;
    }
    [[unroll]] for (uint j = 0u; j < MAX_EXPERTS / WG; j++) {
        uint i = t + j * WG;
        if (i < n) {
            prob[i] /= sum;
            s[l + i] = prob[i];
        }
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
            [[unroll]] for (uint l = 0u; l < GROUP; l++) {
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
    // Stage two: RP invocations per candidate, each counting over a
    // contiguous share of the candidates.
    uint rp = max(WG / nc, 1u), per = (nc + rp - 1u) / rp;
    for (uint q = t; q < nc * rp; q += WG) {
        uint c = q / rp, part = q % rp;
        float v = cand_v[c];
        uint i = cand_i[c], rank = 0u;
        for (uint o = part * per; o < min(nc, part * per + per); o++) {
            float u = cand_v[o];
            uint j = cand_i[o];
            rank += (u > v || (u == v && j < i)) ? 1u : 0u;
        }
        if (rank != 0u) atomicAdd(cand_rank[c], rank);
    }
    barrier();
    for (uint c = t; c < nc; c += WG) {
        uint rank = cand_rank[c];
        if (rank < pc.k) {
            chosen[rank] = cand_v[c];
            s[pc.ids_off + a + rank] = uintBitsToFloat(cand_i[c]);
        }
    }
    barrier();
    if (pc.shared_in_arena == 1u) {
        gate = wg_sum(gate);
        if (t == 0u) {
            s[pc.ids_off + a + pc.k] = uintBitsToFloat(pc.n_experts);
            s[pc.w_off + a + pc.k] = sigmoid(gate);
        }
    }
    if (t != 0u) return;
    float total = 0.0;
    for (uint r = 0u; r < pc.k; r++) total += chosen[r];
    for (uint r = 0u; r < pc.k; r++) s[pc.w_off + a + r] = chosen[r] / total;
}
