//! Every compute pipeline, from one table: its SPIR-V (`shaders/spirv/`,
//! compiled from `shaders/` and committed; `build.rs` embeds it), its descriptor sets, its push-constant block
//! (mirrored here by a `#[repr(C)]` struct, whose fields a test holds
//! against the shader's block by SPIR-V reflection: [`super::reflect`]) and
//! its workgroup size.
//! [`Recorder::dispatch`](super::record::Recorder::dispatch) checks all three.
//!
//! Set 0 of every pipeline is the per-layer state set (scratch, layer state,
//! model parameters); matvecs add set 1 with one weight buffer, the expert
//! matvecs set 1 with the arena's slabs.
//!
//! # Matvec tuning
//!
//! The matvec pipelines (`matvec_<type>`, `expert_<type>`; shaders/matvec.comp)
//! take specialization constants, fixed when the pipelines are created:
//!
//! | constant | what | default | environment override |
//! |---|---|---|---|
//! | 0 `MAX_SLABS` | arena slab bindings (expert pipelines) | device limit | - |
//! | 1 workgroup size `WG` | invocations per workgroup (power of two) | 128 | `FNX_VK_MATVEC_WG` |
//! | 2 `ROWS` | output rows per row set | 2 | `FNX_VK_MATVEC_ROWS` |
//! | 3 `UNROLL` | work items an invocation loads per pass | 1 (the H200 sweep: 2 was 5-15% slower at every real shape) | `FNX_VK_MATVEC_UNROLL` |
//! | 4 `SHARE` | entries of a tile that share each weight decode (batch modules, at most 8; 1: passes run the plain fast modules) | 8; `expert_q2_k_fast`, `expert_q4_0_fast` 1 | `FNX_VK_MATVEC_SHARE` |
//! | 5 `LANES` | gdn_recurrent only: invocations per column of a head's state ([`gdn_lanes`]) | 4 (2 on CPU devices and where subgroups are narrower) | `FNX_VK_GDN_LANES` |
//!
//! and per dispatch the recorder picks `TPR`, the invocations per row set
//! (push constant `tpr_shift`): the largest power of two, at most `WG`,
//! that leaves each invocation at least `MIN_ITEMS` work items of the row
//! (default 4, `FNX_VK_MATVEC_ITEMS`), or a fixed power of two
//! (`FNX_VK_MATVEC_TPR`). A workgroup covers `WG / TPR * ROWS` rows. For the
//! real model's 2560-wide rows that gives TPR 16 (Q6_K, Q4_0, Q5_0: 80
//! items of 16 bytes), 32 (Q8_0: 160 items) and 8 (Q2_K, Q3_K, Q4_K, Q5_K:
//! 40 items of 64 weights); for the 640-wide expert down rows TPR 4. A
//! dispatch that would then have fewer than `FILL` workgroups (default 256,
//! `FNX_VK_MATVEC_FILL`, 0 = off: a small matrix, which is latency-bound)
//! doubles TPR until it has them: the shared expert's gate/up goes from 80
//! workgroups of TPR 32 to 320 of TPR 128. The split is the one token's
//! whatever the batch, so a token's sums are added in the same order in a
//! batch as alone.
//!
//! In a batch of tokens a workgroup of a plain matrix takes `TILE` tokens
//! in turn (push constant `tile`, default 8, `FNX_VK_MATVEC_TILE`; 1 = a
//! workgroup per token): its rows come from memory for the first and from
//! the caches for the rest, so a prompt pass streams each matrix once per
//! tile rather than once per token. The fast kernels of such a pass copy
//! their input from a region `act_int8` rounded once per token (push
//! constant `xq_off`) instead of rounding it in every workgroup, and run
//! the fast kernels' batch modules (`matvec_<t>_fast_batch`,
//! `expert_<t>_fast_batch`; shaders/matvec.comp's `BATCH`): up to `SHARE`
//! entries of a tile that read the same weights (a plain matrix's tokens,
//! an expert's pairs) go through the rows together, each weight decoded
//! once for them all and dotted with each entry's activations, an entry's
//! sums in its own order; they read the rounded activations in place (no
//! shared copy). Their `ROWS` is fixed at 2 in the shader (every loop over
//! rows and entries unrolls at compile time) and their workgroup is halved
//! where the reduction slots would not fit.
//!
//! Where the device has cooperative matrices ([`Context::coopmat`]; on
//! unless `LoadOptions::gpu_coopmat` or `FNX_VK_COOPMAT=0` says no) and the fast
//! kernels run, a pass's quantized matrices whose rows are a multiple of
//! [`MM_COLS`] values take a third family instead when the dispatch has at
//! least `FNX_VK_MM_MIN` entries (default 8; [`Pipelines::mm`]): the
//! matrix-matrix modules `mm_<t>` and
//! `mm_expert_<t>` (shaders/mm.comp), workgroups of tiles of [`MM_ROWS`]
//! rows by [`mm_entries`] entries on the tensor cores, f16 inputs.
//!
//! The quantized types have a second family of pipelines, the fast kernels
//! (`matvec_<t>_fast`, `expert_<t>_fast`: 8-bit activations, integer dot
//! products; shaders/weights_int.glsl), created where the device has
//! integer dot products and they are chosen (`FNX_GPU_KERNELS`, the load
//! option `gpu_kernels`; by default where 8-bit dot products are
//! accelerated). Rows longer than [`FAST_MAX_COLS`] use the exact ones. A
//! type's entries in the lists below tune both families.
//!
//! Each variable holds a number for every matvec pipeline, or a list such
//! as `FNX_VK_MATVEC_ROWS=4,q8_0=2,expert_q5_0=1,expert=2`: an entry names a
//! pipeline (`expert_q5_0`), a weight type (`q8_0`, both pipelines) or a
//! kind (`matvec`, `expert`); the most specific entry wins, a bare number
//! applies to the rest. Values are rounded to what the device allows
//! (powers of two, the workgroup-size and shared-memory limits).

use super::device::{err, Context};
use super::reflect::Scalar;
use crate::error::Result;
use crate::gguf::GgmlType;
use ash::vk;
use std::sync::Arc;

/// Slab bindings of the expert arena (the `MAX_SLABS` specialization
/// constant of shaders/weights.glsl): what one stage may bind besides set 0,
/// at most 256 (lavapipe allows 28, NVIDIA 256).
fn max_slabs(ctx: &Context) -> u32 {
    let l = &ctx.limits;
    l.max_per_stage_descriptor_storage_buffers.min(l.max_descriptor_set_storage_buffers).min(l.max_per_stage_resources).saturating_sub(4).clamp(1, 256)
}

/// Which descriptor sets a pipeline takes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Sets {
    State,
    StateWeight,
    StateArena,
}

impl Sets {
    pub fn count(self) -> usize {
        if self == Sets::State { 1 } else { 2 }
    }
}

/// A push-constant block: plain `u32`/`f32` fields, `#[repr(C)]`.
pub(crate) trait Push: Copy {
    /// (name, byte offset, kind) of each field, in order: what the shader's
    /// block must be (checked by reflection in `reflect`'s tests).
    const FIELDS: &'static [(&'static str, usize, Scalar)];

    fn bytes(&self) -> &[u8] {
        // SAFETY: implementors are repr(C) structs of 4-byte scalars (no padding).
        unsafe { std::slice::from_raw_parts((self as *const Self).cast::<u8>(), std::mem::size_of::<Self>()) }
    }
}

/// The reflection kind of a push-constant field's Rust type.
trait ScalarKind {
    const KIND: Scalar;
}
impl ScalarKind for u32 {
    const KIND: Scalar = Scalar::U32;
}
impl ScalarKind for f32 {
    const KIND: Scalar = Scalar::F32;
}

macro_rules! push_block {
    ($(#[$m:meta])* $name:ident { $($field:ident: $ty:ty),* $(,)? }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Default, Debug)]
        pub(crate) struct $name { $(pub $field: $ty),* }
        impl Push for $name {
            const FIELDS: &'static [(&'static str, usize, Scalar)] =
                &[$((stringify!($field), std::mem::offset_of!($name, $field), <$ty as ScalarKind>::KIND)),*];
        }
    };
}

push_block!(/// shaders/matvec.comp
MatvecPush { rows: u32, cols: u32, row_bytes: u32, row_base: u32, x_off: u32, y_off: u32, mode: u32, scale: f32,
    aux_off: u32, aux_n: u32, total_rows: u32, expert_off: u32, x_stride: u32, y_stride: u32, slot_table: u32,
    slots_per_slab: u32, slot_bytes: u32, part_off: u32, split_row: u32, tpr_shift: u32, fld0: u32, fld1: u32, kdiv: u32, tok_stride: u32,
    tile: u32, ntok: u32, order_off: u32, xq_off: u32, order_base: u32, tiles_off: u32, kcols: u32, partial_off: u32 });
