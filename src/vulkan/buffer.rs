//! Storage buffers with their memory (from `gpu-allocator`), and the one
//! command buffer + fence each user of the queue records into.

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
        // SAFETY: the buffer is recording.
        unsafe { self.ctx.device.end_command_buffer(self.cmd) }.map_err(err("ending a command buffer"))?;
        self.ctx.submit_and_wait(self.cmd, self.fence)
    }

    /// Copies `bytes` into `dst` at `offset` through a host-visible staging buffer.
    pub fn upload(&self, dst: &Buffer, offset: u64, bytes: &[u8]) -> Result<()> {
        const STAGE: usize = 64 << 20;
        let mut staging = Buffer::new(&self.ctx, "upload staging", bytes.len().min(STAGE) as u64, MemoryLocation::CpuToGpu)?;
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
