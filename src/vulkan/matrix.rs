//! Weight matrices in device memory, in their file format. A matrix larger
//! than one storage-buffer binding (`maxStorageBufferRange`: 128 MiB on
//! lavapipe, 4 GiB on NVIDIA) is split by rows into chunks, each its own
//! buffer and descriptor set (written once here); a matvec dispatches once
//! per chunk.

use super::buffer::{Buffer, Commands};
use super::device::Context;
use super::pipelines::{Pipe, Pipelines};
use super::record::DescriptorPool;
use crate::error::{Error, Result};
use crate::gguf::GgmlType;
use crate::tensor::Tensor;
use gpu_allocator::MemoryLocation;
use std::sync::Arc;

pub(crate) struct Chunk {
    pub first_row: usize,
    pub rows: usize,
    pub set: ash::vk::DescriptorSet,
    _buffer: Buffer,
}

pub(crate) struct GpuMatrix {
    pub name: String,
    pub ty: GgmlType,
    pub cols: usize,
    pub rows: usize,
    pub row_bytes: usize,
    pub chunks: Vec<Chunk>,
    _pool: DescriptorPool,
}

/// Largest bytes one weight binding may span: the device's storage-buffer
/// range, lowered by `FNX_VULKAN_MAX_BINDING_BYTES` (tests use it to split
/// small matrices), and kept to 2 GiB (a common allocation limit).
pub(crate) fn max_binding_bytes(ctx: &Context) -> usize {
    let forced = std::env::var("FNX_VULKAN_MAX_BINDING_BYTES").ok().and_then(|v| v.parse::<usize>().ok());
    let device = (ctx.limits.max_storage_buffer_range as usize).min(2 << 30);
    forced.map_or(device, |f| f.min(device)) / 16 * 16
}

/// Checks that the shaders can read `ty` rows of `cols` and returns the row bytes.
pub(crate) fn row_bytes(name: &str, ty: GgmlType, cols: usize) -> Result<usize> {
    let rb = ty.row_bytes(cols).ok_or_else(|| Error::model(format!("{name}: bad row length {cols}")))?;
    if Pipe::matvec(ty, false).is_none() || rb % 2 != 0 || (ty != GgmlType::Q8_0 && rb % 4 != 0) {
        return Err(Error::Backend(format!("{name}: the Vulkan backend cannot read {ty} rows of {cols}")));
    }
    Ok(rb)
}

impl GpuMatrix {
    /// Uploads the rows of `parts` (same type and row length), concatenated.
    pub fn upload(ctx: &Arc<Context>, pipes: &Pipelines, cmds: &Commands, parts: &[&Tensor]) -> Result<GpuMatrix> {
        let first = parts[0];
        let (ty, cols) = (first.ty, first.cols());
        let name = parts.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join("+");
        if parts.iter().any(|t| t.ty != ty || t.cols() != cols) {
            return Err(Error::Backend(format!("{name}: parts differ in type or row length")));
        }
        let rb = row_bytes(&name, ty, cols)?;
        let rows: usize = parts.iter().map(|t| t.rows()).sum();
        let per_chunk = max_binding_bytes(ctx) / rb;
        if per_chunk == 0 {
            return Err(Error::Backend(format!("{name}: one row ({rb} bytes) exceeds a storage-buffer binding")));
        }
        let n_chunks = rows.div_ceil(per_chunk).max(1);
        let pool = DescriptorPool::new(ctx, n_chunks as u32, n_chunks as u32)?;
        let mut chunks = Vec::with_capacity(n_chunks);
        for c in 0..n_chunks {
            let (first_row, n) = (c * per_chunk, per_chunk.min(rows - c * per_chunk));
            let buffer = Buffer::new(ctx, &name, (n * rb) as u64, MemoryLocation::GpuOnly)?;
            // Copy the part rows that fall in [first_row, first_row + n).
            let mut part_start = 0;
            for t in parts {
                let (lo, hi) = (first_row.max(part_start), (first_row + n).min(part_start + t.rows()));
                if lo < hi {
                    let src = &t.bytes()[(lo - part_start) * rb..(hi - part_start) * rb];
                    cmds.upload(&buffer, ((lo - first_row) * rb) as u64, src)?;
                }
                part_start += t.rows();
            }
            let set = pool.set(pipes.weight_layout, &[&[buffer.info()]])?;
            chunks.push(Chunk { first_row, rows: n, set, _buffer: buffer });
        }
        Ok(GpuMatrix { name, ty, cols, rows, row_bytes: rb, chunks, _pool: pool })
    }
}
