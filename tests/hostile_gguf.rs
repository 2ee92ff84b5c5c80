//! Hostile and malformed GGUF files: each must be refused with an `Err` from
//! the Rust API (from a path and from memory) and, through the C ABI, with the
//! right status (`FNX_ERR_INVALID_FILE` for container errors,
//! `FNX_ERR_INVALID_MODEL` for model errors, `FNX_ERR_IO` for unreadable
//! paths), `*out_model` untouched and a message naming the problem. Random
//! mutations of a valid file must never panic.
//!
//! Files come from the generator in `tests/common/mod.rs` (a small, complete
//! qwen4exp model) and its raw-container view for what a writer would refuse
//! to produce. Regressions (fuzzing and review findings) live at the end. A
//! tracking global allocator also checks that refusing a file never reserves
//! memory out of proportion to its size.

mod common;

use common::*;
use flashnext::capi::*;
use flashnext::gguf::{GgmlType, GgufFile, Value};
use flashnext::{LoadOptions, Model, State};
use flashnext::Error;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::ffi::{CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

// ---- harness ----------------------------------------------------------------

/// The system allocator, noting the largest single request made by each
/// thread, so tests can check that a hostile file cannot make the loader
/// reserve memory out of proportion to its size.
struct Tracking;

thread_local! {
    static MAX_ALLOC: Cell<usize> = const { Cell::new(0) };
}

fn note_alloc(size: usize) {
    let _ = MAX_ALLOC.try_with(|m| m.set(m.get().max(size)));
}

// SAFETY: forwards every call to `System` unchanged; only records sizes.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note_alloc(l.size());
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note_alloc(l.size());
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        note_alloc(new_size);
        unsafe { System.realloc(p, l, new_size) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOCATOR: Tracking = Tracking;

/// Runs `f` and returns its result with the largest single allocation it
/// requested on this thread.
fn largest_alloc<R>(f: impl FnOnce() -> R) -> (R, usize) {
    MAX_ALLOC.with(|m| m.set(0));
    let r = f();
    (r, MAX_ALLOC.with(|m| m.get()))
}

/// Largest single allocation a refused file may cause (all test files are < 1 MB).
const REFUSED_ALLOC_LIMIT: usize = 16 << 20;

/// Which family of error a case must produce.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// `Error::Format` / `FNX_ERR_INVALID_FILE`.
    File,
    /// `Error::Model` / `FNX_ERR_INVALID_MODEL`.
    Model,
}

impl Kind {
    fn status(self) -> fnx_status {
        match self {
            Kind::File => FNX_ERR_INVALID_FILE,
            Kind::Model => FNX_ERR_INVALID_MODEL,
        }
    }
    fn matches(self, e: &Error) -> bool {
        matches!((self, e), (Kind::File, Error::Format(_)) | (Kind::Model, Error::Model(_)))
    }
}

/// A file in the temp dir, removed on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new(bytes: &[u8]) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "flashnext-hostile-{}-{}.gguf",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&p, bytes).unwrap();
        TempFile(p)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn last_error() -> String {
    // SAFETY: fnx_last_error always returns a valid NUL-terminated string.
    unsafe { CStr::from_ptr(fnx_last_error()) }.to_string_lossy().into_owned()
}

/// Calls `fnx_load` on `path` with a sentinel in `*out_model`; returns the
/// status and message, and checks the sentinel survived a failure.
fn c_load(path: &Path) -> (fnx_status, String) {
    let c = CString::new(path.to_str().unwrap()).unwrap();
    let sentinel = 0x5eed_usize as *mut fnx_model;
    let mut m = sentinel;
    // SAFETY: valid string and out pointer; NULL params = defaults.
    let st = unsafe { fnx_load(c.as_ptr(), std::ptr::null(), &mut m) };
    if st == FNX_OK {
        // SAFETY: a live handle just returned by fnx_load.
        unsafe { fnx_free_model(m) };
        return (st, String::new());
    }
    assert_eq!(m, sentinel, "fnx_load wrote *out_model on failure (status {st})");
    (st, last_error())
}

fn from_memory(bytes: &[u8]) -> flashnext::Result<Arc<Model>> {
    Model::from_bytes(Arc::new(bytes.to_vec()), &LoadOptions::default())
}

/// `bytes` must be refused as `kind` with a message containing one of
/// `needles`, by `Model::load`, `Model::from_bytes` and `fnx_load`.
#[track_caller]
fn refused_any(bytes: &[u8], kind: Kind, needles: &[&str]) {
    let hit = |msg: &str| needles.iter().any(|n| msg.contains(n));
    let f = TempFile::new(bytes);
    match Model::load(&f.0, &LoadOptions::default()) {
        Ok(_) => panic!("Model::load accepted a file that should fail with {needles:?}"),
        Err(e) => {
            assert!(kind.matches(&e), "Model::load: expected a {kind:?} error, got {e:?}");
            assert!(hit(&e.to_string()), "Model::load: message {:?} lacks {needles:?}", e.to_string());
        }
    }
    let (r, biggest) = largest_alloc(|| from_memory(bytes));
    assert!(
        biggest <= REFUSED_ALLOC_LIMIT.max(2 * bytes.len()),
        "refusing a {}-byte file allocated {biggest} bytes at once ({needles:?})",
        bytes.len()
    );
    match r {
        Ok(_) => panic!("Model::from_bytes accepted a file that should fail with {needles:?}"),
        Err(e) => {
            assert!(kind.matches(&e), "Model::from_bytes: expected a {kind:?} error, got {e:?}");
            assert!(hit(&e.to_string()), "Model::from_bytes: message {:?} lacks {needles:?}", e.to_string());
        }
    }
    let (st, msg) = c_load(&f.0);
    assert_eq!(st, kind.status(), "fnx_load status {st} for {needles:?}: {msg}");
    assert!(hit(&msg), "fnx_last_error {msg:?} lacks {needles:?}");
}

#[track_caller]
fn refused(bytes: &[u8], kind: Kind, needle: &str) {
    refused_any(bytes, kind, &[needle]);
}

/// Same, for a model variant.
#[track_caller]
fn refused_model(m: &TinyModel, needle: &str) {
    refused(&m.to_bytes(), Kind::Model, needle);
}

/// `bytes` loads from memory and from a path (C ABI too) and decodes a few
/// tokens with finite logits. Returns the model.
#[track_caller]
fn loads(bytes: &[u8]) -> Arc<Model> {
    let m = from_memory(bytes).unwrap_or_else(|e| panic!("valid model refused: {e}"));
    let f = TempFile::new(bytes);
    Model::load(&f.0, &LoadOptions::default()).unwrap_or_else(|e| panic!("valid model refused from a path: {e}"));
    let (st, msg) = c_load(&f.0);
    assert_eq!(st, FNX_OK, "fnx_load refused a valid model: {msg}");
    let mut s = State::new(m.clone()).unwrap();
    for tok in [1u32, 5, 9, 1, 3, 7, 2] {
        s.decode(tok % m.vocab_size() as u32).unwrap();
        let l = s.logits().unwrap();
        assert_eq!(l.len(), m.vocab_size());
        assert!(l.iter().all(|x| x.is_finite()), "non-finite logits");
    }
    m
}

/// The default valid model, serialized once.
fn valid() -> &'static [u8] {
    static B: OnceLock<Vec<u8>> = OnceLock::new();
    B.get_or_init(|| TinyModel::new().to_bytes())
}