push_block!(/// shaders/hc_norm.comp
HcNormPush { x_off: u32, gamma: u32, y_off: u32, n: u32, eps: f32, tok_stride: u32, q_off: u32 });
push_block!(/// shaders/hc_combine.comp
HcCombinePush { mix_off: u32, xn_off: u32, y_off: u32, n: u32, streams: u32, tok_stride: u32 });
push_block!(/// shaders/ple_mix.comp
PleMixPush { key_off: u32, value_off: u32, res_off: u32, tmp_off: u32, norm_key: u32, norm_query: u32, norm_conv: u32,
    conv: u32, h: u32, streams: u32, kernel: u32, dilation: u32, rows: u32, pos: u32, eps: f32, phase: u32, n: u32, tok_stride: u32 });
push_block!(/// shaders/gdn_conv.comp
GdnConvPush { x_off: u32, y_off: u32, taps: u32, dc: u32, kc: u32, rows: u32, pos: u32, n: u32, tok_stride: u32 });
push_block!(/// shaders/gdn_recurrent.comp
GdnRecurrentPush { conv_off: u32, b_off: u32, a_off: u32, y_off: u32, nk: u32, nv: u32, d: u32,
    planes_off: u32, planes: u32, pos: u32, n: u32, tok_stride: u32, decay_a: u32, dt_bias: u32 });
push_block!(/// shaders/gdn_recurrent.comp with TOKEN
GdnTokenPush { x_off: u32, taps: u32, dc: u32, kc: u32, rows: u32, b_off: u32, a_off: u32, y_off: u32, z_off: u32, nk: u32,
    nv: u32, d: u32, planes_off: u32, planes: u32, pos: u32, decay_a: u32, dt_bias: u32, norm: u32, gate_silu: u32, eps: f32,
    counts_off: u32 });
push_block!(/// shaders/gdn_norm.comp
GdnNormPush { y_off: u32, z_off: u32, d: u32, norm: u32, gate_silu: u32, eps: f32, tok_stride: u32 });
push_block!(/// shaders/attn_prep.comp
AttnPrepPush { qg_off: u32, k_off: u32, v_off: u32, q_off: u32, q_norm: u32, k_norm: u32, rope: u32, half_dims: u32,
    hd: u32, nh: u32, nkv: u32, keys_off: u32, values_off: u32, pos: u32, eps: f32, tok_stride: u32 });
push_block!(/// shaders/qsa_index.comp
QsaIndexPush { key_off: u32, query_off: u32, q_norm: u32, k_norm: u32, rope: u32, block_rope: u32, half_dims: u32,
    id: u32, heads: u32, ratio: u32, raw_keys: u32, block_keys: u32, pos: u32, tok_stride: u32, eps: f32 });
push_block!(/// shaders/qsa_score.comp
QsaScorePush { query_off: u32, block_keys: u32, score_off: u32, n_blocks: u32, heads: u32, id: u32, scale: f32, ratio: u32,
    phase: u32, tok_stride: u32, score_stride: u32 });
push_block!(/// shaders/qsa_topk.comp
QsaTopkPush { score_off: u32, sel_off: u32, n_blocks: u32, keep: u32, ratio: u32, phase: u32, score_stride: u32,
    sel_stride: u32 });
push_block!(/// shaders/attention.comp
AttentionPush { q_off: u32, qg_off: u32, keys_off: u32, values_off: u32, sel_off: u32, tmp_off: u32, tmp_stride: u32,
    y_off: u32, keep: u32, ratio: u32, n_first: u32, qsa: u32, hd: u32, nh: u32, nkv: u32, scale: f32, tok_stride: u32,
    sel_stride: u32, tmp_tok: u32, counts_off: u32, combine: u32 });

/// Most splits of the keys one (head, token) of shaders/attention.comp
/// takes, and the keys a split's size is a multiple of (its `MAX_SPLITS`,
/// `SPLIT_UNIT`).
const ATTENTION_MAX_SPLITS: usize = 16;
const ATTENTION_SPLIT_UNIT: usize = 64;

/// The splits of shaders/attention.comp for a token attending `n` keys:
/// runs of whole units of 64 keys, at most [`ATTENTION_MAX_SPLITS`] (the
/// shader's `split_keys`).
pub(crate) fn attention_splits(n: usize) -> usize {
    let per = ATTENTION_SPLIT_UNIT * n.div_ceil(ATTENTION_SPLIT_UNIT * ATTENTION_MAX_SPLITS).max(1);
    n.div_ceil(per)
}

/// Floats of one head's partials in shaders/attention.comp for a token
/// attending up to `n_ctx` keys of head dim `hd`: a maximum, a sum and `hd`
/// weighted values per split.
pub(crate) fn attention_head_floats(n_ctx: usize, hd: usize) -> usize {
    n_ctx.div_ceil(ATTENTION_SPLIT_UNIT).clamp(1, ATTENTION_MAX_SPLITS) * (hd + 2)
}

push_block!(/// shaders/moe_route.comp
MoeRoutePush { logits_off: u32, ids_off: u32, w_off: u32, n_experts: u32, k: u32, shared_in_arena: u32, x_off: u32,
    shared_gate: u32, h: u32, tok_stride: u32 });
push_block!(/// shaders/router.comp
RouterPush { rows: u32, cols: u32, row_bytes: u32, x_off: u32, y_off: u32, tok_stride: u32, n: u32 });
push_block!(/// shaders/moe_combine.comp
MoeCombinePush { y_off: u32, w_off: u32, shared_off: u32, x_off: u32, shared_gate: u32, res_off: u32, inject_off: u32,
    h: u32, k: u32, streams: u32, shared_separate: u32, partial_off: u32, tok_stride: u32 });
push_block!(/// shaders/moe_group.comp
MoeGroupPush { ids_off: u32, order_off: u32, tok_stride: u32, k: u32, n: u32, n_ids: u32, tiles_off: u32, tile: u32 });
push_block!(/// shaders/act_int8.comp
ActInt8Push { x_off: u32, x_stride: u32, tok_stride: u32, cols: u32, count: u32, q_off: u32 });

impl HcNormPush {
    /// The grid of `streams` streams of `tokens` tokens: a workgroup per
    /// stream and slice of its elements, per token (shaders/hc_norm.comp).
    pub fn groups(&self, streams: u32, tokens: u32) -> [u32; 3] {
        [streams, self.n.div_ceil(Pipe::HcNorm.spec().workgroup), tokens]
    }
}

/// `MatvecPush::slot_table` of the expert cache: the ids are slots.
pub(crate) const SLOTS_DIRECT: u32 = u32::MAX;
/// `MoeCombinePush::partial_off` when the host computed no expert.
pub(crate) const NO_PARTIAL: u32 = u32::MAX;

/// Largest `k` moe_route.comp handles (`MAX_K`).
pub(crate) const MAX_TOP_K: usize = 64;
/// Most routed experts moe_route.comp handles (`MAX_EXPERTS`).
pub(crate) const MAX_EXPERTS: usize = 1024;
/// Most QSA blocks one query keeps (`MAX_KEEP` in shaders/qsa_topk.comp).
pub(crate) const MAX_QSA_KEEP: usize = 1024;
/// Largest head dims of gdn_recurrent / attn_prep / qsa_index (their workgroup sizes).
pub(crate) const MAX_GDN_HEAD_DIM: usize = 128;
pub(crate) const MAX_ATTN_HEAD_DIM: usize = 256;
pub(crate) const MAX_INDEX_DIM: usize = 128;

/// One row of the pipeline table.
pub(crate) struct Spec {
    pub name: &'static str,
    pub spirv: &'static [u8],
    pub sets: Sets,
    pub push_size: usize,
    /// The push-constant block's fields ([`Push::FIELDS`]).
    pub fields: &'static [(&'static str, usize, Scalar)],
    /// Invocations per workgroup (`local_size_x` of the shader; for the
    /// matvecs only the shader's default: see [`Pipelines::tuning`]).
    pub workgroup: u32,
}

macro_rules! spirv {
    ($name:literal) => {
        include_bytes!(concat!(env!("OUT_DIR"), "/", $name, ".spv"))
    };
}

