//! Shared by the C ABI tests: reference fixtures converted to GGUF once per
//! test binary, and small wrappers over the raw C calls.
#![allow(dead_code)]

#[path = "../process_dir/mod.rs"]
mod process_dir;

use flashnext::capi::*;
use flashnext::convert::{convert, ConvertOptions, OutType};
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub use process_dir::process_dir;

pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The first reference fixture (sorted by name), converted to F32 GGUF.
pub fn fixture_gguf() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let mut names: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.join("hf/config.json").exists())
            .collect();
        names.sort();
        let out = process_dir("flashnext-capi").join("model.gguf");
        convert(&names[0].join("hf"), &out, &ConvertOptions { out_type: OutType::F32, ..Default::default() })
            .expect("fixture converts");
        out
    })
}

pub fn last_error() -> String {
    // SAFETY: fnx_last_error always returns a valid NUL-terminated string.
    unsafe { CStr::from_ptr(fnx_last_error()) }.to_string_lossy().into_owned()
}

pub fn load(path: &Path, params: Option<&fnx_load_params>) -> Result<*mut fnx_model, (fnx_status, String)> {
    let c = CString::new(path.to_str().unwrap()).unwrap();
    let mut m = std::ptr::null_mut();
    let p = params.map_or(std::ptr::null(), |p| p as *const _);
    // SAFETY: valid string, params and out pointer.
    match unsafe { fnx_load(c.as_ptr(), p, &mut m) } {
        FNX_OK => Ok(m),
        st => {
            assert!(m.is_null(), "out_model written on failure");
            Err((st, last_error()))
        }
    }
}

pub fn new_state(m: *mut fnx_model) -> *mut fnx_state {
    let mut s = std::ptr::null_mut();
    // SAFETY: live model handle.
    assert_eq!(unsafe { fnx_new_state(m, &mut s) }, FNX_OK, "{}", last_error());
    s
}

pub fn logits(s: *const fnx_state, vocab: usize) -> Vec<f32> {
    let mut v = vec![0f32; vocab];
    // SAFETY: live state, buffer of `vocab` floats.
    assert_eq!(unsafe { fnx_get_logits(s, v.as_mut_ptr(), vocab) }, FNX_OK, "{}", last_error());
    v
}
