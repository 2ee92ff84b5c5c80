// Shared by moe_route.comp and moe_combine.comp (after common.glsl).
// This invocation's share (every WG-th term from `t`) of the dot product of
// the n parameters at `w` with the n scratch values at `x`, UN terms' loads
// issued at once and then added in order (a loop of a load and an add waits
// out each load in turn). The including shader enables
// GL_EXT_control_flow_attributes and defines UN.
float dot_prm_ahead(uint w, uint x, uint n, uint t) {
    float d = 0.0;
    for (uint i0 = t; i0 < n; i0 += UN * WG) {
        float p[UN], v[UN];
        [[unroll]] for (uint u = 0u; u < UN; u++) {
            uint i = min(i0 + u * WG, n - 1u);
            p[u] = prm[w + i];
            v[u] = s[x + i];
        }
        [[unroll]] for (uint u = 0u; u < UN; u++) if (i0 + u * WG < n) d += p[u] * v[u];
    }
    return d;
}
