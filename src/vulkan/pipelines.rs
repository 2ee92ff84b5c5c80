//! Every compute pipeline, from one table: its SPIR-V (compiled by
//! `build.rs` from `shaders/`), its descriptor sets, its push-constant block
//! (mirrored here by a `#[repr(C)]` struct) and its workgroup size.
//! [`Recorder::dispatch`](super::record::Recorder::dispatch) checks all three.
//!
//! Set 0 of every pipeline is the per-layer state set (scratch, layer state,
//! model parameters); matvecs add set 1 with one weight buffer, the expert
//! matvecs set 1 with the arena's slabs.

use super::device::{err, Context};
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
    fn bytes(&self) -> &[u8] {
        // SAFETY: implementors are repr(C) structs of 4-byte scalars (no padding).
        unsafe { std::slice::from_raw_parts((self as *const Self).cast::<u8>(), std::mem::size_of::<Self>()) }
    }
}

macro_rules! push_block {
    ($(#[$m:meta])* $name:ident { $($field:ident: $ty:ty),* $(,)? }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Default, Debug)]
        pub(crate) struct $name { $(pub $field: $ty),* }
        impl Push for $name {}
    };
}

push_block!(/// shaders/matvec.comp
MatvecPush { rows: u32, cols: u32, row_bytes: u32, row_base: u32, x_off: u32, y_off: u32, mode: u32, scale: f32,
    aux_off: u32, aux_n: u32, total_rows: u32, expert_off: u32, x_stride: u32, y_stride: u32, slot_table: u32,
    slots_per_slab: u32, slot_bytes: u32, part_off: u32, split_row: u32 });
push_block!(/// shaders/hc_norm.comp
HcNormPush { x_off: u32, gamma: u32, y_off: u32, n: u32, eps: f32 });
push_block!(/// shaders/hc_combine.comp
HcCombinePush { mix_off: u32, xn_off: u32, y_off: u32, n: u32, streams: u32 });
push_block!(/// shaders/ple_mix.comp
PleMixPush { key_off: u32, value_off: u32, res_off: u32, tmp_off: u32, norm_key: u32, norm_query: u32, norm_conv: u32,
    conv: u32, h: u32, streams: u32, kernel: u32, dilation: u32, eps: f32 });
push_block!(/// shaders/gdn_conv.comp
GdnConvPush { x_off: u32, y_off: u32, taps: u32, dc: u32, kc: u32 });
push_block!(/// shaders/gdn_recurrent.comp
GdnRecurrentPush { conv_off: u32, z_off: u32, b_off: u32, a_off: u32, y_off: u32, nk: u32, nv: u32, d: u32, rec_off: u32,
    decay_a: u32, dt_bias: u32, norm: u32, gate_silu: u32, eps: f32 });
push_block!(/// shaders/attn_prep.comp
AttnPrepPush { qg_off: u32, k_off: u32, v_off: u32, q_off: u32, q_norm: u32, k_norm: u32, rope: u32, half_dims: u32,
    hd: u32, nh: u32, nkv: u32, keys_off: u32, values_off: u32, pos: u32, eps: f32 });
push_block!(/// shaders/qsa_index.comp
QsaIndexPush { key_off: u32, query_off: u32, q_norm: u32, k_norm: u32, rope: u32, block_rope: u32, half_dims: u32,
    id: u32, heads: u32, ratio: u32, raw_keys: u32, block_keys: u32, pos: u32, block: u32, eps: f32 });
push_block!(/// shaders/qsa_score.comp
QsaScorePush { query_off: u32, block_keys: u32, score_off: u32, n_blocks: u32, heads: u32, id: u32, scale: f32 });
push_block!(/// shaders/qsa_topk.comp
QsaTopkPush { score_off: u32, sel_off: u32, n_blocks: u32, keep: u32 });
push_block!(/// shaders/attention.comp
AttentionPush { q_off: u32, qg_off: u32, keys_off: u32, values_off: u32, sel_off: u32, tmp_off: u32, tmp_stride: u32,
    y_off: u32, keep: u32, ratio: u32, tail_start: u32, n_tail: u32, hd: u32, nh: u32, nkv: u32, scale: f32 });
push_block!(/// shaders/moe_route.comp
MoeRoutePush { logits_off: u32, ids_off: u32, w_off: u32, n_experts: u32, k: u32, shared_in_arena: u32, x_off: u32,
    shared_gate: u32, h: u32 });
push_block!(/// shaders/moe_combine.comp
MoeCombinePush { y_off: u32, w_off: u32, shared_off: u32, x_off: u32, shared_gate: u32, res_off: u32, inject_off: u32,
    h: u32, k: u32, streams: u32, shared_separate: u32 });

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
    spirv: &'static [u8],
    pub sets: Sets,
    pub push_size: usize,
    /// Invocations per workgroup (`local_size_x` of the shader).
    pub workgroup: u32,
}

macro_rules! spirv {
    ($name:literal) => {
        include_bytes!(concat!(env!("OUT_DIR"), "/", $name, ".spv"))
    };
}

macro_rules! pipes {
    ($($variant:ident = $name:literal, $sets:ident, $push:ty, $wg:literal;)*) => {
        /// A pipeline of the table.
        #[derive(Clone, Copy, PartialEq, Eq, Debug)]
        pub(crate) enum Pipe { $($variant),* }
        pub(crate) const TABLE: &[Spec] = &[$(Spec {
            name: $name, spirv: spirv!($name), sets: Sets::$sets, push_size: std::mem::size_of::<$push>(), workgroup: $wg,
        }),*];
    };
}

