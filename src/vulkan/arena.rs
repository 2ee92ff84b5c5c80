//! The expert arena: routed experts live in fixed-size slots, each holding
//! one expert's gate and up rows as one part and its down rows as another
//! (`[2F][H] | [H][F]`, each part in the device layout of
//! [`super::layout`], the down part at the gate/up part's size). Layers may
//! store their experts in different types (llama-quantize's presets give the
//! "more bits" layers a wider down type); a slot is as large as the largest
//! layer's. Slots are carved from slabs (buffers of at most one
//! storage-buffer binding, as many as the device lets a stage bind: 28 on
//! lavapipe, 256 elsewhere; all bound at once in one descriptor set written
//! here). A slot table in the model parameters
//! maps (layer, expert) to a slot; the expert matvecs read the chosen ids
//! from GPU memory and index the arena through it, so a token's top-k
//! experts cost one dispatch for gate/up and one for down.
//!
//! When the shared expert has the routed experts' shape and types (the real
//! model: both 640 wide) it takes slot-table entry `E` of its layer and runs
//! in the same two dispatches as the chosen k; otherwise it stays outside
//! the arena as ordinary resident weights.
//!
//! Today every expert is resident (slot = layer * per_layer + expert). A
//! budget smaller than the model keeps the same shaders: fewer slots than
//! experts, the slot table rewritten as experts are paged in from the mmap
//! (the router's choice read back, missing experts uploaded into evicted
//! slots, then the expert dispatches run), the shared experts, which every
//! token uses, pinned.

use super::buffer::{Buffer, Commands};
use super::device::Context;
use super::layout::PartLayout;
use super::matrix::{max_binding_bytes, part_layout};
use super::pipelines::Pipelines;
use super::record::DescriptorPool;
use crate::error::{Error, Result};
use crate::gguf::GgmlType;
use crate::model::weights::{ExpertGateUp, Moe};
use crate::model::Config;
use gpu_allocator::MemoryLocation;
use std::sync::Arc;

/// One layer's expert types and part layouts.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ArenaLayer {
    /// Type of the gate/up rows and of the down rows (a converter may keep
    /// rows whose length is not a multiple of the block size unquantized).
    pub gate_ty: GgmlType,
    pub down_ty: GgmlType,
    /// Gate rows then up rows: `2F` rows of `H`.
    pub gate: PartLayout,
    /// `H` rows of `F`, at byte `gate.bytes` of the slot.
    pub down: PartLayout,
}

impl ArenaLayer {
    pub fn new(gate_ty: GgmlType, down_ty: GgmlType, h: usize, f: usize) -> Result<ArenaLayer> {
        Ok(ArenaLayer {
            gate_ty,
            down_ty,
            gate: part_layout("routed expert gate/up", gate_ty, 2 * f, h)?,
            down: part_layout("routed expert down", down_ty, h, f)?,
        })
    }

    fn slot_bytes(&self) -> usize {
        self.gate.bytes + self.down.bytes
    }
}

pub(crate) struct ExpertArena {
    pub layers: Vec<ArenaLayer>,
    pub slot_bytes: usize,
    pub slots_per_slab: usize,
    pub set: ash::vk::DescriptorSet,
    /// Whether each layer's shared expert is slot-table entry `E`.
    pub shared_in_arena: bool,
    _slabs: Vec<Buffer>,
    _pool: DescriptorPool,
}

/// The file-format bytes of one expert: gate/up rows (one or two runs) and down rows.
pub(crate) type ExpertBytes<'a> = (Vec<&'a [u8]>, &'a [u8]);

impl ExpertArena {
    /// Uploads every layer's routed experts (and shared expert, when it has
    /// their shape); returns the arena and the slot table (layer-major, `E`
    /// or `E + 1` entries per layer).
    pub fn new(ctx: &Arc<Context>, pipes: &Pipelines, cmds: &Commands, cfg: &Config, moes: &[&Moe]) -> Result<(Self, Vec<u32>)> {
        let (h, f, e) = (cfg.hidden, cfg.expert_ff, cfg.n_experts);
        let mut layers = Vec::with_capacity(moes.len());
        for (l, moe) in moes.iter().enumerate() {
            let gate_up_types: Vec<_> = match &moe.gate_up {
                ExpertGateUp::Separate { gate, up } => vec![gate.ty, up.ty],
                ExpertGateUp::Fused(t) => vec![t.ty],
            };
            if gate_up_types.iter().any(|&t| t != gate_up_types[0]) {
                return Err(Error::Backend(format!("layer {l}: routed expert gate and up types differ")));
            }
            layers.push(ArenaLayer::new(gate_up_types[0], moe.down.ty, h, f)?);
        }
        let shared_in_arena = cfg.shared_ff == f
            && moes.iter().zip(&layers).all(|(m, a)| {
                m.shared_gate_proj.ty == a.gate_ty && m.shared_up.ty == a.gate_ty && m.shared_down.ty == a.down_ty
            });
        let per_layer = e + shared_in_arena as usize;
        Self::upload(ctx, pipes, cmds, layers, per_layer, shared_in_arena, max_binding_bytes(ctx), |l, x| {
            let moe = moes[l];
            let a = &layers_row_bytes(moe, h, f);
            let (gate_up, down) = (f * a.0, h * a.1);
            if x == e {
                (vec![rows(&moe.shared_gate_proj, gate_up, 0), rows(&moe.shared_up, gate_up, 0)], rows(&moe.shared_down, down, 0))
            } else {
                let gu = match &moe.gate_up {
                    ExpertGateUp::Separate { gate, up } => vec![rows(gate, gate_up, x), rows(up, gate_up, x)],
                    ExpertGateUp::Fused(t) => vec![rows(t, 2 * gate_up, x)],
                };
                (gu, rows(&moe.down, down, x))
            }
        })
    }

