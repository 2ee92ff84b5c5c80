// The epilogues of matvec.comp's modes 0 to 4 for one output: row r of the
// dispatch's rows for entry `en`, its sum v (and with SwiGLU its up row's
// sum u). Shared by mm.comp and split_sums.comp, which applies them to the
// added sums of split rows. Include after matvec_push.glsl.

void mm_store(Entry en, uint r, float v, float u) {
    uint y = pc.y_off + en.tok + en.k * pc.y_stride + pc.row_base + r;
    if (pc.mode == 3u) {
        // Residual write-back: stream c gets its token's weight times the row
        // (one fused multiply-add, as matvec.comp writes it).
        for (uint c = 0u; c < pc.aux_n; c++) {
            uint at = y + c * pc.total_rows;
            s[at] = fma(s[pc.aux_off + en.k * pc.y_stride + c], v, s[at]);
        }
    } else if (pc.mode == 0u) {
        s[y] = v;
    } else if (pc.mode == 1u) {
        s[y] = pc.row_base + r < pc.split_row ? silu(v * pc.scale) : 2.0 * sigmoid(v * pc.scale);
    } else {
        s[y] = silu(v) * u;
    }
}
