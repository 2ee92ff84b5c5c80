#version 450
// MoE router after its matvec, one workgroup: softmax over the expert
// logits (in place), top-k by probability (ties to the lower expert id),
// weights renormalised over the chosen k. Writes ids (as float bits) and
// weights. With `shared_in_arena` the shared expert follows as expert k:
// id n_experts (its slot-table entry), weight sigmoid(shared_gate . x).
#define WG 256
#define MAX_K 64
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

shared float best_v[WG];
shared uint best_i[WG];
shared float chosen[MAX_K];

void main() {
    uint t = gl_LocalInvocationIndex, n = pc.n_experts, l = pc.logits_off;
    float m = -1.0 / 0.0;
    for (uint i = t; i < n; i += WG) m = max(m, s[l + i]);
    m = wg_max(m);
    float sum = 0.0;
    for (uint i = t; i < n; i += WG) {
        float e = exp(s[l + i] - m);
        s[l + i] = e;
        sum += e;
    }
    sum = wg_sum(sum);
    for (uint i = t; i < n; i += WG) s[l + i] /= sum;
    for (uint r = 0u; r < pc.k; r++) {
        float bv = -1.0;
        uint bi = 0xffffffffu;
        for (uint i = t; i < n; i += WG) {
            float v = s[l + i];
            if (v > bv) { bv = v; bi = i; }
        }
        best_v[t] = bv;
        best_i[t] = bi;
        barrier();
        for (uint o = WG / 2; o > 0; o >>= 1) {
            if (t < o) {
                float v = best_v[t + o];
                uint i = best_i[t + o];
                if (v > best_v[t] || (v == best_v[t] && i < best_i[t])) { best_v[t] = v; best_i[t] = i; }
            }
            barrier();
        }
        uint win = best_i[0];
        if (t == 0u) {
            chosen[r] = best_v[0];
            s[pc.ids_off + r] = uintBitsToFloat(win);
        }
        barrier();
        if (win % WG == t) s[l + win] = -1.0;  // taken; only its owner reads it again
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
