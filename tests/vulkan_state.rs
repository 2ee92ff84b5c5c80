//! The Vulkan backend's plumbing, one test run in sequence (it sets
//! process-wide environment variables): matrices and expert slabs split to
//! fit small bindings, checkpoints/rollback/copies/snapshots of GPU states
//! (also moved between the GPU and the CPU), the VRAM budget, the
//! environment overrides and the C ABI's statuses. Validation errors fail it.

mod vulkan_util;

use flashnext::capi::*;
use flashnext::convert::OutType;
use flashnext::model::BackendKind;
use flashnext::{Backend, LoadOptions, Model, State};
use std::path::Path;
use vulkan_util::{converted, cpu_twin, load_gpu, rel_err};

/// Tokens of a sequence long enough to complete several QSA blocks.
fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % 300).collect()
}

fn logits(s: &State) -> Vec<f32> {
    s.logits().unwrap().to_vec()
}

/// A split model against the CPU, and state copies taken halfway.
fn split_and_copies(path: &Path, gpu_model: std::sync::Arc<Model>) {
    let cpu_model = Model::load(path, &cpu_twin()).unwrap();
    let seq = tokens(40);
    let (mut gpu, mut cpu) = (State::new(gpu_model.clone()).unwrap(), State::new(cpu_model.clone()).unwrap());
    for &t in &seq[..20] {
        gpu.decode(t).unwrap();
        cpu.decode(t).unwrap();
        assert!(rel_err(&logits(&gpu), &logits(&cpu)) <= 1e-4, "split model vs CPU");
    }
    let snapshot = gpu.save().unwrap();
    let mut copy = gpu.try_clone().unwrap();
    // An aborted multi-token decode rolls back (GPU buffers restored): the
    // ten tokens are one pass, aborted at its first poll between layers.
    let mut polls = 0;
    let mut abort = || {
        polls += 1;
        polls > 1
    };
    assert!(flashnext::generate::decode_tokens(&mut gpu, &seq[20..30], &mut abort).is_err());
    assert_eq!(gpu.position(), 20);
    // A GPU snapshot restored on the CPU, a CPU snapshot restored on the GPU.
    let mut from_gpu = State::new(cpu_model).unwrap();
    from_gpu.restore(&snapshot).unwrap();
    let mut from_cpu = State::new(gpu_model).unwrap();
    from_cpu.restore(&cpu.save().unwrap()).unwrap();
    gpu.decode_tokens(&seq[20..30]).unwrap();
    for &t in &seq[20..30] {
        cpu.decode(t).unwrap();
        copy.decode(t).unwrap();
        from_gpu.decode(t).unwrap();
        from_cpu.decode(t).unwrap();
        let want = logits(&cpu);
        for (what, s) in [("try_clone", &copy), ("GPU snapshot on the CPU", &from_gpu), ("CPU snapshot on the GPU", &from_cpu)] {
            assert!(rel_err(&logits(s), &want) <= 1e-4, "{what}: {}", rel_err(&logits(s), &want));
        }
    }
    assert!(rel_err(&logits(&gpu), &logits(&cpu)) <= 1e-4, "decode_tokens after a rollback");
    if std::env::var("FNX_VULKAN_INITIAL_CAPACITY").is_ok() {
        assert_eq!(gpu.capacity(), 32, "caches grew from 8 to hold 30 positions");
        for &t in &seq[30..] {
            gpu.decode(t).unwrap();
            cpu.decode(t).unwrap();
            assert!(rel_err(&logits(&gpu), &logits(&cpu)) <= 1e-4, "after growing to {:?}", gpu.capacity());
        }
        assert_eq!(gpu.capacity(), 64);
    }
}

/// `fnx_load` with `FNX_BACKEND_VULKAN`: decodes, and reports a missing
/// device and an exhausted budget with their statuses.
fn c_abi_statuses(path: &Path) {
    let c_path = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    let load = |device_index: i32, vram_budget_mb: u64| {
        let mut p = fnx_load_params_default();
        p.backend = FNX_BACKEND_VULKAN;
        p.device_index = device_index;
        p.vram_budget_mb = vram_budget_mb;
        let mut model: *mut fnx_model = std::ptr::null_mut();
        // SAFETY: valid C string, params and out pointer.
        let status = unsafe { fnx_load(c_path.as_ptr(), &p, &mut model) };
        (status, model)
    };
    assert_eq!(load(99, 0).0, FNX_ERR_BACKEND_UNAVAILABLE);
    assert_eq!(load(0, 1).0, FNX_ERR_OUT_OF_MEMORY);
    let (status, model) = load(0, 0);
    assert_eq!(status, FNX_OK);
    let mut state: *mut fnx_state = std::ptr::null_mut();
    // SAFETY: live handles from fnx_load / fnx_new_state, freed once.
    unsafe {
        assert_eq!(fnx_new_state(model, &mut state), FNX_OK);
        assert_eq!(fnx_decode_token(state, 5), FNX_OK);
        fnx_free_state(state);
        fnx_free_model(model);
    }
}

