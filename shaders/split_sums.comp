#version 450
// The sums of split rows (kcols != 0) of shaders/mm.comp and
// shaders/matvec.comp: each of their workgroups took `kcols` columns of its
// rows and wrote its partial sums at partial_off ([split][entry][row],
// SwiGLU's up rows after the gate rows); this adds each output's splits in
// order (split 0 first, so the result does not depend on which workgroup
// ran first) and applies the epilogue the matrix's dispatch would have
// (epilogue.glsl). Invocation x: row x of the dispatch's rows (gate rows
// with SwiGLU), workgroup y: entry y (plain matrices only: the entries are
// the pass's tokens).
#define WG 256
#include "common.glsl"
#include "matvec_push.glsl"
#include "epilogue.glsl"

void main() {
    uint r = gl_GlobalInvocationID.x, j = gl_WorkGroupID.y;
    if (r >= pc.rows || j >= pc.ntok) return;
    bool swiglu = pc.mode == 4u;
    uint stride = swiglu ? 2u * pc.rows : pc.rows;
    uint splits = (pc.cols + pc.kcols - 1u) / pc.kcols;
    float v = 0.0, u = 0.0;
    for (uint k = 0u; k < splits; k++) {
        uint at = pc.partial_off + (k * pc.ntok + j) * stride + r;
        v += s[at];
        if (swiglu) u += s[at + pc.rows];
    }
    mm_store(entry(j), r, v, u);
}