/// Byte layout of the valid file: end of the tensor infos, start of the data
/// section, and each tensor's absolute `(start, end)`.
struct FileLayout {
    infos_end: usize,
    data_start: usize,
    tensors: Vec<(String, usize, usize)>,
}

fn layout() -> FileLayout {
    let raw = TinyModel::new().to_raw();
    let infos_end = raw.header_bytes().len();
    let data_start = infos_end.div_ceil(32) * 32;
    let f = GgufFile::from_storage(Arc::new(valid().to_vec())).unwrap();
    let tensors = f.tensors.iter().map(|t| (t.name.clone(), t.offset, t.offset + t.nbytes)).collect();
    FileLayout { infos_end, data_start, tensors }
}

fn arr_u64(v: &[u64]) -> Value {
    Value::Array(10, v.iter().map(|&x| Value::U64(x)).collect())
}

fn arr_i32(v: &[i32]) -> Value {
    Value::Array(5, v.iter().map(|&x| Value::I32(x)).collect())
}

// ---- the valid model and legal variants ---------------------------------------

#[test]
fn valid_model_loads_and_decodes() {
    let m = loads(valid());
    let c = &m.config;
    assert_eq!((c.n_layers, c.hidden, c.hc, c.vocab), (4, 32, 2, 64));
    assert_eq!(c.layers[3], flashnext::model::LayerKind::Attention { compress_ratio: 2 });
    assert!(c.layers[..3].iter().all(|l| *l == flashnext::model::LayerKind::Linear));
    assert_eq!(c.ple.as_ref().map(|p| p.layer), Some(1));
    assert!(c.qsa.is_some());
    assert_eq!((c.n_experts, c.n_experts_used), (4, 2));
    // Long enough for QSA to select among complete blocks (budget 4, ratio 2).
    let mut s = State::new(m.clone()).unwrap();
    for t in 0..24u32 {
        s.decode((t * 7 + 3) % 64).unwrap();
        assert!(s.logits().unwrap().iter().all(|x| x.is_finite()));
    }
}

#[test]
fn raw_encoder_matches_the_writer() {
    let m = TinyModel::new();
    assert_eq!(m.to_raw().to_bytes(), m.to_bytes(), "RawGguf and GgufWriter disagree");
}

#[test]
fn legal_variants_load() {
    let base = TinyConfig::default();
    for c in [
        TinyConfig { fused_experts: true, ..base.clone() },
        TinyConfig { output_head: false, ..base.clone() },
        TinyConfig { ple_layer: None, ..base.clone() },
        TinyConfig { ple_layer: Some(0), ..base.clone() },
        TinyConfig { compress_ratio: 0, ..base.clone() },
        TinyConfig { recurrent: vec![true, false, true, false], ple_layer: Some(2), ..base.clone() },
        TinyConfig { ssm_v_heads: 2, ..base.clone() },
    ] {
        loads(&TinyModel::build(&c).to_bytes());
    }
    // Other computable types for the matrices.
    for ty in [GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0] {
        let mut m = TinyModel::new();
        for name in ["token_embd.weight", "blk.0.attn_qkv.weight", "blk.3.attn_q.weight", "blk.2.ffn_up_exps.weight"] {
            m.set_type(name, ty);
        }
        m.set_type("blk.1.hc_ffn_norm.weight", ty);
        loads(&m.to_bytes());
    }
    // Norm gammas as {H, C} instead of {C*H}; the shared-expert gate as {H}.
    let mut m = TinyModel::new();
    m.tensor_mut("blk.0.hc_attn_norm.weight").dims = vec![32, 2];
    m.tensor_mut("blk.1.ple_norm_key.weight").dims = vec![32, 2];
    m.tensor_mut("blk.2.ffn_gate_inp_shexp.weight").dims = vec![32];
    loads(&m.to_bytes());
    // No recurrent_layers: the interval (4) gives the same pattern.
    let mut m = TinyModel::new();
    m.remove_key("qwen4exp.attention.recurrent_layers");
    loads(&m.to_bytes());
    // Another power-of-two alignment, declared and used.
    let mut m = TinyModel::new();
    m.set("general.alignment", Value::U32(64));
    let src = m.to_raw();
    let mut raw = RawGguf { alignment: 64, data: Vec::new(), tensors: Vec::new(), ..src.clone() };
    for t in &m.tensors {
        raw.push_tensor(&t.name, &t.dims.iter().map(|&d| d as u64).collect::<Vec<_>>(), t.ty.id(), &t.encode());
    }
    loads(&raw.to_bytes());
}

// ---- the container -----------------------------------------------------------

#[test]
fn unreadable_paths_are_io_errors() {
    let missing = std::env::temp_dir().join(format!("flashnext-hostile-missing-{}.gguf", std::process::id()));
    let e = Model::load(&missing, &LoadOptions::default()).err().expect("missing file refused");
    assert!(matches!(e, Error::Io { .. }), "{e:?}");
    assert!(e.to_string().contains("cannot open"), "{e}");
    let (st, msg) = c_load(&missing);
    assert_eq!(st, FNX_ERR_IO, "{msg}");
    assert!(msg.contains("cannot open"), "{msg}");

    let dir = std::env::temp_dir();
    let e = Model::load(&dir, &LoadOptions::default()).err().expect("directory refused");
    assert!(matches!(e, Error::Io { .. }), "{e:?}");
    let (st, msg) = c_load(&dir);
    assert_eq!(st, FNX_ERR_IO, "{msg}");
}

#[test]
fn empty_file() {
    refused(&[], Kind::File, "shorter than its 4-byte magic");
}

#[test]
fn wrong_magic() {
    for magic in [*b"GGUG", *b"ggml", *b"\0\0\0\0", *b"FUGG"] {
        let mut b = valid().to_vec();
        b[..4].copy_from_slice(&magic);
        refused(&b, Kind::File, "not a GGUF file");
    }
    refused(b"GGU", Kind::File, "not a GGUF file");
    refused(b"PK\x03\x04 this is a zip file", Kind::File, "not a GGUF file");
}

#[test]
fn wrong_version() {
    for v in [0u32, 1, 2, 4, 0x0300_0000, u32::MAX] {
        let mut raw = TinyModel::new().to_raw();
        raw.version = v;
        refused(&raw.to_bytes(), Kind::File, &format!("unsupported GGUF version {v}"));
    }
}

#[test]
fn truncated_at_every_header_prefix() {
    let b = valid();
    let l = layout();
    // Every prefix up to and including the data start (where all tensors lie outside).
    for n in 0..=l.data_start {
        let e = from_memory(&b[..n]).err().unwrap_or_else(|| panic!("prefix of {n} bytes loaded"));
        let msg = e.to_string();
        assert!(matches!(e, Error::Format(_)), "prefix {n}: {e:?}");
        assert!(
            ["truncated", "bytes left", "shorter than its 4-byte magic", "outside", "cannot fit"]
                .iter()
                .any(|s| msg.contains(s)),
            "prefix {n}: {msg}"
        );
        if n % 61 == 0 || n == l.infos_end || n == l.data_start {
            refused_any(
                &b[..n],
                Kind::File,
                &["truncated", "bytes left", "shorter than its 4-byte magic", "outside", "cannot fit"],
            );
        }
    }
}

