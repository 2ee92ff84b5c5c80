// The Gated DeltaNet's per-channel conv and per-head gated norm, shared by
// the stage modules (gdn_conv.comp, gdn_norm.comp) and one token's fused
// step (gdn_recurrent.comp with TOKEN), so both give the same bits.
// Include after common.glsl.

// The depthwise causal conv + SiLU of channel `c` for token `t` of a pass
// at position `pos` (token 0 at `pos - t`): its input and those of the
// pass's earlier tokens from the inputs at `x_off` (`tok_stride` apart),
// earlier positions from the ring of `rows` rows of `dc` channels at the
// layer state's start (rows before the first position hold zeros). The
// sum runs tap by tap from the oldest, one fma each.
float gdn_conv_at(uint x_off, uint tok_stride, uint t, uint pos, uint c, uint dc, uint kc, uint rows, uint taps) {
    float x = s[x_off + t * tok_stride + c];
    float acc = prm[taps + c * kc + kc - 1u] * x;
    // Tap k reads the input kc-1-k positions back.
    for (uint k = 0u; k + 1u < kc; k++) {
        uint back = kc - 1u - k;
        float xb = t >= back ? s[x_off + (t - back) * tok_stride + c] : st[((pos + rows - back) % rows) * dc + c];
        acc = fma(prm[taps + c * kc + k], xb, acc);
    }
    return silu(acc);
}

// y = o * rms(o) * norm * gate(z) for value j of a head of `d` values, the
// workgroup's invocation j holding o (0 past d); every invocation calls it.
float gdn_gated_norm(float o, float z, uint j, uint d, uint norm, uint gate_silu, float eps) {
    float r = rms_scale(wg_sum(o * o), d, eps);
    float g = gate_silu == 1u ? silu(z) : sigmoid(z);
    return j < d ? o * r * prm[norm + j] * g : 0.0;
}
