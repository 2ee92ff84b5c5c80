#version 450
// MoE router after its matvec, one workgroup: softmax over the expert
// logits (in place, and in shared memory), top-k by probability (ties to
// the lower expert id; k rounds of a subgroup-reduced argmax),
// weights renormalised over the chosen k. Writes ids (as float bits) and
// weights. With `shared_in_arena` the shared expert follows as expert k:
// id n_experts (its slot-table entry), weight sigmoid(shared_gate . x).
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
} pc;

shared float prob[MAX_EXPERTS];
shared float chosen[MAX_K];
shared float red_v[WG / 4];
shared uint red_i[WG / 4];

void main() {
    uint t = gl_LocalInvocationIndex, n = pc.n_experts, l = pc.logits_off;
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
    // k rounds of a workgroup argmax: each invocation scans the experts it
    // owns (i = t mod WG, ascending, so a tie keeps the lower id), subgroups
    // reduce (max value, then the lowest id holding it), and every
    // invocation merges the subgroups' winners; the owner marks the winner
    // taken. Two barriers a round.
    for (uint r = 0u; r < pc.k; r++) {
        float bv = -1.0;
        uint bi = 0xffffffffu;
        for (uint i = t; i < n; i += WG) {
            float v = prob[i];
            if (v > bv) { bv = v; bi = i; }
        }
        float sv = subgroupMax(bv);
        uint si = subgroupMin(bv == sv ? bi : 0xffffffffu);
        if (subgroupElect()) {
            red_v[gl_SubgroupID] = sv;
            red_i[gl_SubgroupID] = si;
        }
        barrier();
        float wv = red_v[0];
        uint wi = red_i[0];
        for (uint g = 1u; g < gl_NumSubgroups; g++) {
            if (red_v[g] > wv || (red_v[g] == wv && red_i[g] < wi)) { wv = red_v[g]; wi = red_i[g]; }
        }
        if (t == 0u) {
            chosen[r] = wv;
            s[pc.ids_off + r] = uintBitsToFloat(wi);
        }
        if (wi % WG == t) prob[wi] = -1.0;
        barrier();
    }
    if (pc.shared_in_arena == 1u) {
        float g = 0.0;
        for (uint i = t; i < pc.h; i += WG) g += prm[pc.shared_gate + i] * s[pc.x_off + i];
        g = wg_sum(g);
        if (t == 0u) {
            s[pc.ids_off + pc.k] = uintBitsToFloat(pc.n_experts);
            s[pc.w_off + pc.k] = sigmoid(g);
        }
    }
    if (t != 0u) return;
    float total = 0.0;
    for (uint r = 0u; r < pc.k; r++) total += chosen[r];
    for (uint r = 0u; r < pc.k; r++) s[pc.w_off + r] = chosen[r] / total;
}