#[test]
fn truncated_in_the_data() {
    let b = valid();
    let l = layout();
    let last_end = l.tensors.iter().map(|t| t.2).max().unwrap();
    let mut cuts = vec![l.data_start + 1, last_end - 1, last_end - 4];
    for (i, (_, start, end)) in l.tensors.iter().enumerate() {
        if i % 7 == 0 {
            cuts.push((start + end) / 2);
            cuts.push(*end - 1);
        }
    }
    for n in cuts {
        refused(&b[..n], Kind::File, "outside");
    }
    // The zero padding after the last tensor is not needed.
    assert!(from_memory(&b[..last_end]).is_ok());
}

#[test]
fn absurd_counts() {
    for n in [1u64 << 21, 1 << 40, 1 << 63, u64::MAX] {
        let mut raw = TinyModel::new().to_raw();
        raw.tensor_count = Some(n);
        refused(&raw.to_bytes(), Kind::File, "absurd header");
        let mut raw = TinyModel::new().to_raw();
        raw.kv_count = Some(n);
        refused(&raw.to_bytes(), Kind::File, "absurd header");
    }
    // Counts within the limit but more than the file holds.
    let mut raw = TinyModel::new().to_raw();
    raw.tensor_count = Some(1 << 20);
    refused_any(&raw.to_bytes(), Kind::File, &["truncated", "bytes left", "dimensions"]);
    let mut raw = TinyModel::new().to_raw();
    raw.kv_count = Some(1 << 20);
    refused(&raw.to_bytes(), Kind::File, "metadata key #");
    // One entry too few / too many: the next field is misread, which is caught.
    for delta in [-1i64, 1] {
        let mut raw = TinyModel::new().to_raw();
        raw.kv_count = Some((raw.kv.len() as i64 + delta) as u64);
        let e = from_memory(&raw.to_bytes()).err().expect("miscounted metadata refused");
        assert!(matches!(e, Error::Format(_) | Error::Model(_)), "{e:?}");
        let mut raw = TinyModel::new().to_raw();
        raw.tensor_count = Some((raw.tensors.len() as i64 + delta) as u64);
        let e = from_memory(&raw.to_bytes()).err().expect("miscounted tensors refused");
        assert!(matches!(e, Error::Format(_) | Error::Model(_)), "{e:?}");
    }
}

/// Overwrites the little-endian u64 at `pos` in `b` (a string or array length).
fn set_u64(b: &mut [u8], pos: usize, v: u64) {
    b[pos..pos + 8].copy_from_slice(&v.to_le_bytes());
}

