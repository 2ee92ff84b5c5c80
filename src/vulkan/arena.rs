//! The expert arena: routed experts live in fixed-size slots, each holding
//! one expert's gate rows, up rows and down rows (`[F][H] | [F][H] | [H][F]`
//! in the file's format). Slots are carved from slabs (buffers of at most one
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
use super::matrix::{max_binding_bytes, row_bytes};
use super::pipelines::Pipelines;
use super::record::DescriptorPool;
use crate::error::{Error, Result};
use crate::gguf::GgmlType;
use crate::model::weights::{ExpertGateUp, Moe};
use crate::model::Config;
use gpu_allocator::MemoryLocation;
use std::sync::Arc;

pub(crate) struct ExpertArena {
    /// Types of the gate/up rows and of the down rows (a converter may keep
    /// rows whose length is not a multiple of the block size unquantized).
    pub gate_ty: GgmlType,
    pub down_ty: GgmlType,
    pub slot_bytes: usize,
    pub slots_per_slab: usize,
    /// Row bytes of gate/up rows (`H` long) and of down rows (`F` long).
    pub gate_row_bytes: usize,
    pub down_row_bytes: usize,
    pub set: ash::vk::DescriptorSet,
    /// Whether each layer's shared expert is slot-table entry `E`.
    pub shared_in_arena: bool,
    _slabs: Vec<Buffer>,
    _pool: DescriptorPool,
}

impl ExpertArena {
    /// Uploads every layer's routed experts (and shared expert, when it has
    /// their shape); returns the arena and the slot table (layer-major, `E`
    /// or `E + 1` entries per layer).
    pub fn new(ctx: &Arc<Context>, pipes: &Pipelines, cmds: &Commands, cfg: &Config, moes: &[&Moe]) -> Result<(Self, Vec<u32>)> {
        let (h, f, e) = (cfg.hidden, cfg.expert_ff, cfg.n_experts);
        let gate_ty = match &moes[0].gate_up {
            ExpertGateUp::Separate { gate, .. } => gate.ty,
            ExpertGateUp::Fused(t) => t.ty,
        };
        let down_ty = moes[0].down.ty;
        let gate_row_bytes = row_bytes("routed expert gate/up", gate_ty, h)?;
        let down_row_bytes = row_bytes("routed expert down", down_ty, f)?;
        let slot_bytes = (2 * f * gate_row_bytes + h * down_row_bytes).div_ceil(16) * 16;
        let slots_per_slab = max_binding_bytes(ctx) / slot_bytes;
        let shared_in_arena = cfg.shared_ff == f
            && moes.iter().all(|m| m.shared_gate_proj.ty == gate_ty && m.shared_up.ty == gate_ty && m.shared_down.ty == down_ty);
        let per_layer = e + shared_in_arena as usize;
        let n_slots = moes.len() * per_layer;
        if slots_per_slab == 0 {
            return Err(Error::Backend(format!("one expert ({slot_bytes} bytes) exceeds a storage-buffer binding")));
        }
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
        let mut table = Vec::with_capacity(n_slots);
        for (l, moe) in moes.iter().enumerate() {
            let gate_up_types: Vec<_> = match &moe.gate_up {
                ExpertGateUp::Separate { gate, up } => vec![gate.ty, up.ty],
                ExpertGateUp::Fused(t) => vec![t.ty],
            };
            if gate_up_types.iter().any(|&t| t != gate_ty) || moe.down.ty != down_ty {
                return Err(Error::Backend(format!("layer {l}: routed expert types differ from layer 0's")));
            }
            let gate_up = f * gate_row_bytes;
            let down = h * down_row_bytes;
            for x in 0..per_layer {
                let slot = l * per_layer + x;
                let (slab, base) = (&slabs[slot / slots_per_slab], ((slot % slots_per_slab) * slot_bytes) as u64);
                let rows = |t: &crate::tensor::Tensor, n: usize, i: usize| t.bytes()[i * n..(i + 1) * n].to_vec();
                let (gate_up_bytes, down_bytes) = if x == e {
                    ([rows(&moe.shared_gate_proj, gate_up, 0), rows(&moe.shared_up, gate_up, 0)].concat(), rows(&moe.shared_down, down, 0))
                } else {
                    let gu = match &moe.gate_up {
                        ExpertGateUp::Separate { gate, up } => [rows(gate, gate_up, x), rows(up, gate_up, x)].concat(),
                        ExpertGateUp::Fused(t) => rows(t, 2 * gate_up, x),
                    };
                    (gu, rows(&moe.down, down, x))
                };
                cmds.upload(slab, base, &gate_up_bytes)?;
                cmds.upload(slab, base + 2 * gate_up as u64, &down_bytes)?;
                table.push(slot as u32);
            }
        }
        let pool = DescriptorPool::new(ctx, 1, max_slabs as u32)?;
        // Unused bindings repeat the last slab: every array element must be valid.
        let infos: Vec<_> = (0..max_slabs).map(|i| slabs[i.min(n_slabs - 1)].info()).collect();
        let set = pool.set(pipes.arena_layout, &[&infos])?;
        Ok((
            ExpertArena { gate_ty, down_ty, slot_bytes, slots_per_slab, gate_row_bytes, down_row_bytes, set, shared_in_arena, _slabs: slabs, _pool: pool },
            table,
        ))
    }
}
