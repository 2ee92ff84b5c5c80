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
//! When every expert fits, each is resident in slot `layer * per_layer +
//! expert` and the slot table is that identity. When they do not (the
//! device, or the VRAM budget, is smaller than the model), each layer gets
//! `per_layer` slots that [`super::cache`] fills and evicts; the host then
//! passes the expert dispatches slot numbers directly (no slot table), and
//! the shared experts stay outside the arena, resident.

use super::buffer::{Buffer, Stream};
use super::device::Context;
use super::layout::PartLayout;
use super::matrix::part_layout;
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
    /// Slots of each layer: layer `l`'s slot `j` is arena slot `l * per_layer + j`.
    pub per_layer: usize,
    pub set: ash::vk::DescriptorSet,
    /// Whether each layer's shared expert is slot-table entry `E` (only
    /// when every expert is resident).
    pub shared_in_arena: bool,
    slabs: Vec<Buffer>,
    _pool: DescriptorPool,
}

/// The file-format bytes of one expert: gate/up rows (one or two runs) and down rows.
pub(crate) type ExpertBytes<'a> = (Vec<&'a [u8]>, &'a [u8]);

/// The layers' expert types and part layouts, and whether the shared
/// experts have the routed experts' shape and types (so they can share
/// their dispatches when everything is resident).
pub(crate) fn arena_layers(cfg: &Config, moes: &[&Moe]) -> Result<(Vec<ArenaLayer>, bool)> {
    let (h, f) = (cfg.hidden, cfg.expert_ff);
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
    let shared_fits = cfg.shared_ff == f
        && moes.iter().zip(&layers).all(|(m, a)| {
            m.shared_gate_proj.ty == a.gate_ty && m.shared_up.ty == a.gate_ty && m.shared_down.ty == a.down_ty
        });
    Ok((layers, shared_fits))
}

/// Bytes of one arena slot for `layers` (the largest layer's expert).
pub(crate) fn slot_bytes(layers: &[ArenaLayer]) -> usize {
    layers.iter().map(ArenaLayer::slot_bytes).max().unwrap_or(16)
}

/// The file bytes of routed expert `x` of `moe`, or its shared expert when `x == E`.
pub(crate) fn expert_bytes<'a>(moe: &'a Moe, cfg: &Config, x: usize) -> ExpertBytes<'a> {
    let (h, f) = (cfg.hidden, cfg.expert_ff);
    let a = layers_row_bytes(moe, h, f);
    let (gate_up, down) = (f * a.0, h * a.1);
    if x == cfg.n_experts {
        (vec![rows(&moe.shared_gate_proj, gate_up, 0), rows(&moe.shared_up, gate_up, 0)], rows(&moe.shared_down, down, 0))
    } else {
        let gu = match &moe.gate_up {
            ExpertGateUp::Separate { gate, up } => vec![rows(gate, gate_up, x), rows(up, gate_up, x)],
            ExpertGateUp::Fused(t) => vec![rows(t, 2 * gate_up, x)],
        };
        (gu, rows(&moe.down, down, x))
    }
}