#[test]
fn absurd_string_lengths() {
    let b = valid();
    // The first key's length sits right after the 24-byte header.
    for len in [u64::MAX, 1 << 63, 1 << 32, b.len() as u64] {
        let mut m = b.to_vec();
        set_u64(&mut m, 24, len);
        refused(&m, Kind::File, "exceeds");
    }
    // A string value (general.architecture is the first entry).
    let key_len = "general.architecture".len();
    let val_len_at = 24 + 8 + key_len + 4;
    let mut m = b.to_vec();
    set_u64(&mut m, val_len_at, u64::MAX - 3);
    refused(&m, Kind::File, "exceeds");
    // A tensor name.
    let l = layout();
    let mut raw = TinyModel::new().to_raw();
    let first_name_at = raw.header_bytes().len()
        - raw.tensors.iter().map(|t| 8 + t.name.len() + 4 + 8 * t.dims.len() + 4 + 8).sum::<usize>();
    let mut m = b.to_vec();
    set_u64(&mut m, first_name_at, 1 << 40);
    refused(&m, Kind::File, "exceeds");
    assert!(first_name_at < l.infos_end);
    // A strings array element.
    let kv = raw.kv_mut("tokenizer.ggml.merges");
    kv.payload[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
    refused(&raw.to_bytes(), Kind::File, "exceeds");
}

#[test]
fn absurd_array_lengths() {
    for (key, count) in [
        ("tokenizer.ggml.tokens", u64::MAX),
        ("tokenizer.ggml.tokens", 1 << 61),
        ("qwen4exp.ple.head_offsets", 1 << 61),
        ("qwen4exp.ple.head_offsets", u64::MAX / 8 + 1),
        ("qwen4exp.attention.recurrent_layers", 1 << 40),
        ("qwen4exp.rope.dimension_sections", 1 << 62),
    ] {
        let mut raw = TinyModel::new().to_raw();
        raw.kv_mut(key).payload[4..12].copy_from_slice(&count.to_le_bytes());
        refused(&raw.to_bytes(), Kind::File, "cannot fit");
    }
    // Claims exactly one element more than it has: the rest of the file is misread.
    let mut raw = TinyModel::new().to_raw();
    let kv = raw.kv_mut("qwen4exp.attention.recurrent_layers");
    kv.payload[4..12].copy_from_slice(&5u64.to_le_bytes());
    let e = from_memory(&raw.to_bytes()).err().expect("refused");
    assert!(matches!(e, Error::Format(_)), "{e:?}");
}

#[test]
fn unknown_value_types() {
    for ty in [13u32, 14, 255, 0x8000_0000, u32::MAX] {
        let mut raw = TinyModel::new().to_raw();
        raw.kv_mut("general.name").ty = ty;
        refused(&raw.to_bytes(), Kind::File, &format!("unknown value type {ty}"));
        let mut raw = TinyModel::new().to_raw();
        raw.kv_mut("tokenizer.ggml.tokens").payload[..4].copy_from_slice(&ty.to_le_bytes());
        refused(&raw.to_bytes(), Kind::File, &format!("unknown array element type {ty}"));
    }
}

#[test]
fn nested_arrays() {
    let mut raw = TinyModel::new().to_raw();
    // An array of one array of one u32.
    let mut payload = Vec::new();
    payload.extend_from_slice(&9u32.to_le_bytes());
    payload.extend_from_slice(&1u64.to_le_bytes());
    payload.extend_from_slice(&4u32.to_le_bytes());
    payload.extend_from_slice(&1u64.to_le_bytes());
    payload.extend_from_slice(&7u32.to_le_bytes());
    raw.kv.push(RawKv::raw("general.nested", 9, payload));
    refused(&raw.to_bytes(), Kind::File, "nested arrays");
    // Empty nested array: still refused.
    let mut raw = TinyModel::new().to_raw();
    let mut payload = 9u32.to_le_bytes().to_vec();
    payload.extend_from_slice(&0u64.to_le_bytes());
    raw.kv.push(RawKv::raw("general.nested", 9, payload));
    refused(&raw.to_bytes(), Kind::File, "nested arrays");
}

#[test]
fn bad_scalar_encodings() {
    let mut raw = TinyModel::new().to_raw();
    raw.kv.push(RawKv::raw("general.flag", 7, vec![2]));
    refused(&raw.to_bytes(), Kind::File, "boolean byte is 2");
    let mut raw = TinyModel::new().to_raw();
    raw.kv_mut("qwen4exp.attention.recurrent_layers").payload[12] = 0xff;
    refused(&raw.to_bytes(), Kind::File, "boolean byte is 255");
    // Invalid UTF-8 in a key, a string value, a string array element and a tensor name.
    let mut raw = TinyModel::new().to_raw();
    raw.kv_mut("general.name").key = b"general.\xff\xfe".to_vec();
    refused(&raw.to_bytes(), Kind::File, "not valid UTF-8");
    let mut raw = TinyModel::new().to_raw();
    let kv = raw.kv_mut("general.name");
    kv.payload = Vec::new();
    put_bytes(&mut kv.payload, b"bad \xc3\x28");
    refused(&raw.to_bytes(), Kind::File, "not valid UTF-8");
    let mut raw = TinyModel::new().to_raw();
    let kv = raw.kv_mut("tokenizer.ggml.merges");
    let n = kv.payload.len();
    kv.payload[n - 1] = 0x80;
    refused(&raw.to_bytes(), Kind::File, "not valid UTF-8");
    let mut raw = TinyModel::new().to_raw();
    raw.tensor_mut("output.weight").name = b"output.\xffweight".to_vec();
    refused(&raw.to_bytes(), Kind::File, "not valid UTF-8");
}

#[test]
fn duplicate_keys() {
    for key in ["general.architecture", "qwen4exp.block_count", "tokenizer.ggml.tokens"] {
        let mut raw = TinyModel::new().to_raw();
        let kv = raw.kv.iter().find(|k| k.key == key.as_bytes()).unwrap().clone();
        raw.kv.push(kv);
        refused(&raw.to_bytes(), Kind::File, &format!("duplicate metadata key {key}"));
    }
    // Same key, different value and type.
    let mut raw = TinyModel::new().to_raw();
    raw.kv.insert(3, RawKv::new("qwen4exp.embedding_length", &Value::U64(64)));
    refused(&raw.to_bytes(), Kind::File, "duplicate metadata key qwen4exp.embedding_length");
}

#[test]
fn duplicate_tensors() {
    let m = TinyModel::new();
    for name in ["token_embd.weight", "blk.2.ssm_a", "blk.3.attn_q_norm.weight"] {
        let mut raw = m.to_raw();
        let t = m.tensor(name);
        raw.push_tensor(name, &t.dims.iter().map(|&d| d as u64).collect::<Vec<_>>(), 0, &t.encode());
        refused(&raw.to_bytes(), Kind::File, &format!("duplicate tensor {name}"));
    }
    // A duplicate info pointing at the same bytes.
    let mut raw = m.to_raw();
    let t = raw.tensors[5].clone();
    raw.tensors.push(t);
    refused(&raw.to_bytes(), Kind::File, "duplicate tensor");
}

#[test]
fn dimension_counts() {
    for n in [0u32, 5, 8, u32::MAX] {
        let mut raw = TinyModel::new().to_raw();
        // Keep the encoded size consistent with the declared count where possible.
        let t = raw.tensor_mut("output_hc_norm.weight");
        t.dims = vec![1; n.min(8) as usize];
        if n > 8 {
            // A count that cannot match the bytes that follow.
            let mut b = raw.to_bytes();
            let pos = find_dims_count(&raw, "output_hc_norm.weight");
            b[pos..pos + 4].copy_from_slice(&n.to_le_bytes());
            refused(&b, Kind::File, &format!("{n} dimensions (1 to 4 allowed)"));
        } else {
            refused(&raw.to_bytes(), Kind::File, &format!("{n} dimensions (1 to 4 allowed)"));
        }
    }
}

/// Absolute position of the `n_dims` field of tensor `name` in `raw.to_bytes()`.
fn find_dims_count(raw: &RawGguf, name: &str) -> usize {
    let mut probe = raw.clone();
    probe.tensors.clear();
    let mut pos = probe.header_bytes().len();
    for t in &raw.tensors {
        pos += 8 + t.name.len();
        if t.name == name.as_bytes() {
            return pos;
        }
        pos += 4 + 8 * t.dims.len() + 4 + 8;
    }
    panic!("no tensor {name}")
}

#[test]
fn zero_and_huge_dimensions() {
    for (dims, needle) in [
        (vec![0u64, 64], "has dimension 0"),
        (vec![32, 0], "has dimension 0"),
        (vec![32, 1 << 63], "has dimension 9223372036854775808"),
        (vec![u64::MAX, 1], "has dimension 18446744073709551615"),
        // Element count overflows u64.
        (vec![1 << 32, 1 << 32, 1 << 32], "too many"),
        (vec![1 << 62, 4], "too many"),
        (vec![3, 3 << 61], "too many"),
        // Representable count, byte size overflows.
        (vec![1 << 31, 1 << 31], "too large"),
        // Representable everything, far past the end of the file.
        (vec![1 << 20, 1 << 20, 1 << 20], "outside"),
        // Runs into the next tensor.
        (vec![8, 49], "overlap"),
    ] {
        let mut raw = TinyModel::new().to_raw();
        raw.tensor_mut("per_layer_token_embd.weight").dims = dims.clone();
        refused(&raw.to_bytes(), Kind::File, needle);
    }
}

#[test]
fn unsupported_ggml_type_ids() {
    // 4, 5: removed Q4_2/Q4_3; 9: Q8_1; 15: Q8_K; 16..: IQ types; 39: MXFP4.
    for id in [4u32, 5, 9, 15, 16, 20, 23, 24, 28, 29, 39, 40, 1000, u32::MAX] {
        let mut raw = TinyModel::new().to_raw();
        raw.tensor_mut("blk.0.attn_qkv.weight").ty = id;
        refused(&raw.to_bytes(), Kind::File, &format!("unsupported ggml type {id}"));
    }
}

#[test]
fn row_length_not_a_whole_number_of_blocks() {
    for (name, ty, needle) in [
        ("blk.0.attn_qkv.weight", GgmlType::Q4K, "row length 32 is not a multiple of the Q4_K block size 256"),
        ("blk.0.ssm_conv1d.weight", GgmlType::Q8_0, "row length 4 is not a multiple of the Q8_0 block size 32"),
        ("blk.1.ple_conv1d.weight", GgmlType::Q4_0, "row length 2"),
        ("token_embd.weight", GgmlType::Q6K, "row length 32"),
    ] {
        let mut raw = TinyModel::new().to_raw();
        let t = raw.tensor_mut(name);
        t.ty = ty.id();
        refused(&raw.to_bytes(), Kind::File, needle);
    }
}

#[test]
fn bad_offsets() {
    let fresh = || TinyModel::new().to_raw();
    // Misaligned.
    for delta in [1u64, 4, 16] {
        let mut raw = fresh();
        raw.tensors[3].offset += delta;
        refused(&raw.to_bytes(), Kind::File, "is not aligned to 32");
    }
    // Past the end.
    let mut raw = fresh();
    let end = raw.data.len() as u64;
    raw.tensors.last_mut().unwrap().offset = end;
    refused(&raw.to_bytes(), Kind::File, "outside");
    let mut raw = fresh();
    raw.tensors[0].offset = !31u64; // aligned, and offset + size overflows
    refused(&raw.to_bytes(), Kind::File, "outside");
    let mut raw = fresh();
    raw.tensors[7].offset = 1 << 40;
    refused(&raw.to_bytes(), Kind::File, "outside");
    // Overlapping: same start, or starting inside the previous tensor.
    let mut raw = fresh();
    raw.tensors[2].offset = raw.tensors[1].offset;
    refused(&raw.to_bytes(), Kind::File, "overlap");
    let mut raw = fresh();
    raw.tensors[1].offset = raw.tensors[0].offset + 32;
    refused(&raw.to_bytes(), Kind::File, "overlap");
    let mut raw = fresh();
    let last = raw.tensors.len() - 1;
    raw.tensors[last].offset = 0;
    refused(&raw.to_bytes(), Kind::File, "overlap");
}

#[test]
fn bad_alignment() {
    for v in [Value::U32(0), Value::U32(3), Value::U32(48), Value::U32(u32::MAX), Value::U64(32), Value::I32(32)] {
        let mut m = TinyModel::new();
        m.set("general.alignment", v);
        refused(&m.to_bytes(), Kind::File, "general.alignment must be a power-of-two UINT32");
    }
    // A legal but enormous alignment: the data section would start past the end.
    let mut m = TinyModel::new();
    m.set("general.alignment", Value::U32(1 << 31));
    refused(&m.to_bytes(), Kind::File, "truncated");
    // Declared 64 but laid out for 32: tensors end up misplaced, which is caught.
    let mut m = TinyModel::new();
    m.set("general.alignment", Value::U32(64));
    let e = from_memory(&m.to_bytes()).err().expect("misaligned layout refused");
    assert!(matches!(e, Error::Format(_)), "{e:?}");
}

#[test]
fn long_tensor_name() {
    let mut raw = TinyModel::new().to_raw();
    raw.tensor_mut("output.weight").name = vec![b'x'; 64];
    refused(&raw.to_bytes(), Kind::File, "is longer than 63 bytes");
    let mut raw = TinyModel::new().to_raw();
    raw.tensor_mut("output.weight").name = vec![b'y'; 63];
    // 63 bytes is legal: the file parses (the unknown tensor is then unused, the head tied).
    assert!(GgufFile::from_storage(Arc::new(raw.to_bytes())).is_ok());
}

// ---- the model ----------------------------------------------------------------

#[test]
fn wrong_architecture() {
    for (v, needle) in [
        (Value::String("llama".into()), "architecture is \"llama\""),
        (Value::String("qwen35moe".into()), "flashnext runs only \"qwen4exp\""),
        (Value::String(String::new()), "architecture is \"\""),
        (Value::U32(7), "general.architecture must be a string"),
        (Value::Array(8, vec![Value::String("qwen4exp".into())]), "general.architecture must be a string"),
    ] {
        let mut m = TinyModel::new();
        m.set("general.architecture", v);
        refused_model(&m, needle);
    }
    let mut m = TinyModel::new();
    m.remove_key("general.architecture");
    refused_model(&m, "missing key general.architecture");
}

#[test]
fn missing_required_keys() {
    for key in [
        "block_count",
        "context_length",
        "embedding_length",
        "attention.head_count",
        "attention.layer_norm_rms_epsilon",
        "expert_count",
        "expert_used_count",
        "expert_feed_forward_length",
        "expert_shared_feed_forward_length",
        "ssm.conv_kernel",
        "ssm.state_size",
        "ssm.group_count",
        "ssm.time_step_rank",
        "ssm.inner_size",
        "hyper_connection.count",
        "hyper_connection.low_rank",
        "attention.indexer.head_count",
        "attention.indexer.key_length",
        "attention.indexer.top_k",
        "ple.ngram_size",
        "ple.heads_per_ngram",
        "ple.conv_kernel",
        "ple.eos_token_id",
        "embedding_length_per_layer_input",
        "ple.layer_multipliers",
        "ple.head_offsets",
        "ple.head_vocab_sizes",
    ] {
        let mut m = TinyModel::new();
        m.remove_key(&format!("qwen4exp.{key}"));
        refused_model(&m, &format!("missing key qwen4exp.{key}"));
    }
}

#[test]
fn optional_keys_may_be_absent() {
    // Each either loads or is refused as a model error; none may panic.
    for key in [
        "general.type",
        "general.name",
        "general.file_type",
        "qwen4exp.attention.head_count_kv",
        "qwen4exp.attention.key_length",
        "qwen4exp.attention.value_length",
        "qwen4exp.rope.dimension_count",
        "qwen4exp.rope.dimension_sections",
        "qwen4exp.rope.freq_base",
        "qwen4exp.full_attention_interval",
        "qwen4exp.attention.compress_ratios",
        "qwen4exp.ple.layers",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.eos_token_id",
    ] {
        let mut m = TinyModel::new();
        m.remove_key(key);
        match from_memory(&m.to_bytes()) {
            Ok(model) => {
                let mut s = State::new(model).unwrap();
                s.decode(3).unwrap();
                assert!(s.logits().unwrap().iter().all(|x| x.is_finite()), "without {key}");
            }
            Err(e) => assert!(matches!(e, Error::Model(_)), "without {key}: {e:?}"),
        }
    }
    // Defaults that contradict the tensors are refused with the tensor named.
    let mut m = TinyModel::new();
    m.remove_key("qwen4exp.attention.head_count_kv");
    refused_model(&m, "blk.3.attn_k.weight");
    let mut m = TinyModel::new();
    m.remove_key("qwen4exp.attention.key_length");
    refused_model(&m, "value_length 8 != key_length 16");
    let mut m = TinyModel::new();
    m.remove_key("qwen4exp.attention.key_length").remove_key("qwen4exp.attention.value_length");
    refused_model(&m, "blk.3.attn_q.weight");
}

#[test]
fn keys_with_wrong_types() {
    let s = |x: &str| Value::String(x.into());
    for (key, v, needle) in [
        ("block_count", s("4"), "qwen4exp.block_count must be an unsigned integer"),
        ("block_count", Value::F32(4.0), "qwen4exp.block_count must be an unsigned integer"),
        ("block_count", Value::I32(-4), "qwen4exp.block_count must be an unsigned integer"),
        ("block_count", arr_i32(&[4]), "qwen4exp.block_count must be an unsigned integer"),
        ("embedding_length", Value::F64(32.0), "qwen4exp.embedding_length must be an unsigned integer"),
        ("embedding_length", Value::U64(u64::MAX), "qwen4exp.embedding_length"),
        ("hyper_connection.count", Value::I8(-2), "qwen4exp.hyper_connection.count must be an unsigned integer"),
        ("attention.head_count_kv", s("1"), "qwen4exp.attention.head_count_kv must be an unsigned integer"),
        ("context_length", Value::I64(-1), "qwen4exp.context_length must be an unsigned integer"),
        ("attention.layer_norm_rms_epsilon", Value::U32(0), "layer_norm_rms_epsilon must be a float"),
        ("attention.layer_norm_rms_epsilon", s("1e-6"), "layer_norm_rms_epsilon must be a float"),
        ("rope.freq_base", Value::U32(10000), "rope.freq_base must be a float"),
        ("ple.layer_multipliers", Value::U64(3), "ple.layer_multipliers must be an array"),
        ("ple.head_offsets", Value::Array(6, vec![Value::F32(0.0); 4]), "ple.head_offsets holds a non-integer"),
        ("ple.head_vocab_sizes", Value::Array(11, vec![Value::I64(-7); 4]), "ple.head_vocab_sizes holds"),
        ("ple.layers", Value::U32(1), "ple.layers must be an array"),
        ("ple.layers", Value::Array(8, vec![s("1")]), "ple.layers entry"),
        ("ple.eos_token_id", Value::U64(1 << 40), "ple.eos_token_id does not fit 32 bits"),
        ("ple.eos_token_id", s("1"), "qwen4exp.ple.eos_token_id must be an unsigned integer"),
        ("attention.recurrent_layers", s("linear"), "attention.recurrent_layers must be an array"),
        ("attention.recurrent_layers", Value::Array(8, vec![s("linear"); 4]), "attention.recurrent_layers holds"),
        ("attention.recurrent_layers", Value::Array(6, vec![Value::F32(1.0); 4]), "attention.recurrent_layers holds"),
        ("attention.compress_ratios", s("2"), "attention.compress_ratios"),
        ("attention.compress_ratios", Value::F32(2.0), "attention.compress_ratios"),
        ("attention.compress_ratios", Value::I32(-2), "attention.compress_ratios"),
        ("attention.compress_ratios", Value::Array(6, vec![Value::F32(2.0); 4]), "attention.compress_ratios holds"),
        ("attention.compress_ratios", arr_i32(&[0, 0, 0, -2]), "attention.compress_ratios holds"),
        ("full_attention_interval", s("4"), "qwen4exp.full_attention_interval must be an unsigned integer"),
    ] {
        let mut m = TinyModel::new();
        m.set_arch(key, v.clone());
        if key == "full_attention_interval" {
            m.remove_key("qwen4exp.attention.recurrent_layers");
        }
        refused_model(&m, needle);
    }
    let mut m = TinyModel::new();
    m.set("flashnext.ssm.output_gate", Value::U32(1));
    refused_model(&m, "flashnext.ssm.output_gate");
    let mut m = TinyModel::new();
    m.set("flashnext.ssm.output_gate", Value::String("relu".into()));
    refused_model(&m, "is not sigmoid or silu");
}

#[test]
fn inconsistent_hparams() {
    let u = Value::U32;
    let cases: Vec<(&str, Value, &str)> = vec![
        ("block_count", u(0), "block_count = 0 is outside 1..=512"),
        ("block_count", u(513), "block_count = 513 is outside 1..=512"),
        ("block_count", u(5), "attention.recurrent_layers has 4 entries for 5 layers"),
        ("context_length", u(0), "context_length = 0 is outside"),
        ("embedding_length", u(0), "embedding_length = 0 is outside"),
        ("embedding_length", u(48), "PLE heads 4 x row width 8 != hidden size 48"),
        ("attention.head_count", u(0), "head_count = 0 is outside"),
        ("attention.head_count_kv", u(3), "attention heads 2 / kv heads 3 / head dim 8 are inconsistent"),
        ("attention.head_count_kv", u(0), "are inconsistent"),
        ("attention.key_length", u(0), "value_length 8 != key_length 0"),
        ("attention.value_length", u(16), "value_length 16 != key_length 8"),
        ("rope.dimension_count", u(5), "rope.dimension_count 5 must be even"),
        ("rope.dimension_count", u(10), "rope.dimension_count 10 must be even and <= 8"),
        ("ssm.inner_size", u(33), "GDN heads inconsistent"),
        ("ssm.inner_size", u(0), "GDN heads inconsistent"),
        ("ssm.group_count", u(3), "GDN heads inconsistent: 3 key heads, 4 value heads"),
        ("ssm.time_step_rank", u(6), "GDN heads inconsistent"),
        ("ssm.state_size", u(0), "ssm.state_size = 0 is outside"),
        ("ssm.conv_kernel", u(0), "ssm.conv_kernel = 0 is outside"),
        ("hyper_connection.count", u(1), "hyper_connection.count must be > 1"),
        ("hyper_connection.count", u(0), "hyper_connection.count = 0 is outside"),
        ("hyper_connection.low_rank", u(0), "hyper_connection.low_rank = 0 is outside"),
        ("expert_count", u(0), "expert_count = 0 is outside"),
        ("expert_used_count", u(0), "expert_used_count = 0 is outside 1..=4"),
        ("expert_used_count", u(5), "expert_used_count = 5 is outside 1..=4"),
        ("attention.recurrent_layers", Value::Array(7, vec![Value::Bool(true); 3]), "has 3 entries for 4 layers"),
        ("attention.recurrent_layers", Value::Array(7, vec![Value::Bool(true); 5]), "has 5 entries for 4 layers"),
        ("attention.compress_ratios", arr_i32(&[0, 0, 2]), "attention.compress_ratios has 3 entries for 4 layers"),
        ("attention.indexer.top_k", u(3), "indexer budget 3 is not a multiple of ratio 2"),
        ("attention.indexer.top_k", u(0), "top_k = 0 is outside"),
        ("attention.indexer.key_length", u(2), "indexer key_length 2 is smaller than the rope dimension 4"),
        ("attention.indexer.head_count", u(0), "indexer.head_count = 0 is outside"),
        ("attention.layer_norm_rms_epsilon", Value::F32(f32::NAN), "layer_norm_rms_epsilon"),
        ("attention.layer_norm_rms_epsilon", Value::F32(-1e-6), "layer_norm_rms_epsilon"),
        ("attention.layer_norm_rms_epsilon", Value::F32(f32::INFINITY), "layer_norm_rms_epsilon"),
        ("rope.freq_base", Value::F32(f32::NAN), "rope.freq_base"),
        ("rope.freq_base", Value::F32(0.0), "rope.freq_base"),
        ("rope.freq_base", Value::F32(-10000.0), "rope.freq_base"),
        // PLE.
        ("ple.layers", arr_i32(&[3]), "PLE layer 3 is not a linear-attention layer"),
        ("ple.layers", arr_i32(&[4]), "is not a layer below 4"),
        ("ple.layers", arr_i32(&[-1]), "is not a layer below 4"),
        ("ple.layers", arr_i32(&[0, 1]), "ple.layers lists 2 layers; exactly one is supported"),
        ("ple.layers", Value::Array(5, vec![]), "ple.layers lists 0 layers"),
        ("ple.ngram_size", u(1), "ple.ngram_size must be >= 2"),
        ("ple.ngram_size", u(9), "ple.ngram_size = 9 is outside 1..=8"),
        ("ple.heads_per_ngram", u(0), "heads_per_ngram = 0 is outside"),
        ("ple.heads_per_ngram", u(4), "PLE heads 8 x row width 8 != hidden size 32"),
        ("ple.conv_kernel", u(0), "ple.conv_kernel = 0 is outside"),
        ("embedding_length_per_layer_input", u(4), "PLE heads 4 x row width 4 != hidden size 32"),
        ("embedding_length_per_layer_input", u(0), "embedding_length_per_layer_input = 0 is outside"),
        ("ple.layer_multipliers", arr_u64(&[1, 3]), "PLE hash arrays are shorter than the n-gram heads need"),
        ("ple.head_offsets", arr_u64(&[0, 7, 18]), "PLE hash arrays are shorter"),
        ("ple.head_vocab_sizes", arr_u64(&[7, 11, 13]), "PLE hash arrays are shorter"),
        ("ple.head_vocab_sizes", arr_u64(&[7, 0, 13, 17]), "ple.head_vocab_sizes contains 0"),
        // Head ranges past the table (48 rows).
        ("ple.head_offsets", arr_u64(&[0, 7, 18, 32]), "PLE head 3 (offset 32, size 17) runs past the table's 48 rows"),
        ("ple.head_vocab_sizes", arr_u64(&[7, 11, 13, 1000]), "PLE head 3 (offset 31, size 1000) runs past"),
        ("ple.head_offsets", arr_u64(&[u64::MAX, 7, 18, 31]), "PLE head 0 (offset 18446744073709551615"),
        ("ple.head_vocab_sizes", arr_u64(&[u64::MAX, 11, 13, 17]), "PLE head 0 (offset 0, size 18446744073709551615"),
    ];
    for (key, v, needle) in cases {
        let mut m = TinyModel::new();
        m.set_arch(key, v);
        refused_model(&m, needle);
    }
    // The interval fallback must be positive.
    let mut m = TinyModel::new();
    m.remove_key("qwen4exp.attention.recurrent_layers");
    m.set_arch("full_attention_interval", Value::U32(0));
    refused_model(&m, "full_attention_interval must be > 0");
    // PLE on an attention layer chosen through the interval fallback.
    let mut m = TinyModel::new();
    m.remove_key("qwen4exp.attention.recurrent_layers");
    m.set_arch("full_attention_interval", Value::U32(2));
    refused_model(&m, "PLE layer 1 is not a linear-attention layer");
}

#[test]
fn missing_tensors() {
    let base = TinyModel::new();
    for t in &base.tensors {
        if t.name == "output.weight" {
            continue; // optional: the head is tied to token_embd
        }
        let mut m = base.clone();
        m.remove_tensor(&t.name);
        refused_model(&m, &format!("missing tensor {}", t.name));
    }
    let mut m = base.clone();
    m.remove_tensor("output.weight");
    loads(&m.to_bytes());
    // Fused experts present but the separate ones are what is missing: fine. Neither: refused.
    let mut m = base.clone();
    m.remove_tensor("blk.2.ffn_gate_exps.weight").remove_tensor("blk.2.ffn_up_exps.weight");
    refused_model(&m, "missing tensor blk.2.ffn_gate_exps.weight");
}

/// Tensors the loader reads as "n elements in any shape" (norm gammas, 1-D
/// constants, the `{H,1}` shared-expert gate): only their element count matters.
fn is_vector(name: &str) -> bool {
    name.contains("norm") || name.ends_with("ssm_a") || name.ends_with("ssm_dt.bias") || name.contains("gate_inp_shexp")
}

#[test]
fn misshaped_tensors() {
    let base = TinyModel::new();
    for t in &base.tensors {
        // One more element along the contiguous axis.
        let mut dims = t.dims.clone();
        dims[0] += 1;
        let mut m = base.clone();
        m.set_shape(&t.name, &dims);
        refused_model(&m, &t.name);
        // One more along the last axis (more rows / experts).
        let mut dims = t.dims.clone();
        *dims.last_mut().unwrap() += 1;
        let mut m = base.clone();
        m.set_shape(&t.name, &dims);
        if t.name == "per_layer_token_embd.weight" {
            // More table rows are legal on their own.
            from_memory(&m.to_bytes()).expect("a taller PLE table loads");
        } else if t.name == "token_embd.weight" {
            refused_model(&m, "output.weight"); // the head no longer matches the vocab
        } else {
            refused_model(&m, &t.name);
        }
        // Same element count, dims reversed: only vectors may take any shape.
        if t.dims.len() > 1 && !is_vector(&t.name) {
            let mut dims = t.dims.clone();
            dims.reverse();
            if dims != t.dims {
                let mut m = base.clone();
                m.tensor_mut(&t.name).dims = dims;
                refused_model(&m, &t.name);
            }
        }
    }
    // Extra axes.
    let mut m = base.clone();
    m.tensor_mut("token_embd.weight").dims = vec![32, 64, 1];
    let r = from_memory(&m.to_bytes());
    assert!(r.is_ok() || matches!(r, Err(Error::Model(_))));
    let mut m = base.clone();
    m.tensor_mut("blk.0.attn_qkv.weight").dims = vec![32, 32, 2];
    refused_model(&m, "tensor blk.0.attn_qkv.weight has shape [32, 32, 2], expected [32, 64]");
    // The PLE table narrower than the heads' ranges.
    let mut m = base.clone();
    m.set_shape("per_layer_token_embd.weight", &[8, 40]);
    refused_model(&m, "runs past the table's 40 rows");
    // Experts stacked as 2-D.
    let mut m = base.clone();
    m.set_shape("blk.1.ffn_down_exps.weight", &[16, 128]);
    refused_model(&m, "blk.1.ffn_down_exps.weight has shape [16, 128], expected [16, 32, 4]");
}

#[test]
fn every_quantized_type_loads_and_decodes() {
    // 32-wide rows: the 32-element block types.
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1] {
        let mut m = TinyModel::new();
        m.set_type("blk.0.attn_qkv.weight", ty);
        loads(&m.to_bytes());
    }
    // K-quants need 256-wide rows: widen the shared expert to 256.
    let c = TinyConfig { shared_ff: 256, ..TinyConfig::default() };
    for ty in [GgmlType::Q2K, GgmlType::Q3K, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
        let mut m = TinyModel::build(&c);
        m.set_type("blk.3.ffn_down_shexp.weight", ty);
        loads(&m.to_bytes());
    }
}