/// A module's SPIR-V from `$FNX_VK_SPIRV_DIR/<name>.spv` when that variable
/// is set and the file exists, for trying shader variants on a GPU without
/// rebuilding the library: the module still has to declare this build's push
/// constants ([`Pipelines::create`] refuses it otherwise).
fn spirv_override(name: &str) -> Result<Option<Vec<u8>>> {
    let Some(dir) = std::env::var_os("FNX_VK_SPIRV_DIR").filter(|d| !d.is_empty()) else { return Ok(None) };
    let path = std::path::Path::new(&dir).join(format!("{name}.spv"));
    match std::fs::read(&path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(crate::Error::Backend(format!("FNX_VK_SPIRV_DIR: cannot read {}: {e}", path.display()))),
    }
}

macro_rules! pipes {
    ($($variant:ident = $name:literal, $sets:ident, $push:ty, $wg:literal;)*) => {
        /// A pipeline of the table.
        #[derive(Clone, Copy, PartialEq, Eq, Debug)]
        pub(crate) enum Pipe { $($variant),* }
        /// Every pipeline, in table order.
        pub(crate) const TABLE_PIPES: &[Pipe] = &[$(Pipe::$variant),*];
        pub(crate) const TABLE: &[Spec] = &[$(Spec {
            name: $name, spirv: spirv!($name), sets: Sets::$sets, push_size: std::mem::size_of::<$push>(),
            fields: <$push as Push>::FIELDS, workgroup: $wg,
        }),*];
    };
}

pipes! {
    MatvecF32 = "matvec_f32", StateWeight, MatvecPush, 128;
    MatvecF16 = "matvec_f16", StateWeight, MatvecPush, 128;
    MatvecBf16 = "matvec_bf16", StateWeight, MatvecPush, 128;
    MatvecQ4_0 = "matvec_q4_0", StateWeight, MatvecPush, 128;
    MatvecQ4_1 = "matvec_q4_1", StateWeight, MatvecPush, 128;
    MatvecQ5_0 = "matvec_q5_0", StateWeight, MatvecPush, 128;
    MatvecQ5_1 = "matvec_q5_1", StateWeight, MatvecPush, 128;
    MatvecQ8_0 = "matvec_q8_0", StateWeight, MatvecPush, 128;
    MatvecQ2K = "matvec_q2_k", StateWeight, MatvecPush, 128;
    MatvecQ3K = "matvec_q3_k", StateWeight, MatvecPush, 128;
    MatvecQ4K = "matvec_q4_k", StateWeight, MatvecPush, 128;
    MatvecQ5K = "matvec_q5_k", StateWeight, MatvecPush, 128;
    MatvecQ6K = "matvec_q6_k", StateWeight, MatvecPush, 128;
    ExpertF32 = "expert_f32", StateArena, MatvecPush, 128;
    ExpertF16 = "expert_f16", StateArena, MatvecPush, 128;
    ExpertBf16 = "expert_bf16", StateArena, MatvecPush, 128;
    ExpertQ4_0 = "expert_q4_0", StateArena, MatvecPush, 128;
    ExpertQ4_1 = "expert_q4_1", StateArena, MatvecPush, 128;
    ExpertQ5_0 = "expert_q5_0", StateArena, MatvecPush, 128;
    ExpertQ5_1 = "expert_q5_1", StateArena, MatvecPush, 128;
    ExpertQ8_0 = "expert_q8_0", StateArena, MatvecPush, 128;
    ExpertQ2K = "expert_q2_k", StateArena, MatvecPush, 128;
    ExpertQ3K = "expert_q3_k", StateArena, MatvecPush, 128;
    ExpertQ4K = "expert_q4_k", StateArena, MatvecPush, 128;
    ExpertQ5K = "expert_q5_k", StateArena, MatvecPush, 128;
    ExpertQ6K = "expert_q6_k", StateArena, MatvecPush, 128;
    MatvecQ4_0Fast = "matvec_q4_0_fast", StateWeight, MatvecPush, 128;
    MatvecQ4_1Fast = "matvec_q4_1_fast", StateWeight, MatvecPush, 128;
    MatvecQ5_0Fast = "matvec_q5_0_fast", StateWeight, MatvecPush, 128;
    MatvecQ5_1Fast = "matvec_q5_1_fast", StateWeight, MatvecPush, 128;
    MatvecQ8_0Fast = "matvec_q8_0_fast", StateWeight, MatvecPush, 128;
    MatvecQ2KFast = "matvec_q2_k_fast", StateWeight, MatvecPush, 128;
    MatvecQ3KFast = "matvec_q3_k_fast", StateWeight, MatvecPush, 128;
    MatvecQ4KFast = "matvec_q4_k_fast", StateWeight, MatvecPush, 128;
    MatvecQ5KFast = "matvec_q5_k_fast", StateWeight, MatvecPush, 128;
    MatvecQ6KFast = "matvec_q6_k_fast", StateWeight, MatvecPush, 128;
    ExpertQ4_0Fast = "expert_q4_0_fast", StateArena, MatvecPush, 128;
    ExpertQ4_1Fast = "expert_q4_1_fast", StateArena, MatvecPush, 128;
    ExpertQ5_0Fast = "expert_q5_0_fast", StateArena, MatvecPush, 128;
    ExpertQ5_1Fast = "expert_q5_1_fast", StateArena, MatvecPush, 128;
    ExpertQ8_0Fast = "expert_q8_0_fast", StateArena, MatvecPush, 128;
    ExpertQ2KFast = "expert_q2_k_fast", StateArena, MatvecPush, 128;
    ExpertQ3KFast = "expert_q3_k_fast", StateArena, MatvecPush, 128;
    ExpertQ4KFast = "expert_q4_k_fast", StateArena, MatvecPush, 128;
    ExpertQ5KFast = "expert_q5_k_fast", StateArena, MatvecPush, 128;
    ExpertQ6KFast = "expert_q6_k_fast", StateArena, MatvecPush, 128;
    MatvecQ4_0Batch = "matvec_q4_0_fast_batch", StateWeight, MatvecPush, 128;
    MatvecQ5_0Batch = "matvec_q5_0_fast_batch", StateWeight, MatvecPush, 128;
    MatvecQ8_0Batch = "matvec_q8_0_fast_batch", StateWeight, MatvecPush, 128;
    MatvecQ2KBatch = "matvec_q2_k_fast_batch", StateWeight, MatvecPush, 128;
    MatvecQ4KBatch = "matvec_q4_k_fast_batch", StateWeight, MatvecPush, 128;
    MatvecQ6KBatch = "matvec_q6_k_fast_batch", StateWeight, MatvecPush, 128;
    ExpertQ4_0Batch = "expert_q4_0_fast_batch", StateArena, MatvecPush, 128;
    ExpertQ5_0Batch = "expert_q5_0_fast_batch", StateArena, MatvecPush, 128;
    ExpertQ8_0Batch = "expert_q8_0_fast_batch", StateArena, MatvecPush, 128;
    ExpertQ2KBatch = "expert_q2_k_fast_batch", StateArena, MatvecPush, 128;
    ExpertQ4KBatch = "expert_q4_k_fast_batch", StateArena, MatvecPush, 128;
    ExpertQ6KBatch = "expert_q6_k_fast_batch", StateArena, MatvecPush, 128;
    MmQ4_0 = "mm_q4_0", StateWeight, MatvecPush, 256;
    MmQ4_1 = "mm_q4_1", StateWeight, MatvecPush, 256;
    MmQ5_0 = "mm_q5_0", StateWeight, MatvecPush, 256;
    MmQ5_1 = "mm_q5_1", StateWeight, MatvecPush, 256;
    MmQ8_0 = "mm_q8_0", StateWeight, MatvecPush, 256;
    MmQ2K = "mm_q2_k", StateWeight, MatvecPush, 256;
    MmQ3K = "mm_q3_k", StateWeight, MatvecPush, 256;
    MmQ4K = "mm_q4_k", StateWeight, MatvecPush, 256;
    MmQ5K = "mm_q5_k", StateWeight, MatvecPush, 256;
    MmQ6K = "mm_q6_k", StateWeight, MatvecPush, 256;
    MmExpertQ4_0 = "mm_expert_q4_0", StateArena, MatvecPush, 256;
    MmExpertQ4_1 = "mm_expert_q4_1", StateArena, MatvecPush, 256;
    MmExpertQ5_0 = "mm_expert_q5_0", StateArena, MatvecPush, 256;
    MmExpertQ5_1 = "mm_expert_q5_1", StateArena, MatvecPush, 256;
    MmExpertQ8_0 = "mm_expert_q8_0", StateArena, MatvecPush, 256;
    MmExpertQ2K = "mm_expert_q2_k", StateArena, MatvecPush, 256;
    MmExpertQ3K = "mm_expert_q3_k", StateArena, MatvecPush, 256;
    MmExpertQ4K = "mm_expert_q4_k", StateArena, MatvecPush, 256;
    MmExpertQ5K = "mm_expert_q5_k", StateArena, MatvecPush, 256;
    MmExpertQ6K = "mm_expert_q6_k", StateArena, MatvecPush, 256;
    SplitSums = "split_sums", State, MatvecPush, 256;
    HcNorm = "hc_norm", State, HcNormPush, 256;
    HcCombine = "hc_combine", State, HcCombinePush, 64;
    PleMix = "ple_mix", State, PleMixPush, 256;
    GdnConv = "gdn_conv", State, GdnConvPush, 64;
    GdnRecurrent = "gdn_recurrent", State, GdnRecurrentPush, 128;
    GdnNorm = "gdn_norm", State, GdnNormPush, 128;
    GdnToken = "gdn_token", State, GdnTokenPush, 128;
    AttnPrep = "attn_prep", State, AttnPrepPush, 256;
    QsaIndex = "qsa_index", State, QsaIndexPush, 128;
    QsaScore = "qsa_score", State, QsaScorePush, 64;
    QsaTopk = "qsa_topk", State, QsaTopkPush, 256;
    Attention = "attention", State, AttentionPush, 256;
    MoeRoute = "moe_route", State, MoeRoutePush, 256;
    Router = "router", StateWeight, RouterPush, 64;
    RouterBatch = "router_batch", StateWeight, RouterPush, 256;
    MoeCombine = "moe_combine", State, MoeCombinePush, 256;
    MoeGroup = "moe_group", State, MoeGroupPush, 256;
    ActInt8 = "act_int8", State, ActInt8Push, 128;
}

