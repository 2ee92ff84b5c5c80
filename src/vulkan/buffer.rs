//! Storage buffers with their memory (from `gpu-allocator`), the command
//! buffer + fence each user of the queue records into, and [`Stream`], which
//! moves host bytes into device buffers at the speed of the bus.

use super::device::{err, Context};
use crate::error::{Error, Result};
use ash::vk;
use gpu_allocator::vulkan::{Allocation, AllocationCreateDesc, AllocationScheme};
use gpu_allocator::MemoryLocation;
use std::sync::Arc;

/// A storage buffer; device-local (`GpuOnly`) buffers count against the VRAM budget.
pub(crate) struct Buffer {
    pub raw: vk::Buffer,
    /// Usable bytes (a multiple of 16).
    pub size: u64,
    alloc: Option<Allocation>,
    counted: u64,
    ctx: Arc<Context>,
}

impl Buffer {
    pub fn new(ctx: &Arc<Context>, name: &str, size: u64, location: MemoryLocation) -> Result<Buffer> {
        let size = size.max(16).div_ceil(16) * 16;
        let counted = if location == MemoryLocation::GpuOnly { size } else { 0 };
        ctx.reserve(counted, name)?;
        let usage = vk::BufferUsageFlags::STORAGE_BUFFER | vk::BufferUsageFlags::TRANSFER_SRC | vk::BufferUsageFlags::TRANSFER_DST;
        let info = vk::BufferCreateInfo::default().size(size).usage(usage).sharing_mode(vk::SharingMode::EXCLUSIVE);
        // SAFETY: valid device and create info.
        let raw = match unsafe { ctx.device.create_buffer(&info, None) } {
            Ok(b) => b,
            Err(e) => {
                ctx.release(counted);
                return Err(err(name)(e));
            }
        };
        let mut buffer = Buffer { raw, size, alloc: None, counted, ctx: ctx.clone() };
        // SAFETY: `raw` is a live buffer of this device.
        let requirements = unsafe { ctx.device.get_buffer_memory_requirements(raw) };
        let desc = AllocationCreateDesc { name, requirements, location, linear: true, allocation_scheme: AllocationScheme::GpuAllocatorManaged };
        let alloc = ctx.allocator.lock().unwrap_or_else(|e| e.into_inner()).allocate(&desc).map_err(|e| match e {
            gpu_allocator::AllocationError::OutOfMemory => {
                Error::OutOfMemory(format!("{name}: the Vulkan device has no room for {size} bytes"))
            }
            other => Error::Backend(format!("{name}: allocating {size} bytes: {other}")),
        })?;
        // SAFETY: the allocation satisfies the buffer's requirements and is unbound.
        unsafe { ctx.device.bind_buffer_memory(raw, alloc.memory(), alloc.offset()) }.map_err(err(name))?;
        buffer.alloc = Some(alloc);
        Ok(buffer)
    }

    /// The mapped bytes of a host-visible buffer.
    pub fn mapped(&mut self) -> &mut [u8] {
        let size = self.size as usize;
        let a = self.alloc.as_mut().expect("allocated in new");
        &mut a.mapped_slice_mut().expect("host-visible buffer")[..size]
    }

    pub fn context(&self) -> &Context {
        &self.ctx
    }

    pub fn info(&self) -> vk::DescriptorBufferInfo {
        vk::DescriptorBufferInfo { buffer: self.raw, offset: 0, range: self.size }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: users wait for their last submission before dropping buffers.
        unsafe { self.ctx.device.destroy_buffer(self.raw, None) };
        if let Some(a) = self.alloc.take() {
            let _ = self.ctx.allocator.lock().unwrap_or_else(|e| e.into_inner()).free(a);
        }
        self.ctx.release(self.counted);
    }
}

/// Where staging buffers live: host-visible memory, device-local where the
/// device has it (a BAR across the bus). Cached host memory instead, which
/// the GPU's copies read over the bus, measured the same on an H200 host
/// (loads at 10-14 GB/s, expert uploads repacked at ~5 GB/s either way: the
/// repack, not the memory it writes, sets the upload speed).
pub(crate) const STAGING: MemoryLocation = MemoryLocation::CpuToGpu;

