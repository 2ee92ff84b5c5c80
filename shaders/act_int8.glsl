// Activations rounded to 8 bits for the fast matvec kernels, one block of 32
// values per four invocations: shared by the matvec's own rounding
// (`prepare_x` in weights_int.glsl) and by act_int8.comp, which rounds a
// pass's activations once for every workgroup of the matvecs after it, so
// both give the same levels, scales and sums bit for bit.
//
// `x ~ d q` with `d = amax / 127`, `q = roundEven(x * 127 / amax)` in
// -127..127, as the CPU's fast path does (src/quant/dot/act.rs); a block
// holding a NaN or an infinity gets d = NaN. Every invocation of the four
// must call it (the maximum and the sums meet by shuffles within the four,
// which the subgroup size, at least 4, keeps together); `v0, v1` are this
// invocation's eight values (zeros past the end).

// Must equal FAST_MAX_COLS in src/vulkan/pipelines.rs.
const uint FAST_MAX_COLS = 10240u;
// A region of rounded activations (a token's `xq` in src/vulkan/scratch.rs,
// up to FAST_MAX_COLS values): the levels as words (16 values per four
// words), then the scales of each 32 at float XQ_D, then the sums of the
// levels of each 16 (int bits) at XQ_S.
const uint XQ_D = FAST_MAX_COLS / 4u;
const uint XQ_S = XQ_D + FAST_MAX_COLS / 32u;
const uint XQ_FLOATS = XQ_S + FAST_MAX_COLS / 16u;

// Four levels as bytes of one word.
uint pack_levels(ivec4 q) {
    uvec4 u = uvec4(q) & 0xFFu;
    return u.x | (u.y << 8) | (u.z << 16) | (u.w << 24);
}

// Rounds the block; this invocation's two level words, the sum of the
// levels of its 16-value half (quarters 0 and 1, 2 and 3) and the block's d.
void round_block(vec4 v0, vec4 v1, out uint w0, out uint w1, out int half_sum, out float d) {
    vec4 a = max(abs(v0), abs(v1));
    float amax = max(max(a.x, a.y), max(a.z, a.w));
    bool finite = !any(isnan(v0)) && !any(isinf(v0)) && !any(isnan(v1)) && !any(isinf(v1));
    amax = max(amax, subgroupShuffleXor(amax, 1u));
    amax = max(amax, subgroupShuffleXor(amax, 2u));
    uint bad = finite ? 0u : 1u;
    bad |= subgroupShuffleXor(bad, 1u);
    bad |= subgroupShuffleXor(bad, 2u);
    float id = bad == 0u && amax > 0.0 ? 127.0 / amax : 0.0;
    ivec4 q0 = clamp(ivec4(roundEven(v0 * id)), -127, 127), q1 = clamp(ivec4(roundEven(v1 * id)), -127, 127);
    int sum = (q0.x + q0.y) + (q0.z + q0.w) + (q1.x + q1.y) + (q1.z + q1.w);
    half_sum = sum + subgroupShuffleXor(sum, 1u);
    w0 = pack_levels(q0);
    w1 = pack_levels(q1);
    d = bad == 0u ? amax / 127.0 : uintBitsToFloat(0x7fc00000u);
}

#ifndef BATCH
// Writes block b's rounding (this invocation's part: round_block's outputs,
// `quarter` its eighth-values' place in the block) into the region at
// scratch float q (act_int8.comp, and producers that round their output).
void store_block(uint q, uint b, uint quarter, uint w0, uint w1, int half_sum, float d) {
    uint e = 2u * b + (quarter >> 1), w = 2u * (quarter & 1u);
    s[q + 4u * e + w] = uintBitsToFloat(w0);
    s[q + 4u * e + w + 1u] = uintBitsToFloat(w1);
    if ((quarter & 1u) == 0u) s[q + XQ_S + e] = intBitsToFloat(half_sum);
    if (quarter == 0u) s[q + XQ_D + b] = d;
}
#endif