impl Pipe {
    pub fn spec(self) -> &'static Spec {
        &TABLE[self as usize]
    }

    /// The matvec pipeline for weights of `ty` (plain or through the expert
    /// arena), the fast kernels when `fast` and `ty` is quantized.
    pub fn matvec(ty: GgmlType, arena: bool, fast: bool) -> Pipe {
        if fast {
            if let Some(p) = Self::fast_matvec(ty, arena) {
                return p;
            }
        }
        match (ty, arena) {
            (GgmlType::F32, false) => Pipe::MatvecF32,
            (GgmlType::F16, false) => Pipe::MatvecF16,
            (GgmlType::BF16, false) => Pipe::MatvecBf16,
            (GgmlType::Q4_0, false) => Pipe::MatvecQ4_0,
            (GgmlType::Q4_1, false) => Pipe::MatvecQ4_1,
            (GgmlType::Q5_0, false) => Pipe::MatvecQ5_0,
            (GgmlType::Q5_1, false) => Pipe::MatvecQ5_1,
            (GgmlType::Q8_0, false) => Pipe::MatvecQ8_0,
            (GgmlType::Q2K, false) => Pipe::MatvecQ2K,
            (GgmlType::Q3K, false) => Pipe::MatvecQ3K,
            (GgmlType::Q4K, false) => Pipe::MatvecQ4K,
            (GgmlType::Q5K, false) => Pipe::MatvecQ5K,
            (GgmlType::Q6K, false) => Pipe::MatvecQ6K,
            (GgmlType::F32, true) => Pipe::ExpertF32,
            (GgmlType::F16, true) => Pipe::ExpertF16,
            (GgmlType::BF16, true) => Pipe::ExpertBf16,
            (GgmlType::Q4_0, true) => Pipe::ExpertQ4_0,
            (GgmlType::Q4_1, true) => Pipe::ExpertQ4_1,
            (GgmlType::Q5_0, true) => Pipe::ExpertQ5_0,
            (GgmlType::Q5_1, true) => Pipe::ExpertQ5_1,
            (GgmlType::Q8_0, true) => Pipe::ExpertQ8_0,
            (GgmlType::Q2K, true) => Pipe::ExpertQ2K,
            (GgmlType::Q3K, true) => Pipe::ExpertQ3K,
            (GgmlType::Q4K, true) => Pipe::ExpertQ4K,
            (GgmlType::Q5K, true) => Pipe::ExpertQ5K,
            (GgmlType::Q6K, true) => Pipe::ExpertQ6K,
        }
    }

    /// The fast-kernel pipeline for `ty`, if it has one (the quantized types).
    fn fast_matvec(ty: GgmlType, arena: bool) -> Option<Pipe> {
        Some(match (ty, arena) {
            (GgmlType::Q4_0, false) => Pipe::MatvecQ4_0Fast,
            (GgmlType::Q4_1, false) => Pipe::MatvecQ4_1Fast,
            (GgmlType::Q5_0, false) => Pipe::MatvecQ5_0Fast,
            (GgmlType::Q5_1, false) => Pipe::MatvecQ5_1Fast,
            (GgmlType::Q8_0, false) => Pipe::MatvecQ8_0Fast,
            (GgmlType::Q2K, false) => Pipe::MatvecQ2KFast,
            (GgmlType::Q3K, false) => Pipe::MatvecQ3KFast,
            (GgmlType::Q4K, false) => Pipe::MatvecQ4KFast,
            (GgmlType::Q5K, false) => Pipe::MatvecQ5KFast,
            (GgmlType::Q6K, false) => Pipe::MatvecQ6KFast,
            (GgmlType::Q4_0, true) => Pipe::ExpertQ4_0Fast,
            (GgmlType::Q4_1, true) => Pipe::ExpertQ4_1Fast,
            (GgmlType::Q5_0, true) => Pipe::ExpertQ5_0Fast,
            (GgmlType::Q5_1, true) => Pipe::ExpertQ5_1Fast,
            (GgmlType::Q8_0, true) => Pipe::ExpertQ8_0Fast,
            (GgmlType::Q2K, true) => Pipe::ExpertQ2KFast,
            (GgmlType::Q3K, true) => Pipe::ExpertQ3KFast,
            (GgmlType::Q4K, true) => Pipe::ExpertQ4KFast,
            (GgmlType::Q5K, true) => Pipe::ExpertQ5KFast,
            (GgmlType::Q6K, true) => Pipe::ExpertQ6KFast,
            _ => return None,
        })
    }

    /// The matrix-matrix module for weights of `ty` (shaders/mm.comp), if it
    /// has one (`mm_<t>`, `mm_expert_<t>`: the quantized types).
    pub fn mm(ty: GgmlType, arena: bool) -> Option<Pipe> {
        let name = format!("mm_{}{}", if arena { "expert_" } else { "" }, ty.name().to_ascii_lowercase());
        TABLE.iter().position(|s| s.name == name).map(|i| TABLE_PIPES[i])
    }

    /// Whether this is a matrix-matrix module (created only where
    /// [`Pipelines::mm`]).
    pub fn is_mm(self) -> bool {
        self.spec().name.starts_with("mm_")
    }

    /// Whether this is a fast-kernel pipeline, a batch module or not
    /// (created only when the device has integer dot products and the fast
    /// kernels are chosen).
    pub fn is_fast(self) -> bool {
        self.spec().name.contains("_fast")
    }

    /// Whether this is a batch module of the fast kernels (entries of a tile
    /// share each weight decode; shaders/matvec.comp's BATCH).
    pub fn is_batch(self) -> bool {
        self.spec().name.ends_with("_fast_batch")
    }

    /// The batch module of a fast-kernel matvec (for the types that have one:
    /// `BATCH_TYPES` in build/shaders.rs); any other pipeline itself.
    pub fn batch(self) -> Pipe {
        match self {
            Pipe::MatvecQ4_0Fast => Pipe::MatvecQ4_0Batch,
            Pipe::MatvecQ5_0Fast => Pipe::MatvecQ5_0Batch,
            Pipe::MatvecQ8_0Fast => Pipe::MatvecQ8_0Batch,
            Pipe::MatvecQ2KFast => Pipe::MatvecQ2KBatch,
            Pipe::MatvecQ4KFast => Pipe::MatvecQ4KBatch,
            Pipe::MatvecQ6KFast => Pipe::MatvecQ6KBatch,
            Pipe::ExpertQ4_0Fast => Pipe::ExpertQ4_0Batch,
            Pipe::ExpertQ5_0Fast => Pipe::ExpertQ5_0Batch,
            Pipe::ExpertQ8_0Fast => Pipe::ExpertQ8_0Batch,
            Pipe::ExpertQ2KFast => Pipe::ExpertQ2KBatch,
            Pipe::ExpertQ4KFast => Pipe::ExpertQ4KBatch,
            Pipe::ExpertQ6KFast => Pipe::ExpertQ6KBatch,
            p => p,
        }
    }
}