/// A command pool with one primary command buffer and a fence.
pub(crate) struct Commands {
    pool: vk::CommandPool,
    pub cmd: vk::CommandBuffer,
    fence: vk::Fence,
    ctx: Arc<Context>,
}

impl Commands {
    pub fn new(ctx: &Arc<Context>) -> Result<Commands> {
        let d = &ctx.device;
        // SAFETY: valid device and create infos; objects are destroyed in Drop.
        unsafe {
            let pool = d
                .create_command_pool(
                    &vk::CommandPoolCreateInfo::default()
                        .queue_family_index(ctx.queue_family)
                        .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER),
                    None,
                )
                .map_err(err("creating a command pool"))?;
            let mut c = Commands { pool, cmd: vk::CommandBuffer::null(), fence: vk::Fence::null(), ctx: ctx.clone() };
            let info = vk::CommandBufferAllocateInfo::default().command_pool(pool).command_buffer_count(1);
            c.cmd = d.allocate_command_buffers(&info).map_err(err("allocating a command buffer"))?[0];
            c.fence = d.create_fence(&vk::FenceCreateInfo::default(), None).map_err(err("creating a fence"))?;
            Ok(c)
        }
    }

    /// Starts recording (a one-time submission).
    pub fn begin(&self) -> Result<()> {
        let info = vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
        // SAFETY: the buffer is not pending (every submission is waited for).
        unsafe { self.ctx.device.begin_command_buffer(self.cmd, &info) }.map_err(err("beginning a command buffer"))
    }

    /// Ends recording, submits, and waits for completion.
    pub fn submit(&self) -> Result<()> {
        self.submit_async()?;
        self.wait()
    }

    /// Ends recording and submits; [`Commands::wait`] waits for it (and
    /// [`Commands::begin`] must not be called before that).
    pub fn submit_async(&self) -> Result<()> {
        // SAFETY: the buffer is recording.
        unsafe { self.ctx.device.end_command_buffer(self.cmd) }.map_err(err("ending a command buffer"))?;
        self.ctx.submit(self.cmd, self.fence)
    }

    /// Ends recording and submits without a fence: a segment of a longer
    /// recording, whose last submission's fence also covers this one (a
    /// fence signalled by a submission covers every earlier submission to
    /// the queue). Work recorded after it in another buffer is ordered after
    /// it as within one buffer: a pipeline barrier's scopes take in every
    /// command earlier and later in submission order.
    pub fn submit_segment(&self) -> Result<()> {
        // SAFETY: the buffer is recording.
        unsafe { self.ctx.device.end_command_buffer(self.cmd) }.map_err(err("ending a command buffer"))?;
        self.ctx.submit(self.cmd, vk::Fence::null())
    }

    /// Ends the buffer being recorded without submitting it and waits until
    /// the queue has run everything submitted before (segments of a
    /// recording that failed part way).
    pub fn drain(&self) -> Result<()> {
        // SAFETY: the buffer is recording.
        unsafe { self.ctx.device.end_command_buffer(self.cmd) }.map_err(err("ending a command buffer"))?;
        self.ctx.submit_nothing(self.fence)?;
        self.wait()
    }

    /// Waits for the last submission.
    pub fn wait(&self) -> Result<()> {
        self.ctx.wait(self.fence)
    }

    /// Whether the last submission has completed.
    pub fn done(&self) -> Result<bool> {
        self.ctx.signalled(self.fence)
    }

    /// Copies `bytes` into `dst` at `offset` through a host-visible staging buffer.
    pub fn upload(&self, dst: &Buffer, offset: u64, bytes: &[u8]) -> Result<()> {
        const STAGE: usize = 64 << 20;
        let mut staging = Buffer::new(&self.ctx, "upload staging", bytes.len().min(STAGE) as u64, STAGING)?;
        for (i, part) in bytes.chunks(STAGE).enumerate() {
            staging.mapped()[..part.len()].copy_from_slice(part);
            self.begin()?;
            let region = [vk::BufferCopy { src_offset: 0, dst_offset: offset + (i * STAGE) as u64, size: part.len() as u64 }];
            // SAFETY: both buffers are live and the region lies inside them.
            unsafe { self.ctx.device.cmd_copy_buffer(self.cmd, staging.raw, dst.raw, &region) };
            self.submit()?;
        }
        Ok(())
    }

    /// Reads `len` bytes of `src` from `offset`.
    pub fn download(&self, src: &Buffer, offset: u64, len: usize) -> Result<Vec<u8>> {
        let mut staging = Buffer::new(&self.ctx, "download staging", len as u64, MemoryLocation::GpuToCpu)?;
        self.begin()?;
        let region = [vk::BufferCopy { src_offset: offset, dst_offset: 0, size: len as u64 }];
        // SAFETY: both buffers are live and the region lies inside them.
        unsafe { self.ctx.device.cmd_copy_buffer(self.cmd, src.raw, staging.raw, &region) };
        self.submit()?;
        Ok(staging.mapped()[..len].to_vec())
    }
}

