//! Kernel twins: the matvec shader of every weight type against the CPU's
//! `Tensor::matvec`, on rows whose byte length is not a multiple of four
//! (Q8_0 rows of 96 are 102 bytes), under the validation layer. The other
//! shaders are compared with their CPU twins through whole decodes
//! (`tests/vulkan_*.rs`).

use super::buffer::{Buffer, Commands};
use super::device::{validation_errors, Context, DeviceChoice};
use super::matrix::GpuMatrix;
use super::pipelines::{MatvecPush, Pipelines};
use super::record::{DescriptorPool, Recorder};
use crate::gguf::{GgmlType, TensorInfo};
use crate::tensor::Tensor;
use ash::vk;
use gpu_allocator::MemoryLocation;
use std::sync::Arc;

/// `rows x cols` pseudo-random values stored as `ty`.
fn tensor(ty: GgmlType, rows: usize, cols: usize) -> Tensor {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % 2001) as f32 / 1000.0 - 1.0
    };
    let values: Vec<f32> = (0..rows * cols).map(|_| next()).collect();
    let bytes: Vec<u8> = match ty {
        GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        GgmlType::BF16 => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
        GgmlType::Q8_0 => values
            .chunks(32)
            .flat_map(|b| {
                let d = b.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                let mut block = half::f16::from_f32(d).to_le_bytes().to_vec();
                block.extend(b.iter().map(|v| (v / d).round() as i8 as u8));
                block
            })
            .collect(),
        other => unreachable!("no twin for {other}"),
    };
    let info = TensorInfo { name: format!("twin.{ty}"), ty, dims: vec![cols, rows], offset: 0, nbytes: bytes.len() };
    Tensor::new(Arc::new(bytes), &info)
}

/// The GPU's `W x`, through the same recorder the decode uses.
fn gpu_matvec(ctx: &Arc<Context>, pipes: &Pipelines, w: &Tensor, x: &[f32]) -> Vec<f32> {
    let cmds = Commands::new(ctx).unwrap();
    let m = GpuMatrix::upload(ctx, pipes, &cmds, &[w]).unwrap();
    let (cols, rows) = (w.cols(), w.rows());
    let scratch = Buffer::new(ctx, "twin scratch", ((cols + rows) * 4) as u64, MemoryLocation::GpuOnly).unwrap();
    let dummy = Buffer::new(ctx, "twin dummy", 16, MemoryLocation::GpuOnly).unwrap();
    let pool = DescriptorPool::new(ctx, 1, 3).unwrap();
    let set = pool.set(pipes.state_layout, &[&[scratch.info()], &[dummy.info()], &[dummy.info()]]).unwrap();
    cmds.upload(&scratch, 0, &x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    cmds.begin().unwrap();
    let mut rec = Recorder::new(ctx, pipes, cmds.cmd);
    rec.matvec(&m, set, MatvecPush { x_off: 0, y_off: cols as u32, ..Default::default() });
    rec.barrier(vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_WRITE, vk::PipelineStageFlags::TRANSFER);
    cmds.submit().unwrap();
    let bytes = cmds.download(&scratch, (cols * 4) as u64, rows * 4).unwrap();
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

#[test]
fn matvec_matches_cpu_for_every_type() {
    std::env::set_var("FNX_VULKAN_VALIDATION", "1");
    let ctx = match Context::new(&DeviceChoice::default()) {
        Ok(c) => Arc::new(c),
        Err(e) if std::env::var("FNX_REQUIRE_VULKAN").as_deref() != Ok("1") => {
            println!("SKIPPED: no usable Vulkan device ({e})");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let pipes = Pipelines::new(&ctx).unwrap();
    let (rows, cols) = (37, 96);
    let x: Vec<f32> = (0..cols).map(|i| ((i * 7 % 13) as f32 - 6.0) / 6.0).collect();
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0] {
        let w = tensor(ty, rows, cols);
        let mut want = vec![0f32; rows];
        w.matvec(&x, &mut want);
        let got = gpu_matvec(&ctx, &pipes, &w, &x);
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
        assert!(err <= 1e-6, "{ty}: GPU vs CPU matvec rel err {err}");
    }
    drop(pipes);
    assert_eq!(validation_errors(), 0, "Vulkan validation errors (printed above)");
}
