// The push constants of the matrix kernels (shaders/matvec.comp,
// shaders/mm.comp; mirrored by MatvecPush in src/vulkan/pipelines.rs) and
// the entries of a dispatch: a plain matrix's tokens, or (ARENA) the
// chosen experts, optionally (token, expert) pairs in the order
// moe_group.comp wrote. Include after common.glsl.

layout(push_constant) uniform Push {
    uint rows;        // rows of this dispatch (per expert with ARENA; gate rows with SwiGLU)
    uint cols;
    uint row_bytes;   // payload bytes per row (layout.rs)
    uint row_base;    // output index of the first row (split tensors)
    uint x_off;       // a multiple of 4
    uint y_off;
    uint mode;        // 0 store, 1 hyper-connection down|inject, 3 residual post, 4 swiglu, 5 hyper-connection up+combine
    float scale;
    uint aux_off;     // mode 3: scratch offset of the per-stream weights; mode 5: of the normalised streams
    uint aux_n;       // modes 3, 5: number of streams
    uint total_rows;  // mode 3: stream length; mode 5: the matrix's rows
    uint expert_off;  // ARENA: scratch offset of the chosen expert ids; a plain matrix's split rows: of their arrival counters (0: none)
    uint x_stride;    // a multiple of 4
    uint y_stride;
    uint slot_table;  // ARENA: params offset of this layer's slot table; ~0: the ids are slots
    uint slots_per_slab;
    uint slot_bytes;
    uint part_off;    // ARENA: byte offset of this matrix inside a slot
    uint split_row;   // mode 1: rows below get silu(v*scale), the rest 2*sigmoid(v*scale)
    uint tpr_shift;   // log2 of the invocations per row set
    uint fld0;        // byte offsets of the field arrays (layout.rs)
    uint fld1;
    uint kdiv;        // ARENA: experts per token of a batch (0: one token)
    uint tok_stride;  // ARENA with kdiv: floats between tokens' activations
    uint tile;        // batch entries per workgroup (0: one)
    uint ntok;        // with tile > 1: entries of the dispatch
    uint order_off;   // ARENA with kdiv: the pairs grouped by expert (moe_group.comp); 0: in order
    uint xq_off;      // FAST: token 0's activations rounded by act_int8.comp; 0: round them here
    uint order_base;  // ARENA with order_off: the dispatch's entry k is entry order_base + k of the order
    uint tiles_off;   // mm.comp, ARENA with order_off: moe_group.comp's tiles of one expert each (0: tiles of BN entries)
    uint kcols;       // mm.comp, matvec.comp, split_sums.comp: columns of a split of the rows (whole steps and blocks; 0: rows whole)
    uint partial_off; // with kcols: the splits' sums, [split][entry][rows (SwiGLU: gate rows, then up rows)]
} pc;

// Entry k of the dispatch: its index among its token's vectors (k itself
// for a plain matrix), its token's offset (pairs of a batch) and the arena
// slot of its weights (ARENA; 0 otherwise).
struct Entry { uint k, tok, slot; };

Entry entry(uint k) {
    uint tok = 0u, slot = 0u;
#ifdef ARENA
    if (pc.kdiv != 0u) {
        if (pc.order_off != 0u) {
            uint q = pc.order_base + k;
            k = floatBitsToUint(s[pc.order_off + (q / pc.kdiv) * pc.tok_stride + q % pc.kdiv]);
        }
        tok = (k / pc.kdiv) * pc.tok_stride;
        k = k % pc.kdiv;
    }
    // An expert id through the layer's slot table, or (slot_table = ~0, the
    // expert cache's host-chosen slots) the slot itself.
    uint id = floatBitsToUint(s[pc.expert_off + tok + k]);
    slot = pc.slot_table == 0xffffffffu ? id : floatBitsToUint(prm[pc.slot_table + id]);
#endif
    return Entry(k, tok, slot);
}