/// How a matvec pipeline splits its work (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MatvecTuning {
    /// Invocations per workgroup (specialization constant 1).
    pub wg: u32,
    /// Output rows per row set (specialization constant 2).
    pub rows: u32,
    /// Work items per pass (specialization constant 3).
    pub unroll: u32,
    /// Invocations per row set, when fixed; otherwise chosen per dispatch.
    pub tpr: Option<u32>,
    /// The least work items per invocation when the recorder picks TPR.
    pub min_items: u32,
    /// Workgroups a dispatch should have at least: when the items rule
    /// leaves fewer (a small matrix, few long rows), the recorder doubles
    /// TPR until it has them (or TPR reaches the workgroup or the row's
    /// items), so a latency-bound matvec has more loads in flight. 0 = off.
    pub fill: u32,
    /// Tokens of a batch one workgroup takes in turn (push `tile`; 1 = a
    /// workgroup per token): its weight rows are read from memory once for
    /// them all. Plain matrices only (routed experts are (token, expert) pairs).
    pub tile: u32,
    /// Entries of a tile that share each weight decode (specialization
    /// constant 4, `SHARE`, of the batch modules; a pass of tokens runs the
    /// fast kernels' batch modules when it is above 1; 1 for the exact kernels).
    pub share: u32,
}

/// The defaults, in the syntax of the environment overrides:
/// (variable, default list).
const DEFAULTS: [(&str, &str); 8] = [
    ("FNX_VK_MATVEC_WG", "128"),
    ("FNX_VK_MATVEC_ROWS", "2"),
    ("FNX_VK_MATVEC_UNROLL", "1"),
    ("FNX_VK_MATVEC_TPR", ""),
    ("FNX_VK_MATVEC_ITEMS", "4"),
    ("FNX_VK_MATVEC_FILL", "256"),
    ("FNX_VK_MATVEC_TILE", "8"),
    // The 2-bit file's routed experts (Q2_K gate/up, Q4_0 down) ran slower in
    // the batch modules on the H200 (few pairs per expert; heavy per-entry state).
    ("FNX_VK_MATVEC_SHARE", "8,expert_q2_k_fast=1,expert_q4_0_fast=1"),
];

impl MatvecTuning {
    /// The tuning of pipeline `name`: the defaults, with the
    /// `FNX_VK_MATVEC_*` overrides that apply to it when `env`.
    pub fn for_pipeline(name: &str, env: bool) -> MatvecTuning {
        let get = |i: usize| {
            let (var, default) = DEFAULTS[i];
            let set = if env { std::env::var(var).ok().and_then(|list| tuning_entry(&list, name)) } else { None };
            set.or_else(|| tuning_entry(default, name))
        };
        MatvecTuning {
            wg: get(0).unwrap_or(128),
            rows: get(1).unwrap_or(2),
            unroll: get(2).unwrap_or(1),
            tpr: get(3),
            min_items: get(4).unwrap_or(4),
            fill: get(5).unwrap_or(256),
            tile: get(6).unwrap_or(8),
            share: get(7).unwrap_or(8),
        }
    }

    /// The defaults and environment overrides of pipeline `name`.
    pub fn from_env(name: &str) -> MatvecTuning {
        Self::for_pipeline(name, true)
    }

    /// Rounded to what `ctx` allows: a power-of-two workgroup of at least the
    /// subgroup size within the device limits, shared memory for the
    /// reduction (`WG / 4 * 2 * ROWS` floats, per entry of a batch module)
    /// within the limit, TPR a power of two no larger than the workgroup;
    /// for `pipe` (the batch modules: ROWS [`BATCH_ROWS`], SHARE at most
    /// [`BATCH_ENTRIES`]; the exact kernels: SHARE 1).
    fn fit(self, ctx: &Context, pipe: Pipe) -> MatvecTuning {
        let (fast, batch) = (pipe.is_fast(), pipe.is_batch());
        let l = &ctx.limits;
        let max_wg = l.max_compute_work_group_size[0].min(l.max_compute_work_group_invocations).min(1024);
        let pow2_floor = |v: u32| if v == 0 { 1 } else { 1 << (31 - v.leading_zeros()) };
        let mut wg = pow2_floor(self.wg.clamp(ctx.subgroup_size.max(4), max_wg.max(4)));
        // Leave room for common.glsl's reduction slots (and the fast kernels'
        // activations; the batch modules read theirs in place).
        let taken = if fast && !batch { FAST_SHARED_BYTES as u32 } else { 0 };
        let shared_floats = (l.max_compute_shared_memory_size.saturating_sub(taken) / 4).saturating_sub(64);
        let rows = if batch {
            // Halve the workgroup until the reduction slots fit.
            while wg > ctx.subgroup_size.max(4) && wg / 2 * BATCH_ROWS * BATCH_ENTRIES > shared_floats {
                wg /= 2;
            }
            BATCH_ROWS
        } else {
            self.rows.clamp(1, 16).min((shared_floats / (wg / 2)).max(1))
        };
        MatvecTuning {
            wg,
            rows,
            unroll: self.unroll.clamp(1, 8),
            tpr: self.tpr.map(|t| pow2_floor(t).min(wg)),
            min_items: self.min_items.max(1),
            fill: self.fill,
            tile: self.tile.clamp(1, 64),
            share: if fast { self.share.clamp(1, BATCH_ENTRIES) } else { 1 },
        }
    }

    /// log2 of the invocations per row set for rows of `items` work items.
    pub fn tpr_shift(&self, items: usize) -> u32 {
        let tpr = match self.tpr {
            Some(t) => t,
            None => {
                let want = (items / self.min_items as usize).clamp(1, self.wg as usize) as u32;
                1 << (31 - want.leading_zeros())
            }
        };
        tpr.min(self.wg).trailing_zeros()
    }

    /// Output rows one workgroup covers with `1 << tpr_shift` invocations per row set.
    pub fn rows_per_workgroup(&self, tpr_shift: u32) -> u32 {
        (self.wg >> tpr_shift).max(1) * self.rows
    }

    /// log2 of TPR for `rows` rows of `items` items, `grids` times (experts):
    /// [`MatvecTuning::tpr_shift`], doubled while the dispatch has fewer than
    /// `fill` workgroups (see the field).
    pub fn tpr_shift_filled(&self, items: usize, rows: usize, grids: usize) -> u32 {
        let mut shift = self.tpr_shift(items);
        if self.tpr.is_none() && self.fill > 0 {
            let groups = |s: u32| rows.div_ceil(self.rows_per_workgroup(s) as usize) * grids;
            while (1usize << shift) < (self.wg as usize).min(items) && groups(shift) < self.fill as usize {
                shift += 1;
            }
        }
        shift
    }
}

/// The value a `FNX_VK_MATVEC_*` list gives pipeline `name` (`matvec_q4_k`):
/// the entry naming the pipeline, else its type (`q4_k`), else its kind
/// (`matvec`), else a bare number.
fn tuning_entry(list: &str, name: &str) -> Option<u32> {
    let (kind, ty) = name.split_once('_').unwrap_or((name, ""));
    // The fast kernels of a type take its entries too (`q4_k` tunes
    // `matvec_q4_k_fast` and `matvec_q4_k_fast_batch`).
    let ty = ty.strip_suffix("_batch").unwrap_or(ty);
    let ty = ty.strip_suffix("_fast").unwrap_or(ty);
    let mut best: Option<(u32, u32)> = None;
    for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (rank, value) = match entry.split_once('=') {
            None => (0, entry),
            Some((n, v)) if n.trim() == name => (3, v),
            Some((n, v)) if n.trim() == ty => (2, v),
            Some((n, v)) if n.trim() == kind => (1, v),
            Some(_) => continue,
        };
        if let Ok(v) = value.trim().parse::<u32>() {
            if best.is_none() || best.is_some_and(|(r, _)| rank >= r) {
                best = Some((rank, v));
            }
        }
    }
    best.map(|(_, v)| v)
}

/// Entries of a batch module's tile that share each weight decode at most
/// (`NT` in shaders/matvec.comp with BATCH).
pub(crate) const BATCH_ENTRIES: u32 = 8;
/// Output rows per row set of the batch modules (their `ROWS`, fixed in the shader).
pub(crate) const BATCH_ROWS: u32 = 2;

/// Output rows of a workgroup's tile in shaders/mm.comp (`BM`; SwiGLU: half
/// gate rows, half up rows).
pub(crate) const MM_ROWS: usize = 128;
/// Entries of a workgroup's tile in shaders/mm.comp (`BN`): 128 tokens of a
/// plain matrix (each decoded weight serves them all), 32 (token, expert)
/// pairs of the routed experts (`arena`; a pass has a few pairs per
/// expert, which a tile runs one expert after another).
pub(crate) const fn mm_entries(arena: bool) -> u32 {
    if arena {
        32
    } else {
        128
    }
}
/// The most tiles moe_group.comp's table can hold for `pairs` (token,
/// expert) pairs of `ids` distinct ids in tiles of up to `tile` pairs of one
/// id each: every id's pairs in whole tiles, at most one partial tile an id.
pub(crate) fn max_expert_tiles(pairs: usize, ids: usize, tile: usize) -> usize {
    pairs.div_ceil(tile) + ids
}

