#version 450
// QSA indexer at position `pos`, one workgroup: caches the raw indexer key;
// when `block` completes a block (block != ~0) pools, norms and rotates its
// key; norms and rotates the indexer query heads in place. Dims up to WG.
#define WG 128
#include "common.glsl"

layout(push_constant) uniform Push {
    uint key_off;     // [id] raw key of this token
    uint query_off;   // [ih*id]
    uint q_norm;
    uint k_norm;
    uint rope;        // cos/sin table at pos
    uint block_rope;  // cos/sin table at the completed block's first position
    uint half_dims;
    uint id;
    uint heads;
    uint ratio;
    uint raw_keys;    // layer-state offset: [ctx][id]
    uint block_keys;  // layer-state offset: [ctx/ratio][id]
    uint pos;
    uint block;
    float eps;
} pc;

shared float vec_sh[WG];
#include "rope.glsl"

// RMS-norms `x` (element i of this invocation) into vec_sh.
void norm_into_shared(float x, uint i, uint gamma) {
    float r = rms_scale(wg_sum(x * x), pc.id, pc.eps);
    vec_sh[i] = i < pc.id ? x * r * prm[gamma + i] : 0.0;
    barrier();
}

void main() {
    uint i = gl_LocalInvocationIndex, id = pc.id;
    bool on = i < id;
    if (on) st[pc.raw_keys + pc.pos * id + i] = s[pc.key_off + i];
    if (pc.block != 0xffffffffu) {
        float pooled = 0.0;
        if (on) {
            for (uint t = pc.block * pc.ratio; t < (pc.block + 1u) * pc.ratio; t++) pooled += st[pc.raw_keys + t * id + i];
            pooled /= float(pc.ratio);
        }
        norm_into_shared(pooled, i, pc.k_norm);
        float y = on ? rope_at(i, pc.block_rope, pc.half_dims) : 0.0;
        barrier();
        if (on) st[pc.block_keys + pc.block * id + i] = y;
    }
    for (uint hq = 0u; hq < pc.heads; hq++) {
        norm_into_shared(on ? s[pc.query_off + hq * id + i] : 0.0, i, pc.q_norm);
        float y = on ? rope_at(i, pc.rope, pc.half_dims) : 0.0;
        barrier();
        if (on) s[pc.query_off + hq * id + i] = y;
    }
}