#[test]
fn non_finite_small_vectors() {
    for (name, i, v) in [
        ("blk.0.hc_attn_norm.weight", 3, f32::NAN),
        ("output_hc_norm.weight", 63, f32::INFINITY),
        ("blk.3.attn_q_norm.weight", 0, f32::NAN),
        ("blk.3.indexer.k_norm.weight", 7, f32::NEG_INFINITY),
        ("blk.1.ple_norm_conv.weight", 10, f32::NAN),
        ("blk.2.ssm_norm.weight", 1, f32::NAN),
        ("blk.2.ssm_a", 0, f32::NEG_INFINITY),
        ("blk.0.ssm_dt.bias", 2, f32::NAN),
        ("blk.0.ssm_conv1d.weight", 5, f32::NAN),
        ("blk.1.ple_conv1d.weight", 5, f32::INFINITY),
        ("blk.1.ffn_gate_inp_shexp.weight", 31, f32::NAN),
    ] {
        let mut m = TinyModel::new();
        m.set_value(name, i, v);
        refused_model(&m, &format!("tensor {name} holds a non-finite value at element {i}"));
    }
    // NaN in an F16 norm.
    let mut m = TinyModel::new();
    m.set_type("blk.1.hc_attn_norm.weight", GgmlType::F16).set_value("blk.1.hc_attn_norm.weight", 9, f32::NAN);
    refused_model(&m, "tensor blk.1.hc_attn_norm.weight holds a non-finite value at element 9");
}