/// Where the router module (shaders/router.comp) computes an F32 router's
/// logits ([`Pipelines::router`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RouterUse {
    Never,
    /// Passes of more than one token.
    Passes,
    Always,
}

/// Which routed-expert matrices of a pass run on the matrix-matrix modules
/// ([`Pipelines::mm_experts`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MmExperts {
    None,
    /// Every expert matrix but the 2- and 3-bit K-quants', not timed on
    /// these tiles (their experts run the plain fast modules).
    Timed,
    All,
}

impl MmExperts {
    /// Whether an expert matrix of `ty` runs on them.
    pub(crate) fn takes(self, ty: GgmlType) -> bool {
        match self {
            MmExperts::None => false,
            MmExperts::Timed => !matches!(ty, GgmlType::Q2K | GgmlType::Q3K),
            MmExperts::All => true,
        }
    }
}

/// Columns of one step of shaders/mm.comp (`BK`): its rows must be a multiple.
pub(crate) const MM_COLS: usize = 64;
/// Fewest steps of [`MM_COLS`] columns a split of a row takes on the
/// matrix-matrix modules ([`Pipelines::mm_split`]).
pub(crate) const MM_SPLIT_STEPS: usize = 8;

/// Longest rows the fast kernels take (`FAST_MAX_COLS` in
/// shaders/weights_int.glsl); longer rows use the exact pipelines.
pub(crate) const FAST_MAX_COLS: usize = 10240;
/// Shared memory the fast kernels' rounded activations take.
const FAST_SHARED_BYTES: usize = FAST_MAX_COLS + FAST_MAX_COLS / 32 * 4 + FAST_MAX_COLS / 16 * 4;
/// Floats of a region of activations rounded by act_int8.comp (`XQ_FLOATS`
/// in shaders/act_int8.glsl): levels, scales of 32, sums of 16.
pub(crate) const XQ_FLOATS: usize = FAST_MAX_COLS / 4 + FAST_MAX_COLS / 32 + FAST_MAX_COLS / 16;

/// The created pipelines and their descriptor-set layouts.
pub(crate) struct Pipelines {
    pub state_layout: vk::DescriptorSetLayout,
    pub weight_layout: vk::DescriptorSetLayout,
    pub arena_layout: vk::DescriptorSetLayout,
    /// Slab bindings of `arena_layout`.
    pub max_slabs: u32,
    pub layouts: Vec<vk::PipelineLayout>,
    pub pipelines: Vec<vk::Pipeline>,
    /// The work split of each pipeline (meaningful for the matvecs).
    pub tuning: Vec<MatvecTuning>,
    /// Whether the quantized matvecs run the fast kernels (8-bit
    /// activations, integer dot products; see shaders/weights_int.glsl): their
    /// pipelines exist only then.
    pub fast: bool,
    /// Whether a pass's quantized matrices run as matrix-matrix products on
    /// cooperative matrices (shaders/mm.comp; with the fast kernels, where
    /// [`Context::coopmat`]): their pipelines exist only then.
    pub mm: bool,
    /// Fewest entries (tokens, or a pass's expert pairs) a dispatch must have
    /// to run on the matrix-matrix modules; smaller batches run the
    /// matvecs. `FNX_VK_MM_MIN`, default 8.
    pub mm_min: usize,
    /// Fewest rows a plain matrix must have to run on the matrix-matrix
    /// modules (`FNX_VK_MM_MIN_ROWS`, default 1024: eight tiles of 128
    /// rows); fewer row tiles leave most of the card idle (the
    /// hyper-connection projections of 320 and 4 rows ran 3x slower there
    /// than on the batch modules).
    pub mm_rows: usize,
    /// Workgroups a plain matrix's pass on the matrix-matrix modules should
    /// fill at least by splitting its rows (`FNX_VK_MM_SPLIT`, default 256;
    /// 0: never split): a matrix of few row tiles and long rows then runs as
    /// row tiles x splits workgroups, each summing [`MM_SPLIT_STEPS`] or more
    /// steps of its rows, and shaders/split_sums.comp adds the splits.
    pub mm_split: usize,
    /// Fewest rows a plain matrix below [`Pipelines::mm_rows`] must have to
    /// run on the matrix-matrix modules with split rows
    /// (`FNX_VK_MM_SPLIT_ROWS`, default 256: the hyper-connection down
    /// projections' 320; their injection rows alone stay on the batch modules).
    pub mm_split_rows: usize,
    /// Fewest columns of a split of a plain quantized matrix's rows on the
    /// matvec modules (`FNX_VK_MATVEC_SPLIT`, e.g. 1024; 0, the default:
    /// never split): rows of at least four times that many columns are split
    /// where their row sets alone would leave the dispatch below its
    /// tuning's `fill` (the hyper-connection down projections: 324 rows of
    /// 10,240 values), in as many splits as the partial region allows each
    /// entry (`Recorder::matvec_splits`). Off by default: measured on an
    /// H100, a token's down projections took 11.6 and 10.5 us split at 1024
    /// (the last workgroups adding the ranges), 9.9 and 9.0 unsplit
    /// (docs/BENCHMARKS.md); a pass runs them on the tensor cores, split there.
    pub matvec_split: usize,
    /// Whether the last workgroup of each row group of a split matvec adds
    /// the splits itself (arrival counters in the scratch) rather than
    /// shaders/split_sums.comp in a dispatch and barrier of its own (the
    /// same sums, bit for bit; `FNX_VK_SPLIT_COUNTERS=0` turns it off).
    pub split_counters: bool,
    /// Which of the routed experts' matrices run on the matrix-matrix
    /// modules (`FNX_VK_MM_EXPERTS=0` none, `1` all; by default
    /// [`MmExperts::Timed`]: on an H100 at 512 tokens a pass the Q4_K
    /// gate/up projections took 0.117 against 0.206 ms per token on the
    /// batch modules, the Q5_0 down projections 0.064 against 0.078; see
    /// docs/BENCHMARKS.md). Q2_K and Q3_K experts stay off them by default:
    /// earlier tiles ran them 4x slower than their plain fast modules, and
    /// these have not been timed on them.
    pub mm_experts: MmExperts,
    /// Rows at least this long (`FNX_VK_ROUND_ONCE_COLS`, default 0: none)
    /// are rounded to 8 bits once for one token's fast matvec (act_int8,
    /// one more dispatch) and copied by its workgroups, as a pass's are,
    /// instead of rounded by every workgroup. Measured on an H100, the
    /// matvecs of 6144 and 10240 columns gained 2-3 us and the dispatch cost
    /// 5.2: a loss unless the producer rounds (see `hc_round`).
    pub round_once_cols: usize,
    /// Whether one token's hyper-connection norm also writes its output
    /// rounded to 8 bits for the down projection's fast kernels, whose
    /// workgroups then copy it instead of each rounding all 10240 values
    /// (`FNX_VK_HC_ROUND=0` turns it off; on by default: measured on an
    /// H100, the down projections 2.8-3.2 us faster, the norm 1.1 us slower).
    pub hc_round: bool,
    /// Whether one token's hyper-connection up projection also combines the
    /// streams into the block input (matvec mode 5: rows walked
    /// stream-interleaved, the combine as its epilogue, bit for bit
    /// hc_combine's sums) instead of a separate hc_combine dispatch
    /// (`FNX_VK_HC_FUSE=0` turns it off).
    pub hc_fuse: bool,
    /// Where an F32 router's logits run on shaders/router.comp (one order
    /// of operations for a token and a pass, whose pass tiles tokens by
    /// experts) instead of the F32 matvec (`FNX_VK_ROUTER`: `1` a token and
    /// a pass, `0` neither). By default a pass on the tensor cores takes it
    /// (such a pass rounds otherwise than token by token already: measured on
    /// an H100, its router 383 -> 198 us a layer, pp512 2-4 % faster) and a
    /// token the matvec (its one-token module 24.2 against 10.2 us: docs/BENCHMARKS.md).
    pub router: RouterUse,
    /// shaders/gdn_recurrent.comp's invocations per state column ([`gdn_lanes`]).
    pub gdn_lanes: u32,
    /// Whether one token's Gated DeltaNet after its input projections (conv,
    /// delta rule, gated norm) is one dispatch (module gdn_token: the conv
    /// computed where it is read, the norm by each head's last workgroup,
    /// the three stages' bits) where the arrival counters are on
    /// ([`Pipelines::split_counters`]); `FNX_VK_GDN_FUSE=0` keeps the three
    /// dispatches.
    pub gdn_fuse: bool,
    ctx: Arc<Context>,
}