impl Drop for Commands {
    fn drop(&mut self) {
        // SAFETY: the last submission was waited for; the pool frees its buffer.
        unsafe {
            self.ctx.device.destroy_fence(self.fence, None);
            self.ctx.device.destroy_command_pool(self.pool, None);
        }
    }
}

/// Bytes of each staging buffer of a [`Stream`].
const STAGE_BYTES: usize = 64 << 20;

/// One staging buffer of a [`Stream`] and the copies recorded from it.
struct Stage {
    buffer: Buffer,
    cmds: Commands,
    /// Bytes filled.
    used: usize,
    /// Whether `cmds` holds a submission not yet waited for.
    in_flight: bool,
    /// (destination, destination offset, source offset, bytes)
    copies: Vec<(vk::Buffer, u64, u64, u64)>,
}

/// Host bytes into device buffers through a ring of host-visible staging
/// buffers: while the GPU copies out of one, the host fills the next (the
/// filling itself spread over the rayon pool by the callers that repack).
/// [`Stream::finish`] submits what is left and waits for every copy; a
/// destination must outlive its copies, so on failure [`Stream::abort`]
/// comes first.
pub(crate) struct Stream {
    stages: Vec<Stage>,
    current: usize,
    /// Bytes streamed so far.
    pub bytes: u64,
}

impl Stream {
    pub fn new(ctx: &Arc<Context>) -> Result<Stream> {
        let mut stages = Vec::new();
        for _ in 0..3 {
            stages.push(Stage {
                buffer: Buffer::new(ctx, "upload staging", STAGE_BYTES as u64, STAGING)?,
                cmds: Commands::new(ctx)?,
                used: 0,
                in_flight: false,
                copies: Vec::new(),
            });
        }
        Ok(Stream { stages, current: 0, bytes: 0 })
    }

    /// Writes `len` bytes at `offset` of `dst`, produced by `fill` into a
    /// staging slice of exactly `len` bytes. Larger than a staging buffer:
    /// `fill` runs on a temporary and the bytes are streamed in pieces.
    /// On failure the stream is aborted ([`Stream::abort`]).
    pub fn write_with(&mut self, dst: &Buffer, offset: u64, len: usize, fill: impl FnOnce(&mut [u8])) -> Result<()> {
        if len > STAGE_BYTES {
            let mut tmp = vec![0u8; len];
            fill(&mut tmp);
            return self.write(dst, offset, &tmp);
        }
        if self.stages[self.current].used + len > STAGE_BYTES {
            if let Err(e) = self.flush() {
                self.abort();
                return Err(e);
            }
        }
        let st = &mut self.stages[self.current];
        let at = st.used;
        fill(&mut st.buffer.mapped()[at..at + len]);
        st.copies.push((dst.raw, offset, at as u64, len as u64));
        st.used += len.div_ceil(16) * 16;
        self.bytes += len as u64;
        Ok(())
    }

