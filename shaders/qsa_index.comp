#version 450
// QSA indexer for a run of tokens, one workgroup per token (y): caches its
// raw indexer key; when it completes a block, pools, norms and rotates the
// block's key; norms and rotates its indexer query heads in place (once a
// block is complete). The offsets are the run's first token's, the others
// `tok_stride` floats apart; a block's keys from the run are read where the
// run's tokens hold them (the scratch), so no workgroup waits on another.
// Dims up to WG.
#define WG 128
#include "common.glsl"

layout(push_constant) uniform Push {
    uint key_off;     // [id] raw key
    uint query_off;   // [ih*id]
    uint q_norm;
    uint k_norm;
    uint rope;        // cos/sin table at the token's position
    uint block_rope;  // cos/sin table at the first position of the block it completes
    uint half_dims;
    uint id;
    uint heads;
    uint ratio;
    uint raw_keys;    // layer-state offset: [ctx][id]
    uint block_keys;  // layer-state offset: [ctx/ratio][id]
    uint pos;         // the run's first position
    uint tok_stride;
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
    uint tok = gl_WorkGroupID.y * pc.tok_stride, pos = pc.pos + gl_WorkGroupID.y;
    bool on = i < id;
    if (on) st[pc.raw_keys + pos * id + i] = s[pc.key_off + tok + i];
    if ((pos + 1u) % pc.ratio == 0u) {
        uint block = (pos + 1u) / pc.ratio - 1u;
        float pooled = 0.0;
        if (on) {
            for (uint p = block * pc.ratio; p <= pos; p++)
                pooled += p >= pc.pos ? s[pc.key_off + (p - pc.pos) * pc.tok_stride + i] : st[pc.raw_keys + p * id + i];
            pooled /= float(pc.ratio);
        }
        norm_into_shared(pooled, i, pc.k_norm);
        float y = on ? rope_at(i, pc.block_rope + tok, pc.half_dims) : 0.0;
        barrier();
        if (on) st[pc.block_keys + block * id + i] = y;
    }
    // Query heads once a block is complete.
    uint heads = pos + 1u >= pc.ratio ? pc.heads : 0u;
    for (uint hq = 0u; hq < heads; hq++) {
        norm_into_shared(on ? s[pc.query_off + tok + hq * id + i] : 0.0, i, pc.q_norm);
        float y = on ? rope_at(i, pc.rope + tok, pc.half_dims) : 0.0;
        barrier();
        if (on) s[pc.query_off + tok + hq * id + i] = y;
    }
}