// ---- random mutations ------------------------------------------------------------

/// Values that tend to break length and count arithmetic.
const INTERESTING_U64: [u64; 14] = [
    0,
    1,
    2,
    31,
    32,
    255,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    i64::MAX as u64,
    1 << 63,
    u64::MAX,
];

fn mutate(rng: &mut Rng, valid: &[u8], header_end: usize) -> Vec<u8> {
    let mut b = valid.to_vec();
    let hpos = |rng: &mut Rng, b: &[u8]| rng.below(header_end.min(b.len()).max(1));
    let rounds = 1 + rng.below(3);
    for _ in 0..rounds {
        match rng.below(10) {
            0..=2 => {
                let p = hpos(rng, &b);
                b[p] ^= 1 << rng.below(8);
            }
            3 => {
                let p = hpos(rng, &b);
                b[p] = rng.next() as u8;
            }
            4 => {
                let p = hpos(rng, &b).min(b.len().saturating_sub(8));
                let v = INTERESTING_U64[rng.below(INTERESTING_U64.len())];
                b[p..p + 8].copy_from_slice(&v.to_le_bytes());
            }
            5 => {
                let p = hpos(rng, &b).min(b.len().saturating_sub(4));
                let v = INTERESTING_U64[rng.below(INTERESTING_U64.len())] as u32;
                b[p..p + 4].copy_from_slice(&v.to_le_bytes());
            }
            6 => {
                let n = rng.below(b.len() + 1);
                b.truncate(n);
            }
            7 => {
                let p = hpos(rng, &b).min(b.len());
                if rng.below(2) == 0 {
                    b.insert(p, rng.next() as u8);
                } else if p < b.len() {
                    b.remove(p);
                }
            }
            _ => {
                // Anywhere, data included.
                if !b.is_empty() {
                    let p = rng.below(b.len());
                    b[p] ^= 1 << rng.below(8);
                }
            }
        }
        if b.len() < 8 {
            break;
        }
    }
    b
}

