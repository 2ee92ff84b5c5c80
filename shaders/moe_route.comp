#version 450
// MoE router after its matvec, one workgroup: softmax over the expert
// logits (in place, and in shared memory), top-k by probability (ties to
// the lower expert id; each expert counts its rank in one pass),
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
    // An expert's rank is the number of experts with a higher probability,
    // or an equal one and a lower id; counting stops once it reaches k.
    for (uint i = t; i < n; i += WG) {
        float v = prob[i];
        uint rank = 0u;
        for (uint j = 0u; j < n && rank < pc.k; j++) {
            float o = prob[j];
            rank += (o > v || (o == v && j < i)) ? 1u : 0u;
        }
        if (rank < pc.k) {
            chosen[rank] = v;
            s[pc.ids_off + rank] = uintBitsToFloat(i);
        }
    }
    barrier();
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