#[test]
fn split_copies_budget_and_overrides() {
    // 40000-byte bindings: two matrices split, the experts take 16 slabs.
    std::env::set_var("FNX_VULKAN_MAX_BINDING_BYTES", "40000");
    let path = converted("tiny_flat", OutType::F32);
    let Some(gpu_model) = load_gpu(&path) else { return };
    let dispatches = |m: &std::sync::Arc<Model>| {
        let mut s = State::new(m.clone()).unwrap();
        s.decode(1).unwrap();
        s.pass_stats().unwrap().dispatches
    };
    let split = dispatches(&gpu_model);
    // Caches that start at 8 positions grow (to 16, 32, 64) during the
    // copies, rollbacks and snapshots; every logit is still the CPU's.
    std::env::set_var("FNX_VULKAN_INITIAL_CAPACITY", "8");
    split_and_copies(&path, gpu_model);
    std::env::remove_var("FNX_VULKAN_INITIAL_CAPACITY");
    std::env::remove_var("FNX_VULKAN_MAX_BINDING_BYTES");
    // At least the LM head (61440 bytes) and the fused attention input
    // projection (104448) split: one more dispatch per extra chunk.
    let whole = dispatches(&load_gpu(&path).unwrap());
    assert!(split >= whole + 2, "split {split} dispatches, unsplit {whole}");

    let budget = LoadOptions { backend: Backend::Vulkan, vram_budget_mb: 1, ..Default::default() };
    match Model::load(&path, &budget) {
        Err(flashnext::Error::OutOfMemory(m)) => assert!(m.contains("VRAM budget"), "{m}"),
        other => panic!("a 1 MiB budget must not fit: {:?}", other.map(|_| ())),
    }
    std::env::set_var("FNX_VRAM_BUDGET_MB", "0");
    assert!(Model::load(&path, &budget).unwrap().backend_kind() == BackendKind::Vulkan, "FNX_VRAM_BUDGET_MB wins over the params");
    std::env::set_var("FNX_BACKEND", "cpu");
    let vulkan = LoadOptions { backend: Backend::Vulkan, ..Default::default() };
    assert!(Model::load(&path, &vulkan).unwrap().backend_kind() == BackendKind::Cpu, "FNX_BACKEND wins over the params");
    std::env::set_var("FNX_BACKEND", "vulkan");
    std::env::set_var("FNX_DEVICE", "99");
    match Model::load(&path, &LoadOptions::default()) {
        Err(flashnext::Error::Backend(m)) => assert!(m.contains("device 99"), "{m}"),
        other => panic!("FNX_DEVICE=99 must be unavailable: {:?}", other.map(|_| ())),
    }
    // Auto never fails: device 99 does not exist, so the CPU, and the note says why.
    std::env::set_var("FNX_BACKEND", "auto");
    let m = Model::load(&path, &LoadOptions::default()).unwrap();
    assert!(m.backend_kind() == BackendKind::Cpu && m.backend_note().contains("device 99"), "{}", m.backend_note());
    std::env::remove_var("FNX_DEVICE");
    // Auto takes a hardware GPU, never a software one such as lavapipe.
    let hardware = flashnext::vulkan::probe().unwrap().iter().any(|d| {
        matches!(d.kind, flashnext::vulkan::DeviceKind::Discrete | flashnext::vulkan::DeviceKind::Integrated)
    });
    let m = Model::load(&path, &LoadOptions::default()).unwrap();
    assert_eq!(m.backend_kind() == BackendKind::Vulkan, hardware, "{}", m.backend_note());
    assert!(m.backend_note().starts_with(if hardware { "vulkan on" } else { "cpu (auto: no hardware GPU" }), "{}", m.backend_note());
    for v in ["FNX_VRAM_BUDGET_MB", "FNX_BACKEND", "FNX_DEVICE"] {
        std::env::remove_var(v);
    }
    c_abi_statuses(&path);
    assert_eq!(flashnext::vulkan::validation_errors(), 0, "Vulkan validation errors (printed above)");
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
}