    /// Writes `items.len()` pieces of `len` bytes (piece `i` at `items[i].1`
    /// of `items[i].0`), as many at a time as fit a staging buffer, each
    /// filled by `fill(i, bytes)` in parallel on the rayon pool. On failure
    /// the stream is aborted.
    pub fn write_parallel(&mut self, len: usize, items: &[(&Buffer, u64)], fill: impl Fn(usize, &mut [u8]) + Sync) -> Result<()> {
        use rayon::prelude::*;
        let step = len.div_ceil(16) * 16;
        if step > STAGE_BYTES {
            for (i, &(dst, at)) in items.iter().enumerate() {
                self.write_with(dst, at, len, |out| fill(i, out))?;
            }
            return Ok(());
        }
        let mut done = 0;
        while done < items.len() {
            let room = (STAGE_BYTES - self.stages[self.current].used) / step;
            if room == 0 {
                if let Err(e) = self.flush() {
                    self.abort();
                    return Err(e);
                }
                continue;
            }
            let n = room.min(items.len() - done);
            let st = &mut self.stages[self.current];
            let at = st.used;
            st.buffer.mapped()[at..at + n * step].par_chunks_mut(step).enumerate().for_each(|(j, out)| fill(done + j, &mut out[..len]));
            for (j, &(dst, offset)) in items[done..done + n].iter().enumerate() {
                st.copies.push((dst.raw, offset, (at + j * step) as u64, len as u64));
            }
            st.used += n * step;
            self.bytes += (n * len) as u64;
            done += n;
        }
        Ok(())
    }

    /// Writes `bytes` at `offset` of `dst`.
    pub fn write(&mut self, dst: &Buffer, offset: u64, bytes: &[u8]) -> Result<()> {
        let written = self.write_parts(dst, offset, bytes);
        if written.is_err() {
            self.abort();
        }
        written
    }

    fn write_parts(&mut self, dst: &Buffer, offset: u64, bytes: &[u8]) -> Result<()> {
        for (i, part) in bytes.chunks(STAGE_BYTES).enumerate() {
            self.write_with(dst, offset + (i * STAGE_BYTES) as u64, part.len(), |out| out.copy_from_slice(part))?;
        }
        Ok(())
    }

    /// Submits the current staging buffer's copies and moves to the next one
    /// (waiting for its previous copies first).
    fn flush(&mut self) -> Result<()> {
        let st = &mut self.stages[self.current];
        if !st.copies.is_empty() {
            st.cmds.begin()?;
            let d = &st.buffer.ctx.device;
            for &(dst, dst_off, src_off, size) in &st.copies {
                let region = [vk::BufferCopy { src_offset: src_off, dst_offset: dst_off, size }];
                // SAFETY: recording; the staging buffer and `dst` are live (callers keep
                // destinations alive until `finish`), and the regions lie inside both.
                unsafe { d.cmd_copy_buffer(st.cmds.cmd, st.buffer.raw, dst, &region) };
            }
            st.cmds.submit_async()?;
            st.in_flight = true;
            st.copies.clear();
        }
        self.current = (self.current + 1) % self.stages.len();
        let next = &mut self.stages[self.current];
        if next.in_flight {
            next.cmds.wait()?;
            next.in_flight = false;
        }
        next.used = 0;
        Ok(())
    }

    /// After a failure: waits for the copies already submitted and forgets
    /// the ones not yet submitted, so that their destinations may be freed.
    /// Whoever fails while a stream holds copies calls this before anything
    /// it wrote into can be dropped.
    pub fn abort(&mut self) {
        for st in &mut self.stages {
            if st.in_flight {
                let _ = st.cmds.wait();
                st.in_flight = false;
            }
            st.copies.clear();
            st.used = 0;
        }
    }

    /// Submits everything written and waits for all of it.
    pub fn finish(&mut self) -> Result<()> {
        self.flush()?;
        for st in &mut self.stages {
            if st.in_flight {
                st.cmds.wait()?;
                st.in_flight = false;
            }
        }
        Ok(())
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.abort();
    }
}