impl ExpertArena {
    /// Allocates `per_layer` slots for each of `layers`, in slabs of at most
    /// `max_bytes`, and the descriptor set that binds them all.
    pub fn alloc(
        ctx: &Arc<Context>,
        pipes: &Pipelines,
        layers: Vec<ArenaLayer>,
        per_layer: usize,
        shared_in_arena: bool,
        max_bytes: usize,
    ) -> Result<Self> {
        let slot_bytes = slot_bytes(&layers);
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
            let n = slots_per_slab.min(n_slots - s * slots_per_slab).max(1);
            slabs.push(Buffer::new(ctx, "expert arena slab", (n * slot_bytes) as u64, MemoryLocation::GpuOnly)?);
        }
        let pool = DescriptorPool::new(ctx, 1, max_slabs as u32)?;
        // Unused bindings repeat the last slab: every array element must be valid.
        let infos: Vec<_> = (0..max_slabs).map(|i| slabs[i.min(n_slabs - 1)].info()).collect();
        let set = pool.set(pipes.arena_layout, &[&infos])?;
        Ok(ExpertArena { layers, slot_bytes, slots_per_slab, per_layer, set, shared_in_arena, slabs, _pool: pool })
    }

    /// The arena slot of layer `layer`'s local slot `slot` (what the expert
    /// matvecs read when the host passes them slots).
    pub fn slot(&self, layer: usize, slot: usize) -> u32 {
        (layer * self.per_layer + slot) as u32
    }

    /// The slab and byte offset of layer `layer`'s local slot `slot`.
    pub fn place(&self, layer: usize, slot: usize) -> (&Buffer, u64) {
        let s = self.slot(layer, slot) as usize;
        (&self.slabs[s / self.slots_per_slab], ((s % self.slots_per_slab) * self.slot_bytes) as u64)
    }

    /// Layer `layer`'s expert (`bytes` in the file's format) in the device
    /// layout of a slot, into `out` (`slot_bytes` long).
    pub fn repack_into(&self, layer: usize, bytes: &ExpertBytes, out: &mut [u8]) {
        let l = &self.layers[layer];
        let (gate, rest) = out.split_at_mut(l.gate.bytes);
        l.gate.repack_into(&bytes.0, gate);
        let (down, pad) = rest.split_at_mut(l.down.bytes);
        l.down.repack_into(&[bytes.1], down);
        pad.fill(0);
    }

    /// [`ExpertArena::repack_into`] for an `out` in memory the device reads
    /// (write-combined or across the bus): repacked in cached memory first
    /// (`scratch`, sized here), then copied out in large sequential pieces on
    /// the rayon pool. Repacked straight into the H200's staging memory,
    /// whose scattered small stores that defeats, an expert took ~0.5 ms
    /// (4 GB/s).
    pub fn repack_through(&self, layer: usize, bytes: &ExpertBytes, scratch: &mut Vec<u8>, out: &mut [u8]) {
        use rayon::prelude::*;
        scratch.resize(out.len(), 0);
        self.repack_into(layer, bytes, scratch);
        out.par_chunks_mut(256 << 10).zip(scratch.par_chunks(256 << 10)).for_each(|(o, s)| o.copy_from_slice(s));
    }

    /// Streams every layer's experts `0..per_layer` into their slots
    /// (`expert(l, x)` gives an expert's file bytes) and returns the identity
    /// slot table (layer-major, `per_layer` entries per layer).
    pub fn fill_all<'a>(&self, stream: &mut Stream, expert: impl Fn(usize, usize) -> ExpertBytes<'a> + Sync) -> Result<Vec<u32>> {
        let slots: Vec<(usize, usize, usize)> = (0..self.layers.len()).flat_map(|l| (0..self.per_layer).map(move |x| (l, x, x))).collect();
        self.fill(stream, &slots, expert)?;
        Ok((0..slots.len() as u32).collect())
    }

    /// Streams expert `e` of layer `l` into its local slot `s` for every
    /// `(l, s, e)` of `slots` (repacked in parallel into the staging memory).
    pub fn fill<'a>(&self, stream: &mut Stream, slots: &[(usize, usize, usize)], expert: impl Fn(usize, usize) -> ExpertBytes<'a> + Sync) -> Result<()> {
        let places: Vec<(&Buffer, u64)> = slots.iter().map(|&(l, s, _)| self.place(l, s)).collect();
        stream.write_parallel(self.slot_bytes, &places, |i, out| {
            let (l, _, e) = slots[i];
            self.repack_into(l, &expert(l, e), out);
        })
    }

    /// Streams `bytes` into layer `layer`'s local slot `slot`.
    pub fn write(&self, stream: &mut Stream, layer: usize, slot: usize, bytes: &ExpertBytes) -> Result<()> {
        let (slab, at) = self.place(layer, slot);
        stream.write_with(slab, at, self.slot_bytes, |out| self.repack_into(layer, bytes, out))
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