#[test]
fn random_mutations_never_panic() {
    let base = valid();
    let l = layout();
    let mut rng = Rng::new(0x600d_f00d);
    let (mut loaded, mut refused_count) = (0, 0);
    for i in 0..6000 {
        let b = mutate(&mut rng, base, l.data_start);
        let (outcome, biggest) = largest_alloc(|| catch_unwind(AssertUnwindSafe(|| {
            let r = from_memory(&b);
            if let Ok(model) = &r {
                // A mutant that loads must also decode without panicking.
                // (Creating the state may fail cleanly, e.g. out of memory.)
                if let Ok(mut s) = State::new(model.clone()) {
                    let v = model.vocab_size() as u32;
                    for tok in [0, 1 % v, 17 % v] {
                        let _ = s.decode(tok);
                    }
                }
            }
            r.is_ok()
        })));
        // Nothing in a 250 KB file justifies reserving hundreds of megabytes at once.
        assert!(biggest <= 256 << 20, "mutation #{i}: one allocation of {biggest} bytes");
        match outcome {
            Ok(true) => loaded += 1,
            Ok(false) => refused_count += 1,
            Err(p) => {
                let path = std::env::temp_dir().join(format!("flashnext-mutant-{i}.gguf"));
                std::fs::write(&path, &b).unwrap();
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!("mutation #{i} panicked ({msg}); input saved to {}", path.display());
            }
        }
        // Some through the file path and the C ABI as well.
        if i % 100 == 0 {
            let f = TempFile::new(&b);
            let r = catch_unwind(AssertUnwindSafe(|| Model::load(&f.0, &LoadOptions::default()).is_ok()));
            assert!(r.is_ok(), "mutation #{i} panicked through Model::load");
            let (st, msg) = c_load(&f.0);
            assert_ne!(st, FNX_ERR_INTERNAL, "mutation #{i}: {msg}");
        }
    }
    eprintln!("random mutations: {loaded} loaded, {refused_count} refused");
    assert!(refused_count > 3000 && loaded > 0, "{loaded} loaded, {refused_count} refused");
}