fn set_layout(ctx: &Context, counts: &[u32]) -> Result<vk::DescriptorSetLayout> {
    let bindings: Vec<_> = counts
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            vk::DescriptorSetLayoutBinding::default()
                .binding(i as u32)
                .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                .descriptor_count(n)
                .stage_flags(vk::ShaderStageFlags::COMPUTE)
        })
        .collect();
    // SAFETY: valid device and create info.
    unsafe { ctx.device.create_descriptor_set_layout(&vk::DescriptorSetLayoutCreateInfo::default().bindings(&bindings), None) }
        .map_err(err("creating a descriptor set layout"))
}

/// Invocations per column of a GDN head's state in shaders/gdn_recurrent.comp
/// (adjacent lanes of a subgroup; a workgroup of 128 takes 128 / lanes
/// columns): 4 on a GPU, 2 on a CPU device, whose invocations are SIMD
/// lanes of a few threads, so twice as many repeat the per-token scalar
/// work twice as often (lavapipe: tests/prefill.rs's Vulkan golden test 97 s
/// with 2, 131 with 4, measured on the shader's first form);
/// `FNX_VK_GDN_LANES` (2, 4 or 8) within the subgroup size.
fn gdn_lanes(ctx: &Context) -> u32 {
    let want = std::env::var("FNX_VK_GDN_LANES").ok().and_then(|v| v.parse::<u32>().ok()).filter(|v| [2, 4, 8].contains(v));
    let mut lanes = want.unwrap_or(if ctx.on_cpu { 2 } else { 4 });
    while lanes > 2 && lanes > ctx.subgroup_size {
        lanes /= 2;
    }
    lanes
}

impl Pipelines {
    /// Every pipeline, the matvecs tuned by the defaults and
    /// `FNX_VK_MATVEC_*`; the fast kernels when `fast` (which the device must
    /// support: [`Context::int_dot`]), and with them the matrix-matrix
    /// modules when `mm` (which it must support too: [`Context::coopmat`]).
    pub fn new(ctx: &Arc<Context>, fast: bool, mm: bool) -> Result<Pipelines> {
        Self::with_mm(ctx, fast, mm, MatvecTuning::from_env)
    }

    /// Every pipeline but the matrix-matrix modules, the matvecs tuned by
    /// `tuning(name)` (rounded to the device's limits).
    #[cfg(test)]
    pub fn tuned(ctx: &Arc<Context>, fast: bool, tuning: impl Fn(&str) -> MatvecTuning) -> Result<Pipelines> {
        Self::with_mm(ctx, fast, false, tuning)
    }

    /// [`Pipelines::tuned`], with the matrix-matrix modules when `mm`.
    pub fn with_mm(ctx: &Arc<Context>, fast: bool, mm: bool, tuning: impl Fn(&str) -> MatvecTuning) -> Result<Pipelines> {
        Self::build(ctx, fast, mm, tuning, gdn_lanes(ctx))
    }

    /// The exact kernels' pipelines with gdn_recurrent at `lanes` invocations
    /// per column (2, 4 or 8; the twins run every one).
    #[cfg(test)]
    pub fn with_gdn_lanes(ctx: &Arc<Context>, lanes: u32) -> Result<Pipelines> {
        Self::build(ctx, false, false, MatvecTuning::from_env, lanes)
    }

