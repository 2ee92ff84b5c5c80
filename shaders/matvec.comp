#version 450
// y = W x, one workgroup per output row, with an epilogue chosen by `mode`.
// With ARENA (routed experts): workgroup y-index k reads expert id
// s[expert_off + k], finds its arena slot through the slot table, and reads
// x and writes y at k * stride.
#define WG 64
#include "common.glsl"
#include "weights.glsl"

layout(push_constant) uniform Push {
    uint rows;        // rows of this dispatch (per expert with ARENA)
    uint cols;
    uint row_bytes;
    uint row_base;    // output index of the first row (split tensors)
    uint x_off;
    uint y_off;
    uint mode;        // 0 store, 1 hyper-connection down|inject, 3 residual post, 4 swiglu
    float scale;
    uint aux_off;     // mode 3: scratch offset of the per-stream weights
    uint aux_n;       // mode 3: number of streams
    uint total_rows;  // mode 3: stream length
    uint expert_off;  // ARENA: scratch offset of the chosen expert ids
    uint x_stride;
    uint y_stride;
    uint slot_table;  // ARENA: params offset of this layer's slot table
    uint slots_per_slab;
    uint slot_bytes;
    uint part_off;    // ARENA: byte offset of this matrix inside a slot
    uint split_row;   // mode 1: rows below get silu(v*scale), the rest 2*sigmoid(v*scale)
} pc;

void main() {
    uint r = gl_WorkGroupID.x + gl_WorkGroupID.z * gl_NumWorkGroups.x;
    if (r >= pc.rows) return;
    uint k = gl_WorkGroupID.y;
    uint base = 0u;
#ifdef ARENA
    uint id = floatBitsToUint(s[pc.expert_off + k]);
    uint slot = floatBitsToUint(prm[pc.slot_table + id]);
    g_slab = slot / pc.slots_per_slab;
    base = (slot % pc.slots_per_slab) * pc.slot_bytes + pc.part_off;
#endif
    uint x = pc.x_off + k * pc.x_stride;
    float v = wg_sum(row_dot(base + r * pc.row_bytes, x, pc.cols));
    float u = 0.0;
    if (pc.mode == 4u) u = wg_sum(row_dot(base + (r + pc.rows) * pc.row_bytes, x, pc.cols));
    if (gl_LocalInvocationIndex != 0u) return;
    uint y = pc.y_off + k * pc.y_stride + pc.row_base + r;
    if (pc.mode == 0u) {
        s[y] = v;
    } else if (pc.mode == 1u) {
        s[y] = pc.row_base + r < pc.split_row ? silu(v * pc.scale) : 2.0 * sigmoid(v * pc.scale);
    } else if (pc.mode == 3u) {
        for (uint c = 0u; c < pc.aux_n; c++) s[y + c * pc.total_rows] += s[pc.aux_off + c] * v;
    } else {
        s[y] = silu(v) * u;
    }
}
