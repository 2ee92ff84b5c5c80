#version 450
// Attention inputs at position `pos`: workgroups 0..nh RMS-norm and rotate
// the query heads; workgroups nh..nh+nkv norm and rotate the key heads and
// append keys and values to the layer's caches. Head dims up to WG.
// Workgroup y-index t is the pass's token t: its activations (and its
// position's cos/sin table) tok_stride floats further, position pos + t.
#define WG 256
#include "common.glsl"

layout(push_constant) uniform Push {
    uint qg_off;    // [nh][q hd | gate hd]
    uint k_off;     // [nkv*hd]
    uint v_off;     // [nkv*hd]
    uint q_off;     // [nh*hd] normed, rotated queries
    uint q_norm;
    uint k_norm;
    uint rope;      // scratch offset of the position's cos/sin table
    uint half_dims;
    uint hd;
    uint nh;
    uint nkv;
    uint keys_off;  // layer-state offsets of the key and value caches
    uint values_off;
    uint pos;
    float eps;
    uint tok_stride;
} pc;

shared float vec_sh[WG];
#include "rope.glsl"

void main() {
    uint g = gl_WorkGroupID.x, i = gl_LocalInvocationIndex, hd = pc.hd;
    uint tok = gl_WorkGroupID.y * pc.tok_stride, pos = pc.pos + gl_WorkGroupID.y;
    bool query = g < pc.nh;
    uint src = tok + (query ? pc.qg_off + g * 2u * hd : pc.k_off + (g - pc.nh) * hd);
    float x = i < hd ? s[src + i] : 0.0;
    float r = rms_scale(wg_sum(x * x), hd, pc.eps);
    vec_sh[i] = x * r * (i < hd ? prm[(query ? pc.q_norm : pc.k_norm) + i] : 0.0);
    barrier();
    if (i >= hd) return;
    float y = rope_at(i, pc.rope + tok, pc.half_dims);
    if (query) {
        s[tok + pc.q_off + g * hd + i] = y;
    } else {
        uint kvh = g - pc.nh, at = pos * pc.nkv * hd + kvh * hd + i;
        st[pc.keys_off + at] = y;
        st[pc.values_off + at] = s[tok + pc.v_off + kvh * hd + i];
    }
}
