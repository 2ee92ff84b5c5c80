#version 450
// MoE router after its matvec, one workgroup: softmax over the expert
// logits (in place, and in shared memory), top-k by probability (ties to
// the lower expert id; per subgroup, then over the subgroups' picks),
// weights renormalised over the chosen k. Writes ids (as float bits) and
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
// Each subgroup's k best, at MAX_K apart: subgroups x k must be at most
// MAX_CAND (the host checks: MOE_ROUTE_CANDIDATES in src/vulkan/pipelines.rs).
#define MAX_CAND 2048
shared float cand_v[MAX_CAND];
shared uint cand_i[MAX_CAND];

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
    // Top-k in two stages, with no workgroup barrier between rounds: each
    // subgroup picks the k best of the experts its invocations own (k rounds
    // of a subgroup argmax over i = t mod WG, the owner marking the winner
    // taken), then subgroup 0 picks the k best of those candidates the same
    // way. Order: probability descending, then expert id ascending (a tie
    // keeps the lower id, as the CPU); every global top-k expert is among its
    // subgroup's top-k, so the two stages choose what one would.
    uint sg = gl_SubgroupID, lane = gl_SubgroupInvocationID, sgs = gl_SubgroupSize;
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
            cand_v[sg * pc.k + r] = sv;
            cand_i[sg * pc.k + r] = si;
        }
        if (si != 0xffffffffu && si % WG == t) prob[si] = -1.0;
    }
    barrier();
    if (sg == 0u) {
        uint nc = gl_NumSubgroups * pc.k;
        for (uint r = 0u; r < pc.k; r++) {
            // Lane `lane` owns candidates c = lane mod sgs and marks those taken -4.
            float bv = -3.0;
            uint bi = 0xffffffffu, bc = 0xffffffffu;
            for (uint c = lane; c < nc; c += sgs) {
                float v = cand_v[c];
                uint i = cand_i[c];
                if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; bc = c; }
            }
            float sv = subgroupMax(bv);
            uint si = subgroupMin(bv == sv ? bi : 0xffffffffu);
            if (bv == sv && bi == si && bc != 0xffffffffu) cand_v[bc] = -4.0;
            if (lane == 0u) {
                chosen[r] = sv;
                s[pc.ids_off + a + r] = uintBitsToFloat(si);
            }
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
