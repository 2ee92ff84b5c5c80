// Shared by every shader: the per-layer bindings of set 0, activations and
// workgroup reductions. Include after `#define WG <workgroup size>`.
//
// set 0, binding 0: the state's scratch (every activation vector at a fixed
//                   float offset; integer values stored as float bits)
// set 0, binding 1: this layer's recurrent state / caches (a dummy elsewhere)
// set 0, binding 2: the model's small f32 parameters (norms, conv taps, ...)

#extension GL_KHR_shader_subgroup_arithmetic : require

layout(local_size_x = WG) in;

layout(set = 0, binding = 0) buffer Scratch { float s[]; };
layout(set = 0, binding = 1) buffer LayerState { float st[]; };
layout(set = 0, binding = 2) readonly buffer Params { float prm[]; };

float sigmoid(float x) { return 1.0 / (1.0 + exp(-x)); }
float silu(float x) { return x * sigmoid(x); }
// PyTorch's softplus (threshold 20).
float softplus(float x) { return x > 20.0 ? x : log(1.0 + exp(x)); }

// Workgroup reductions: subgroup arithmetic, then one slot per subgroup in
// shared memory (subgroups are at least 4 wide, so WG/4 slots suffice).
shared float red[WG / 4];

// Sum of `v` over the workgroup; every invocation must call it.
float wg_sum(float v) {
    float p = subgroupAdd(v);
    if (subgroupElect()) red[gl_SubgroupID] = p;
    barrier();
    float r = 0.0;
    for (uint i = 0u; i < gl_NumSubgroups; i++) r += red[i];
    barrier();
    return r;
}

// Maximum of `v` over the workgroup; every invocation must call it.
float wg_max(float v) {
    float p = subgroupMax(v);
    if (subgroupElect()) red[gl_SubgroupID] = p;
    barrier();
    float r = red[0];
    for (uint i = 1u; i < gl_NumSubgroups; i++) r = max(r, red[i]);
    barrier();
    return r;
}

// `1 / sqrt(mean + eps)` as the CPU computes it.
float rms_scale(float sum_sq, uint n, float eps) { return 1.0 / sqrt(sum_sq / float(n) + eps); }