// ---- fuzz corpus seeds ------------------------------------------------------------

/// With `FNX_FUZZ_SEED_DIR=<dir>` set, writes the valid model and a few legal
/// variants there (the seed corpus of `fuzz/`); otherwise does nothing.
#[test]
fn write_fuzz_seeds() {
    let Some(dir) = std::env::var_os("FNX_FUZZ_SEED_DIR") else { return };
    let dir = PathBuf::from(dir);
    std::fs::create_dir_all(&dir).unwrap();
    let base = TinyConfig::default();
    let variants = [
        ("valid", base.clone()),
        ("fused_tied", TinyConfig { fused_experts: true, output_head: false, ..base.clone() }),
        ("no_ple_dense", TinyConfig { ple_layer: None, compress_ratio: 0, ..base.clone() }),
        (
            "small",
            TinyConfig {
                hidden: 8,
                vocab: 8,
                recurrent: vec![true, false],
                ple_layer: Some(0),
                heads_per_ngram: 1,
                ngram: 2,
                n_heads: 1,
                head_dim: 4,
                rope_dims: 2,
                ssm_k_heads: 1,
                ssm_v_heads: 1,
                ssm_head_dim: 4,
                ssm_conv: 2,
                n_experts: 2,
                n_experts_used: 1,
                expert_ff: 4,
                shared_ff: 4,
                indexer_heads: 1,
                indexer_dim: 4,
                hc_rank: 2,
                ..base.clone()
            },
        ),
    ];
    for (name, c) in variants {
        let bytes = TinyModel::build(&c).to_bytes();
        from_memory(&bytes).unwrap_or_else(|e| panic!("seed {name}: {e}"));
        std::fs::write(dir.join(format!("{name}.gguf")), bytes).unwrap();
    }
    let mut q = TinyModel::new();
    for name in ["token_embd.weight", "blk.0.attn_qkv.weight"] {
        q.set_type(name, GgmlType::Q8_0);
    }
    q.set_type("blk.3.attn_q.weight", GgmlType::F16).set_type("output.weight", GgmlType::BF16);
    std::fs::write(dir.join("mixed_types.gguf"), q.to_bytes()).unwrap();
}

// ---- regressions from fuzzing -------------------------------------------------------

/// Found while writing these tests: a 24-byte header claiming 2^20 tensors
/// made the parser reserve 64 MiB before reading one. The reservation is now
/// capped by the bytes left (`src/gguf/reader.rs`).
#[test]
fn huge_tensor_count_reserves_nothing_up_front() {
    let mut raw = RawGguf::new();
    raw.tensor_count = Some(1 << 20);
    let bytes = raw.to_bytes();
    let (r, biggest) = largest_alloc(|| GgufFile::from_storage(Arc::new(bytes.clone())).map(|_| ()));
    let Err(e) = r else { panic!("a header without its tensors was accepted") };
    assert!(e.to_string().contains("truncated"), "{e}");
    assert!(biggest < 1 << 16, "a {}-byte file made the parser allocate {biggest} bytes", bytes.len());
    refused(&bytes, Kind::File, "truncated");
}

/// Found by `fuzz/` (artifact oom-1efb4d241b53ca274c036f59d36da85bd490fd31):
/// `qwen4exp.attention.indexer.top_k = 2^29 + 4` is accepted (the limit is
/// 2^30) and every decode step then reserves `budget + ratio` indices
/// (`Vec::with_capacity` in `src/model/qsa.rs::select_tokens`), 4 GiB here,
/// 8 GiB at the limit: an abort wherever that much cannot be had. The
/// selection never holds more than the `t + 1` tokens seen, so its capacity
/// is capped there (found by the fuzzer).
#[test]
fn huge_qsa_budget_does_not_reserve_gigabytes() {
    let mut m = TinyModel::new();
    m.set_arch("attention.indexer.top_k", Value::U32((1 << 29) + 4));
    let model = from_memory(&m.to_bytes()).expect("a huge budget is legal");
    let mut s = State::new(model).unwrap();
    let (_, biggest) = largest_alloc(|| {
        for t in 0..4 {
            s.decode(t).unwrap();
        }
    });
    assert!(biggest < 64 << 20, "decoding 4 tokens allocated {biggest} bytes at once");
}