pipes! {
    MatvecF32 = "matvec_f32", StateWeight, MatvecPush, 64;
    MatvecF16 = "matvec_f16", StateWeight, MatvecPush, 64;
    MatvecBf16 = "matvec_bf16", StateWeight, MatvecPush, 64;
    MatvecQ8_0 = "matvec_q8_0", StateWeight, MatvecPush, 64;
    ExpertF32 = "expert_f32", StateArena, MatvecPush, 64;
    ExpertF16 = "expert_f16", StateArena, MatvecPush, 64;
    ExpertBf16 = "expert_bf16", StateArena, MatvecPush, 64;
    ExpertQ8_0 = "expert_q8_0", StateArena, MatvecPush, 64;
    HcNorm = "hc_norm", State, HcNormPush, 256;
    HcCombine = "hc_combine", State, HcCombinePush, 64;
    PleMix = "ple_mix", State, PleMixPush, 256;
    GdnConv = "gdn_conv", State, GdnConvPush, 64;
    GdnRecurrent = "gdn_recurrent", State, GdnRecurrentPush, 128;
    AttnPrep = "attn_prep", State, AttnPrepPush, 256;
    QsaIndex = "qsa_index", State, QsaIndexPush, 128;
    QsaScore = "qsa_score", State, QsaScorePush, 64;
    QsaTopk = "qsa_topk", State, QsaTopkPush, 256;
    Attention = "attention", State, AttentionPush, 256;
    MoeRoute = "moe_route", State, MoeRoutePush, 256;
    MoeCombine = "moe_combine", State, MoeCombinePush, 256;
}

impl Pipe {
    pub fn spec(self) -> &'static Spec {
        &TABLE[self as usize]
    }

    /// The matvec pipeline for weights of `ty` (plain or through the expert arena).
    pub fn matvec(ty: GgmlType, arena: bool) -> Option<Pipe> {
        Some(match (ty, arena) {
            (GgmlType::F32, false) => Pipe::MatvecF32,
            (GgmlType::F16, false) => Pipe::MatvecF16,
            (GgmlType::BF16, false) => Pipe::MatvecBf16,
            (GgmlType::Q8_0, false) => Pipe::MatvecQ8_0,
            (GgmlType::F32, true) => Pipe::ExpertF32,
            (GgmlType::F16, true) => Pipe::ExpertF16,
            (GgmlType::BF16, true) => Pipe::ExpertBf16,
            (GgmlType::Q8_0, true) => Pipe::ExpertQ8_0,
            _ => return None,
        })
    }
}

/// The created pipelines and their descriptor-set layouts.
pub(crate) struct Pipelines {
    pub state_layout: vk::DescriptorSetLayout,
    pub weight_layout: vk::DescriptorSetLayout,
    pub arena_layout: vk::DescriptorSetLayout,
    /// Slab bindings of `arena_layout`.
    pub max_slabs: u32,
    pub layouts: Vec<vk::PipelineLayout>,
    pub pipelines: Vec<vk::Pipeline>,
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

impl Pipelines {
    pub fn new(ctx: &Arc<Context>) -> Result<Pipelines> {
        let mut p = Pipelines {
            state_layout: set_layout(ctx, &[1, 1, 1])?,
            weight_layout: vk::DescriptorSetLayout::null(),
            arena_layout: vk::DescriptorSetLayout::null(),
            max_slabs: max_slabs(ctx),
            layouts: Vec::new(),
            pipelines: Vec::new(),
            ctx: ctx.clone(),
        };
        p.weight_layout = set_layout(ctx, &[1])?;
        p.arena_layout = set_layout(ctx, &[p.max_slabs])?;
        for spec in TABLE {
            p.create(spec)?;
        }
        Ok(p)
    }

    fn create(&mut self, spec: &Spec) -> Result<()> {
        let d = &self.ctx.device;
        let sets: Vec<_> = match spec.sets {
            Sets::State => vec![self.state_layout],
            Sets::StateWeight => vec![self.state_layout, self.weight_layout],
            Sets::StateArena => vec![self.state_layout, self.arena_layout],
        };
        let ranges = [vk::PushConstantRange::default().stage_flags(vk::ShaderStageFlags::COMPUTE).size(spec.push_size as u32)];
        let words = ash::util::read_spv(&mut std::io::Cursor::new(spec.spirv)).expect("build.rs writes valid SPIR-V");
        // SAFETY: valid device, SPIR-V from glslc, create infos outlive the calls.
        unsafe {
            let layout = d
                .create_pipeline_layout(&vk::PipelineLayoutCreateInfo::default().set_layouts(&sets).push_constant_ranges(&ranges), None)
                .map_err(err(spec.name))?;
            self.layouts.push(layout);
            let module = d.create_shader_module(&vk::ShaderModuleCreateInfo::default().code(&words), None).map_err(err(spec.name))?;
            let slabs = self.max_slabs.to_le_bytes();
            let entries = [vk::SpecializationMapEntry { constant_id: 0, offset: 0, size: 4 }];
            let special = vk::SpecializationInfo::default().map_entries(&entries).data(&slabs);
            let mut stage =
                vk::PipelineShaderStageCreateInfo::default().stage(vk::ShaderStageFlags::COMPUTE).module(module).name(c"main");
            if spec.sets == Sets::StateArena {
                stage = stage.specialization_info(&special);
            }
            let info = [vk::ComputePipelineCreateInfo::default().stage(stage).layout(layout)];
            let made = d.create_compute_pipelines(vk::PipelineCache::null(), &info, None);
            d.destroy_shader_module(module, None);
            self.pipelines.push(made.map_err(|(_, e)| err(spec.name)(e))?[0]);
        }
        Ok(())
    }
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
