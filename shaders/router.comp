#version 450
#extension GL_EXT_control_flow_attributes : require
// The MoE router's logits from its exact F32 weights: y[t][e] = W[e] . x[t]
// for the experts e (rows) and the pass's tokens t, in one fixed order of
// operations whatever the module, so that a pass of tokens (BATCH) gives
// each token the bits it gets alone (the choice of experts follows them).
//
// The order: a row's 16-byte items v (four floats; rows zero-padded to 16
// bytes, activations past `cols` read as zero) fall into SEGS segments,
// segment s taking items s, s + SEGS, s + 2 SEGS, ... in turn; each
// segment's partial sum is a chain of fused multiply-adds from 0 over its
// items, the item's four floats in order; the logit is partial 0, plus
// partial 1, plus partial 2, ... in turn.
//
// Work split: an invocation computes one segment of TT tokens by TE experts
// (TT * TE chains side by side); SEGS consecutive invocations make a slot,
// and a workgroup's WG / SEGS slots cover TG token groups by WG / SEGS / TG
// expert groups. The partial sums meet in shared memory and each output is
// added up by one invocation. One token (without BATCH): a slot per expert,
// WG 64 (four experts a workgroup), U = 20 items' loads in flight at once
// (the real router's segment is 40 items); a pass (BATCH): 4 x 4 per
// invocation, 16 tokens by 16 experts a workgroup of 256, U = 2.
#define SEGS 16u
#ifdef BATCH
#define WG 256
#define TT 4u
#define TE 4u
#define TG 4u
#define U 2u
#else
#define WG 64
#define TT 1u
#define TE 1u
#define TG 1u
#define U 20u
#endif
#define SLOTS (uint(WG) / SEGS)
#define EG (SLOTS / TG)
#define OUTS (TT * TE)
#include "common.glsl"

layout(push_constant) uniform Push {
    uint rows;        // experts
    uint cols;        // the row's floats
    uint row_bytes;   // bytes from a row to the next (a multiple of 16)
    uint x_off;       // token 0's input (a multiple of 4)
    uint y_off;       // token 0's logits
    uint tok_stride;  // floats from a token's activations to the next's (a multiple of 4)
    uint n;           // tokens
} pc;

layout(set = 1, binding = 0) readonly restrict buffer Weight4 { vec4 w4[]; };
layout(set = 0, binding = 0) readonly buffer ScratchVec4 { vec4 s4[]; };

shared float part[SLOTS * OUTS * (SEGS + 1u)];

void main() {
    uint lane = gl_LocalInvocationIndex, seg = lane % SEGS, slot = lane / SEGS;
    uint t0 = (gl_WorkGroupID.y * TG + slot / EG) * TT;
    uint e0 = (gl_WorkGroupID.x * EG + slot % EG) * TE;
    uint items = (pc.cols + 3u) >> 2, row4 = pc.row_bytes >> 4;
    // Rows and tokens past the end repeat the last (their sums are not stored).
    uint wrow[TE];
    uint xrow[TT];
    [[unroll]] for (uint j = 0u; j < TE; j++) wrow[j] = min(e0 + j, pc.rows - 1u) * row4;
    [[unroll]] for (uint i = 0u; i < TT; i++) xrow[i] = (pc.x_off + min(t0 + i, pc.n - 1u) * pc.tok_stride) >> 2;
    precise float acc[OUTS];
    [[unroll]] for (uint o = 0u; o < OUTS; o++) acc[o] = 0.0;
    // U of the segment's items at a time: their loads first (clamped to the
    // last item), all in flight together, then the chains through those
    // that exist, in order.
    for (uint v0 = seg; v0 < items; v0 += SEGS * U) {
        vec4 w[U * TE];
        vec4 x[U * TT];
        [[unroll]] for (uint u = 0u; u < U; u++) {
            uint v = min(v0 + SEGS * u, items - 1u);
            [[unroll]] for (uint j = 0u; j < TE; j++) w[u * TE + j] = w4[wrow[j] + v];
            [[unroll]] for (uint i = 0u; i < TT; i++) {
                vec4 xi = s4[xrow[i] + v];
                if (4u * v + 4u > pc.cols) {
                    [[unroll]] for (uint c = 0u; c < 4u; c++) if (4u * v + c >= pc.cols) xi[c] = 0.0;
                }
                x[u * TT + i] = xi;
            }
        }
        [[unroll]] for (uint u = 0u; u < U; u++) {
            if (v0 + SEGS * u >= items) break;
            [[unroll]] for (uint i = 0u; i < TT; i++) {
                [[unroll]] for (uint j = 0u; j < TE; j++) {
                    vec4 wv = w[u * TE + j], xv = x[u * TT + i];
                    precise float a = acc[i * TE + j];
                    a = fma(wv.x, xv.x, a);
                    a = fma(wv.y, xv.y, a);
                    a = fma(wv.z, xv.z, a);
                    a = fma(wv.w, xv.w, a);
                    acc[i * TE + j] = a;
                }
            }
        }
    }
    [[unroll]] for (uint o = 0u; o < OUTS; o++) part[(slot * OUTS + o) * (SEGS + 1u) + seg] = acc[o];
    barrier();
    for (uint q = lane; q < SLOTS * OUTS; q += uint(WG)) {
        uint sl = q / OUTS, o = q % OUTS;
        uint t = (gl_WorkGroupID.y * TG + sl / EG) * TT + o / TE;
        uint e = (gl_WorkGroupID.x * EG + sl % EG) * TE + o % TE;
        precise float y = part[q * (SEGS + 1u)];
        for (uint k = 1u; k < SEGS; k++) y += part[q * (SEGS + 1u) + k];
        if (t < pc.n && e < pc.rows) s[pc.y_off + t * pc.tok_stride + e] = y;
    }
}
