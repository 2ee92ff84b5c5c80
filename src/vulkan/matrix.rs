//! Weight matrices in device memory, in the layout of [`super::layout`]
//! (every GGUF weight type). A matrix larger than one storage-buffer binding
//! (`maxStorageBufferRange`: 128 MiB on lavapipe, 4 GiB on NVIDIA) is split
//! by rows into chunks, each its own buffer, part layout and descriptor set
//! (written once here); a matvec dispatches once per chunk.

use super::buffer::{Buffer, Stream};
use super::device::Context;
use super::layout::PartLayout;
use super::pipelines::Pipelines;
use super::record::DescriptorPool;
use crate::error::{Error, Result};
use crate::gguf::GgmlType;
use crate::tensor::Tensor;
use gpu_allocator::MemoryLocation;
use std::sync::Arc;

pub(crate) struct Chunk {
    pub first_row: usize,
    pub rows: usize,
    pub layout: PartLayout,
    pub set: ash::vk::DescriptorSet,
    buffer: Buffer,
}

pub(crate) struct GpuMatrix {
    pub name: String,
    pub ty: GgmlType,
    pub rows: usize,
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

/// The device layout of `rows` rows of `cols` values of `ty`, or why the
/// shaders cannot read them (a row that is not a whole number of blocks).
pub(crate) fn part_layout(name: &str, ty: GgmlType, rows: usize, cols: usize) -> Result<PartLayout> {
    let p = PartLayout::new(ty, rows, cols).ok_or_else(|| Error::model(format!("{name}: bad {ty} row length {cols}")))?;
    if p.bytes > u32::MAX as usize {
        return Err(Error::Backend(format!("{name}: {} bytes of {ty} rows exceed the shaders' 32-bit offsets", p.bytes)));
    }
    Ok(p)
}

impl GpuMatrix {
    /// Uploads the rows of `parts` (same type and row length), concatenated.
    pub fn upload(ctx: &Arc<Context>, pipes: &Pipelines, stream: &mut Stream, parts: &[&Tensor]) -> Result<GpuMatrix> {
        Self::upload_split(ctx, pipes, stream, parts, max_binding_bytes(ctx))
    }

    /// As [`GpuMatrix::upload`], with chunks of at most `max_bytes`.
    pub fn upload_split(
        ctx: &Arc<Context>,
        pipes: &Pipelines,
        stream: &mut Stream,
        parts: &[&Tensor],
        max_bytes: usize,
    ) -> Result<GpuMatrix> {
        let first = parts[0];
        let (ty, cols) = (first.ty, first.cols());
        let name = parts.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join("+");
        if parts.iter().any(|t| t.ty != ty || t.cols() != cols) {
            return Err(Error::Backend(format!("{name}: parts differ in type or row length")));
        }
        let rows: usize = parts.iter().map(|t| t.rows()).sum();
        let file_row = ty.row_bytes(cols).ok_or_else(|| Error::model(format!("{name}: bad row length {cols}")))?;
        // Rows per chunk: as many as fit, by the device layout's size (payload and fields).
        let fits = |n: usize| PartLayout::new(ty, n, cols).is_some_and(|p| p.bytes <= max_bytes);
        let mut per_chunk = (max_bytes / part_layout(&name, ty, 1, cols)?.row_bytes.max(1)).min(rows.max(1));
        while per_chunk > 0 && !fits(per_chunk) {
            per_chunk -= per_chunk.div_ceil(64);
        }
        if per_chunk == 0 {
            return Err(Error::Backend(format!("{name}: one row ({file_row} bytes) exceeds a storage-buffer binding")));
        }
        let n_chunks = rows.div_ceil(per_chunk).max(1);
        let pool = DescriptorPool::new(ctx, n_chunks as u32, n_chunks as u32)?;
        // Every buffer first: a failure then leaves nothing written.
        let mut chunks = Vec::with_capacity(n_chunks);
        for c in 0..n_chunks {
            let (first_row, n) = (c * per_chunk, per_chunk.min(rows - c * per_chunk));
            let layout = part_layout(&name, ty, n, cols)?;
            let buffer = Buffer::new(ctx, &name, layout.bytes as u64, MemoryLocation::GpuOnly)?;
            let set = pool.set(pipes.weight_layout, &[&[buffer.info()]])?;
            chunks.push(Chunk { first_row, rows: n, layout, set, buffer });
        }
        for c in &chunks {
            // The part rows that fall in [first_row, first_row + rows).
            let mut srcs = Vec::new();
            let mut part_start = 0;
            for t in parts {
                let (lo, hi) = (c.first_row.max(part_start), (c.first_row + c.rows).min(part_start + t.rows()));
                if lo < hi {
                    srcs.push(&t.bytes()[(lo - part_start) * file_row..(hi - part_start) * file_row]);
                }
                part_start += t.rows();
            }
            stream.write_with(&c.buffer, 0, c.layout.bytes, |out| c.layout.repack_into(&srcs, out))?;
        }
        Ok(GpuMatrix { name, ty, rows, chunks, _pool: pool })
    }

    /// Bytes of the matrix in device memory (what one matvec reads).
    pub fn device_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.layout.bytes as u64).sum()
    }
}