    /// Uploads `per_layer` experts of each of `layers` into slots
    /// `l * per_layer + x` of slabs of at most `max_bytes`; `expert(l, x)`
    /// gives an expert's bytes in the file's format.
    #[allow(clippy::too_many_arguments)]
    pub fn upload<'a>(
        ctx: &Arc<Context>,
        pipes: &Pipelines,
        cmds: &Commands,
        layers: Vec<ArenaLayer>,
        per_layer: usize,
        shared_in_arena: bool,
        max_bytes: usize,
        expert: impl Fn(usize, usize) -> ExpertBytes<'a>,
    ) -> Result<(Self, Vec<u32>)> {
        let slot_bytes = layers.iter().map(ArenaLayer::slot_bytes).max().unwrap_or(16);
        let slots_per_slab = max_bytes / slot_bytes;
        if slots_per_slab == 0 {
            return Err(Error::Backend(format!("one expert ({slot_bytes} bytes) exceeds a storage-buffer binding")));
        }
        if slot_bytes * slots_per_slab > u32::MAX as usize {
            return Err(Error::Backend("an arena slab exceeds the shaders' 32-bit offsets".into()));
        }
        let n_slots = layers.len() * per_layer;
        let n_slabs = n_slots.div_ceil(slots_per_slab).max(1);
        let max_slabs = pipes.max_slabs as usize;
        if n_slabs > max_slabs {
            return Err(Error::OutOfMemory(format!(
                "the routed experts need {n_slabs} arena slabs of {} MiB; this device binds at most {max_slabs}",
                (slots_per_slab * slot_bytes) >> 20
            )));
        }
        let mut slabs = Vec::with_capacity(n_slabs);
        for s in 0..n_slabs {
            let n = slots_per_slab.min(n_slots - s * slots_per_slab);
            slabs.push(Buffer::new(ctx, "expert arena slab", (n * slot_bytes) as u64, MemoryLocation::GpuOnly)?);
        }
        // Consecutive slots of a slab are uploaded together, up to 64 MiB at a time.
        let mut pending: Vec<u8> = Vec::new();
        let mut pending_at = (0usize, 0u64);
        let flush = |pending: &mut Vec<u8>, at: (usize, u64)| -> Result<()> {
            if !pending.is_empty() {
                cmds.upload(&slabs[at.0], at.1, pending)?;
                pending.clear();
            }
            Ok(())
        };
        let mut table = Vec::with_capacity(n_slots);
        for (l, layer) in layers.iter().enumerate() {
            for x in 0..per_layer {
                let slot = l * per_layer + x;
                let (slab, base) = (slot / slots_per_slab, ((slot % slots_per_slab) * slot_bytes) as u64);
                if pending.is_empty() || slab != pending_at.0 || pending.len() >= 64 << 20 {
                    flush(&mut pending, pending_at)?;
                    pending_at = (slab, base);
                }
                let (gate_up, down) = expert(l, x);
                let start = pending.len();
                pending.resize(start + slot_bytes, 0);
                pending[start..start + layer.gate.bytes].copy_from_slice(&layer.gate.repack(&gate_up));
                let d = start + layer.gate.bytes;
                pending[d..d + layer.down.bytes].copy_from_slice(&layer.down.repack(&[down]));
                table.push(slot as u32);
            }
        }
        flush(&mut pending, pending_at)?;
        let pool = DescriptorPool::new(ctx, 1, max_slabs as u32)?;
        // Unused bindings repeat the last slab: every array element must be valid.
        let infos: Vec<_> = (0..max_slabs).map(|i| slabs[i.min(n_slabs - 1)].info()).collect();
        let set = pool.set(pipes.arena_layout, &[&infos])?;
        Ok((ExpertArena { layers, slot_bytes, slots_per_slab, set, shared_in_arena, _slabs: slabs, _pool: pool }, table))
    }
}

/// Rows `i * n .. (i + 1) * n` (in bytes) of `t`.
fn rows(t: &crate::tensor::Tensor, n: usize, i: usize) -> &[u8] {
    &t.bytes()[i * n..(i + 1) * n]
}

/// File bytes of one gate (or up) row of `H` and of one down row of `F`.
fn layers_row_bytes(moe: &Moe, h: usize, f: usize) -> (usize, usize) {
    let gate_ty = match &moe.gate_up {
        ExpertGateUp::Separate { gate, .. } => gate.ty,
        ExpertGateUp::Fused(t) => t.ty,
    };
    (gate_ty.row_bytes(h).unwrap_or(0), moe.down.ty.row_bytes(f).unwrap_or(0))
}
