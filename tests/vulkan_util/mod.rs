//! Helpers shared by the Vulkan tests: fixtures converted to GGUF, the GPU
//! model (or a printed skip when no Vulkan device exists and none is
//! required), the relative error.

#![allow(dead_code)]

#[path = "../process_dir/mod.rs"]
mod process_dir;

use flashnext::convert::{convert, ConvertOptions, OutType};
use flashnext::{Backend, LoadOptions, Model};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use process_dir::process_dir;

/// `FNX_REPO_DIR` lets a test binary built elsewhere find the fixtures (scripts/h200-vulkan.sh).
pub fn fixture_dir(name: &str) -> PathBuf {
    let root = std::env::var("FNX_REPO_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").into());
    Path::new(&root).join("tests/fixtures").join(name)
}

pub fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path).unwrap().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

/// The two ways Vulkan can be missing altogether (any other failure is a bug).
fn is_absent(why: &str) -> bool {
    why.contains("cannot load the Vulkan loader") || why.contains("no Vulkan device found")
}

/// The GPU model, or `None` (after saying why) when no Vulkan device exists
/// and none is required.
pub fn load_gpu(path: &Path) -> Option<Arc<Model>> {
    load_gpu_with(path, LoadOptions::default())
}

/// [`load_gpu`] with other options (the backend is set to Vulkan). The GPU
/// runs its exact kernels unless `opts` asks for others: the tests' bounds
/// against the CPU and transformers are the exact path's (the default on a
/// GPU with accelerated 8-bit dot products is the fast path, tested apart).
pub fn load_gpu_with(path: &Path, opts: LoadOptions) -> Option<Arc<Model>> {
    std::env::set_var("FNX_VULKAN_VALIDATION", "1");
    let gpu_kernels = opts.gpu_kernels.or(Some(flashnext::quant::kernels::Kernels::Exact));
    let opts = LoadOptions { backend: Backend::Vulkan, gpu_kernels, ..opts };
    match Model::load(path, &opts) {
        Ok(m) => Some(m),
        Err(flashnext::Error::Backend(why))
            if std::env::var("FNX_REQUIRE_VULKAN").as_deref() != Ok("1") && is_absent(&why) =>
        {
            println!("SKIPPED: no usable Vulkan device ({why}); set FNX_REQUIRE_VULKAN=1 to make this a failure");
            None
        }
        Err(e) => panic!("loading for Vulkan: {e}"),
    }
}

/// `fixture` converted to `ty`, once per test process (tests running in
/// parallel share the file), in the process's directory ([`process_dir`]).
pub fn converted(fixture: &str, ty: OutType) -> PathBuf {
    static DONE: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let key = format!("{fixture}-{ty:?}");
    let mut done = DONE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = done.iter().find(|(k, _)| *k == key) {
        return p.clone();
    }
    let dir = process_dir("flashnext-vk").join(&key);
    std::fs::create_dir_all(&dir).unwrap();
    let gguf = dir.join("model.gguf");
    convert(&fixture_dir(fixture).join("hf"), &gguf, &ConvertOptions { out_type: ty, ..Default::default() }).unwrap();
    done.push((key, gguf.clone()));
    gguf
}

/// Load options of the GPU's CPU twin: the CPU backend with the exact
/// kernels (the shaders multiply the dequantized weights with f32
/// activations, as those do; the CPU's default fast kernels round the
/// activations to 8 bits first).
#[allow(dead_code)] // not every test compares with the CPU
pub fn cpu_twin() -> LoadOptions {
    LoadOptions { backend: Backend::Cpu, cpu_kernels: Some(flashnext::quant::kernels::Kernels::Exact), ..Default::default() }
}