    fn build(ctx: &Arc<Context>, fast: bool, mm: bool, tuning: impl Fn(&str) -> MatvecTuning, gdn_lanes: u32) -> Result<Pipelines> {
        if fast && !ctx.int_dot.supported {
            return Err(crate::Error::Backend(format!("Vulkan device {} has no integer dot products for the fast kernels", ctx.name)));
        }
        if mm && !(fast && ctx.coopmat) {
            return Err(crate::Error::Backend(format!("Vulkan device {}: matrix-matrix modules need cooperative matrices and the fast kernels", ctx.name)));
        }
        let mut p = Pipelines {
            state_layout: set_layout(ctx, &[1, 1, 1])?,
            weight_layout: vk::DescriptorSetLayout::null(),
            arena_layout: vk::DescriptorSetLayout::null(),
            max_slabs: max_slabs(ctx),
            layouts: Vec::new(),
            pipelines: Vec::new(),
            tuning: Vec::new(),
            fast,
            mm,
            mm_min: std::env::var("FNX_VK_MM_MIN").ok().and_then(|v| v.parse().ok()).unwrap_or(8).max(2),
            mm_rows: std::env::var("FNX_VK_MM_MIN_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(1024),
            mm_split: std::env::var("FNX_VK_MM_SPLIT").ok().and_then(|v| v.parse().ok()).unwrap_or(256),
            mm_split_rows: std::env::var("FNX_VK_MM_SPLIT_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(256),
            matvec_split: std::env::var("FNX_VK_MATVEC_SPLIT").ok().and_then(|v| v.parse().ok()).unwrap_or(0),
            split_counters: std::env::var("FNX_VK_SPLIT_COUNTERS").map_or(true, |v| v != "0"),
            mm_experts: match std::env::var("FNX_VK_MM_EXPERTS").as_deref() {
                Ok("0") => MmExperts::None,
                Ok("1") => MmExperts::All,
                _ => MmExperts::Timed,
            },
            round_once_cols: std::env::var("FNX_VK_ROUND_ONCE_COLS").ok().and_then(|v| v.parse().ok()).unwrap_or(0),
            hc_round: std::env::var("FNX_VK_HC_ROUND").map_or(true, |v| v != "0"),
            hc_fuse: std::env::var("FNX_VK_HC_FUSE").map_or(true, |v| v != "0"),
            router: match std::env::var("FNX_VK_ROUTER").as_deref() {
                Ok("1") => RouterUse::Always,
                Ok("0") => RouterUse::Never,
                _ if mm => RouterUse::Passes,
                _ => RouterUse::Never,
            },
            gdn_lanes,
            gdn_fuse: std::env::var("FNX_VK_GDN_FUSE").map_or(true, |v| v != "0"),
            ctx: ctx.clone(),
        };
        p.weight_layout = set_layout(ctx, &[1])?;
        p.arena_layout = set_layout(ctx, &[p.max_slabs])?;
        for (i, spec) in TABLE.iter().enumerate() {
            let pipe = TABLE_PIPES[i];
            let t = tuning(spec.name).fit(ctx, pipe);
            p.tuning.push(t);
            if (pipe.is_fast() && !fast) || (pipe.is_mm() && !mm) {
                // Never bound (the recorder asks for fast pipelines only when
                // `fast`, matrix-matrix ones only when `mm`).
                p.layouts.push(vk::PipelineLayout::null());
                p.pipelines.push(vk::Pipeline::null());
                continue;
            }
            p.create(spec, t)?;
        }
        Ok(p)
    }

    fn create(&mut self, spec: &Spec, tuning: MatvecTuning) -> Result<()> {
        // A shader built from other sources than this build's mirrors would
        // read its push constants wrong: refuse it here, with the difference.
        let spirv = spirv_override(spec.name)?;
        let spirv = spirv.as_deref().unwrap_or(spec.spirv);
        let shader = super::reflect::push_constants(spirv).map_err(|e| crate::Error::Backend(format!("{}: {e}", spec.name)))?;
        if !super::reflect::same(&shader, spec.fields) {
            return Err(crate::Error::Backend(format!(
                "{}: the shader's push constants {shader:?} differ from this build's {:?}",
                spec.name, spec.fields
            )));
        }
        let d = &self.ctx.device;
        let sets: Vec<_> = match spec.sets {
            Sets::State => vec![self.state_layout],
            Sets::StateWeight => vec![self.state_layout, self.weight_layout],
            Sets::StateArena => vec![self.state_layout, self.arena_layout],
        };
        let ranges = [vk::PushConstantRange::default().stage_flags(vk::ShaderStageFlags::COMPUTE).size(spec.push_size as u32)];
        let words = ash::util::read_spv(&mut std::io::Cursor::new(spirv)).map_err(|e| crate::Error::Backend(format!("{}: malformed SPIR-V ({e})", spec.name)))?;
        // SAFETY: valid device, SPIR-V from glslc, create infos outlive the calls.
        unsafe {
            let layout = d
                .create_pipeline_layout(&vk::PipelineLayoutCreateInfo::default().set_layouts(&sets).push_constant_ranges(&ranges), None)
                .map_err(err(spec.name))?;
            self.layouts.push(layout);
            let module = d.create_shader_module(&vk::ShaderModuleCreateInfo::default().code(&words), None).map_err(err(spec.name))?;
            // Constants 0 (MAX_SLABS), 1 (workgroup size), 2 (ROWS), 3 (UNROLL), 4 (SHARE),
            // 5 (gdn_recurrent's and gdn_token's LANES); a module ignores those it lacks (the
            // other state shaders have none).
            let constants = [self.max_slabs, tuning.wg, tuning.rows, tuning.unroll, tuning.share, self.gdn_lanes];
            let data: Vec<u8> = constants.iter().flat_map(|v| v.to_le_bytes()).collect();
            let entries: Vec<_> = (0..constants.len() as u32)
                .map(|i| vk::SpecializationMapEntry { constant_id: i, offset: 4 * i, size: 4 })
                .collect();
            let special = vk::SpecializationInfo::default().map_entries(&entries).data(&data);
            let stage = vk::PipelineShaderStageCreateInfo::default()
                .stage(vk::ShaderStageFlags::COMPUTE)
                .module(module)
                .name(c"main")
                .specialization_info(&special);
            let stats = self.ctx.pipeline_stats.as_deref().is_some_and(|f| f == "1" || spec.name.contains(f));
            let flags = if stats { vk::PipelineCreateFlags::CAPTURE_STATISTICS_KHR } else { vk::PipelineCreateFlags::empty() };
            let info = [vk::ComputePipelineCreateInfo::default().flags(flags).stage(stage).layout(layout)];
            let made = d.create_compute_pipelines(vk::PipelineCache::null(), &info, None);
            d.destroy_shader_module(module, None);
            let pipeline = made.map_err(|(_, e)| err(spec.name)(e))?[0];
            self.pipelines.push(pipeline);
            if stats {
                eprintln!("pipeline {}: {}", spec.name, pipeline_statistics(&self.ctx, pipeline));
            }
        }
        Ok(())
    }
}

/// The compiler's statistics of `pipeline` (created with
/// `CAPTURE_STATISTICS_KHR` on a device with
/// `VK_KHR_pipeline_executable_properties`) as `name value` pairs, for
/// `FNX_VK_PIPELINE_STATS` ([`Context::pipeline_stats`]).
fn pipeline_statistics(ctx: &Context, pipeline: vk::Pipeline) -> String {
    let fns = ash::khr::pipeline_executable_properties::Device::new(&ctx.instance, &ctx.device);
    let info = vk::PipelineInfoKHR::default().pipeline(pipeline);
    // SAFETY: a live pipeline of this device, created capturing statistics; the
    // output arrays are sized by the count queries (ash does both calls).
    let executables = unsafe { fns.get_pipeline_executable_properties(&info) }.unwrap_or_default();
    (0..executables.len() as u32)
        .flat_map(|i| {
            let exe = vk::PipelineExecutableInfoKHR::default().pipeline(pipeline).executable_index(i);
            unsafe { fns.get_pipeline_executable_statistics(&exe) }.unwrap_or_default()
        })
        .map(|st| {
            let name = st.name_as_c_str().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            // SAFETY: the union member the statistic's format names.
            let value = unsafe {
                match st.format {
                    vk::PipelineExecutableStatisticFormatKHR::BOOL32 => st.value.b32.to_string(),
                    vk::PipelineExecutableStatisticFormatKHR::INT64 => st.value.i64.to_string(),
                    vk::PipelineExecutableStatisticFormatKHR::UINT64 => st.value.u64.to_string(),
                    _ => format!("{:.1}", st.value.f64),
                }
            };
            format!("{name} {value}")
        })
        .collect::<Vec<_>>()
        .join(", ")
}

impl Drop for Pipelines {
    fn drop(&mut self) {
        let d = &self.ctx.device;
        // SAFETY: no command buffer using these is pending (owners wait on their fences).
        unsafe {
            for &p in &self.pipelines {
                d.destroy_pipeline(p, None);
            }
            for &l in &self.layouts {
                d.destroy_pipeline_layout(l, None);
            }
            for l in [self.state_layout, self.weight_layout, self.arena_layout] {
                d.destroy_descriptor_set_layout(l, None);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuning_lists_pick_the_most_specific_entry() {
        let list = "4, q8_0=2, expert_q5_0=1, expert=3";
        assert_eq!(tuning_entry(list, "matvec_q4_k"), Some(4));
        assert_eq!(tuning_entry(list, "matvec_q8_0"), Some(2));
        assert_eq!(tuning_entry(list, "expert_q8_0"), Some(2));
        assert_eq!(tuning_entry(list, "expert_q5_0"), Some(1));
        assert_eq!(tuning_entry(list, "expert_q4_k"), Some(3));
        assert_eq!(tuning_entry("q4_k=8", "matvec_q6_k"), None);
        assert_eq!(tuning_entry(list, "expert_q5_0_fast"), Some(3));
        assert_eq!(tuning_entry("q4_k=8", "matvec_q4_k_fast"), Some(8));
        assert_eq!(tuning_entry("q4_k=8,matvec_q4_k_fast=2", "matvec_q4_k_fast"), Some(2));
        assert_eq!(tuning_entry("junk", "matvec_q6_k"), None);
    }

    #[test]
    fn defaults_per_type() {
        let q4 = MatvecTuning::for_pipeline("matvec_q4_k", false);
        assert_eq!((q4.wg, q4.rows, q4.unroll, q4.tpr, q4.min_items, q4.fill), (128, 2, 1, None, 4, 256));
        assert_eq!(MatvecTuning::for_pipeline("expert_q2_k", false).unroll, 1);
        assert_eq!(MatvecTuning::for_pipeline("matvec_q8_0", false).unroll, 1);
        // Which passes run the batch modules (the recorder reads the fast pipeline's share).
        let share = |name| MatvecTuning::for_pipeline(name, false).share;
        assert_eq!((share("matvec_q2_k_fast"), share("expert_q4_k_fast"), share("expert_q5_0_fast")), (8, 8, 8));
        assert_eq!((share("expert_q2_k_fast"), share("expert_q4_0_fast")), (1, 1));
    }

    #[test]
    fn matrix_matrix_modules_for_the_quantized_types() {
        for ty in crate::quant::QUANT_TYPES {
            for arena in [false, true] {
                let p = Pipe::mm(ty, arena).unwrap_or_else(|| panic!("{ty} (arena {arena}): no matrix-matrix module"));
                assert!(p.is_mm() && (p.spec().sets == Sets::StateArena) == arena, "{ty}: {}", p.spec().name);
            }
        }
        assert_eq!(Pipe::mm(GgmlType::F32, false), None);
        assert_eq!(Pipe::mm(GgmlType::BF16, true), None);
    }

    #[test]
    fn threads_per_row_leave_min_items_each() {
        let t = MatvecTuning::for_pipeline("matvec_q4_k", false);
        // 2560-wide rows: Q6_K 80 items, Q8_0 160, Q2_K and Q4_K 40; 640-wide Q5_0 20.
        assert_eq!([80, 160, 40, 20, 1].map(|n| 1u32 << t.tpr_shift(n)), [16, 32, 8, 4, 1]);
        assert_eq!(1 << t.tpr_shift(100_000), t.wg);
        let forced = MatvecTuning { tpr: Some(8), ..t };
        assert_eq!(forced.tpr_shift(80), 3);
        assert_eq!(forced.rows_per_workgroup(3), 128 / 8 * 2);
        assert_eq!(forced.tpr_shift_filled(80, 10, 1), 3, "a forced TPR stays");
    }

    #[test]
    fn small_dispatches_fill_the_device() {
        let t = MatvecTuning::for_pipeline("matvec_q8_0", false);
        // The shared expert's gate/up (1280 rows of 160 items): 32 -> 128 per set, 80 -> 320 workgroups.
        assert_eq!(1 << t.tpr_shift_filled(160, 640, 1), 128);
        // Its down (2560 rows of 40 items): 8 -> 32.
        assert_eq!(1 << t.tpr_shift_filled(40, 2560, 1), 32);
        // Large or many: unchanged (the LM head; eleven experts' gate/up).
        assert_eq!(1 << t.tpr_shift_filled(160, 248_320, 1), 32);
        assert_eq!(1 << t.tpr_shift_filled(80, 640, 11), 16);
        // Never past the row's items or the workgroup.
        assert_eq!(1 << t.tpr_shift_filled(3, 10, 1), 4);
        assert_eq!(1 << t.tpr_shift_filled(100_000, 1, 1), 128);
        let off = MatvecTuning { fill: 0, ..t };
        assert_eq!(1 << off.tpr_shift_filled(160, 640, 1), 32);
    }
}
