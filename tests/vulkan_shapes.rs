//! The Vulkan backend at the real model's head sizes (attention head dim
//! 256, Gated DeltaNet head dim 128, indexer head dim 128, GQA, 10 of 32
//! experts, fused expert tensors, a tied LM head) on a generated model with
//! a small hidden size: the shaders' workgroup limits are reached exactly,
//! which the reference fixtures do not do. The CPU forward pass is the twin.

mod common;
mod vulkan_util;

use common::{TinyConfig, TinyModel};
use flashnext::model::{Model, State};
use vulkan_util::{cpu_twin, load_gpu, rel_err};

#[test]
fn real_head_sizes_match_cpu() {
    let cfg = TinyConfig {
        hidden: 64,
        vocab: 300,
        recurrent: vec![true, true, false, true, false],
        hc: 4,
        hc_rank: 8,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 256,
        rope_dims: 64,
        ssm_k_heads: 2,
        ssm_v_heads: 4,
        ssm_head_dim: 128,
        n_experts: 32,
        n_experts_used: 10,
        expert_ff: 32,
        shared_ff: 32,
        fused_experts: true,
        output_head: false,
        indexer_heads: 4,
        indexer_dim: 128,
        compress_ratio: 4,
        budget: 16,
        ..TinyConfig::default()
    };
    let dir = std::env::temp_dir().join(format!("flashnext-vk-shapes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.gguf");
    TinyModel::build(&cfg).write(&path);
    let Some(gpu_model) = load_gpu(&path) else { return };
    let cpu_model = Model::load(&path, &cpu_twin()).unwrap();
    let (mut gpu, mut cpu) = (State::new(gpu_model).unwrap(), State::new(cpu_model).unwrap());
    let mut worst = 0f32;
    // 80 tokens: 20 QSA blocks per attention layer, more than the 4 the budget keeps.
    for i in 0..80u32 {
        let t = (i * 53 + 7) % 300;
        gpu.decode(t).unwrap();
        cpu.decode(t).unwrap();
        worst = worst.max(rel_err(gpu.logits().unwrap(), cpu.logits().unwrap()));
    }
    println!("real head sizes: GPU vs CPU max {worst:.3e} over 80 positions");
    assert!(worst <= 1e-4, "GPU vs CPU {worst}");
    assert_eq!(flashnext::vulkan::validation_errors(), 0, "Vulkan validation errors (printed above)");
    std::fs::remove_dir_all(&dir).ok();
}
