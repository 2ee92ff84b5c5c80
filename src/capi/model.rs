//! `fnx_model`: loading a GGUF file and the facts a caller needs about it.

use super::{fail, guard, non_null, fnx_status, Failure, FNX_ERR_CANCELLED, FNX_ERR_INVALID_ARGUMENT};
use crate::load::{Backend, LoadOptions};
use crate::model::{BackendKind, LayerKind, Model};
use crate::tokenizer::SharedTokenizer;
use std::ffi::{c_char, c_void, CStr, CString};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Let flashnext choose: a hardware GPU through Vulkan when one can hold the
/// model, else the CPU (`fnx_model_backend` says which was taken).
pub const FNX_BACKEND_AUTO: i32 = 0;
/// The CPU backend.
pub const FNX_BACKEND_CPU: i32 = 1;
/// The Vulkan backend.
pub const FNX_BACKEND_VULKAN: i32 = 2;

/// Load progress: `progress` runs from 0 (start) to 1 (done), reported at the
/// start, after parsing, after each layer's tensors and at the end. Return
/// false to cancel the load (`fnx_load` then returns `FNX_ERR_CANCELLED`).
pub type fnx_progress_callback = Option<unsafe extern "C" fn(progress: f32, user_data: *mut c_void) -> bool>;

/// Options for `fnx_load`. Get defaults from `fnx_load_params_default()` and
/// change what you need; zero fields mean "default".
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fnx_load_params {
    /// `sizeof(fnx_load_params)` as the caller compiled it (set by `fnx_load_params_default`).
    pub struct_size: u32,
    /// Worker threads for matrix products; 0 = all cores. At most four per
    /// logical CPU (and at least 256 are always allowed); more is
    /// `FNX_ERR_INVALID_ARGUMENT`.
    pub n_threads: u32,
    /// Largest number of positions per state; 0 = the model's context length.
    pub n_ctx: u32,
    /// `FNX_BACKEND_AUTO`, `FNX_BACKEND_CPU` or `FNX_BACKEND_VULKAN`.
    pub backend: i32,
    /// GPU index for the Vulkan backend.
    pub device_index: i32,
    /// Device memory the Vulkan backend may use at most, in MiB; 0 = nine
    /// tenths of the device's. The dense weights and one state stay
    /// resident; what is left holds routed experts: all of them when they
    /// fit, otherwise an expert cache whose misses run on the host's cores.
    pub vram_budget_mb: u64,
    /// Called on the loading thread as the load advances; NULL = none.
    pub progress_callback: fnx_progress_callback,
    /// Passed unchanged to `progress_callback`.
    pub progress_user_data: *mut c_void,
    /// Expert-cache slots per layer on the Vulkan backend; -1 (the default)
    /// = as many as the budget leaves room for.
    pub expert_cache_slots: i32,
    /// Positions a state can step back with `fnx_state_rewind`; 0 = the
    /// default, 4. Each costs one more copy of every Gated DeltaNet layer's
    /// recurrent state.
    pub rewind_window: u32,
    /// A routing profile (`fnx_model_save_routing_profile`) whose most used
    /// experts fill the expert cache at load; NULL = none.
    pub routing_profile: *const c_char,
    /// Whether the model's threads spin, rather than sleep, while an
    /// offloaded decode (an expert cache) waits for the GPU at each layer's
    /// router: 1 = spin, 0 = sleep, -1 (the default) = spin unless the
    /// Vulkan device is the host's CPU. Spinning saves waking the threads
    /// for the host's share of every layer (a fifth of the token's time at a
    /// 4 GB budget on the model this was measured on) and keeps `n_threads`
    /// cores busy for the whole decode.
    pub spin_wait: i32,
    /// Most tokens one pass of a prompt computes together
    /// (`fnx_decode_tokens`, `fnx_decode_batch`, `fnx_generate`'s prompt);
    /// 0 = the default, 512. Larger batches need more scratch memory; the
    /// abort callback is polled between them and between their layers.
    pub micro_batch: u32,
}

/// `struct_size` of callers built before the progress fields existed; such
/// callers are still accepted (the missing fields read as NULL).
const LOAD_PARAMS_V1_SIZE: usize = std::mem::offset_of!(fnx_load_params, progress_callback);
/// `struct_size` of callers built before the expert-cache and rewind fields
/// (they read as their defaults).
const LOAD_PARAMS_V2_SIZE: usize = std::mem::offset_of!(fnx_load_params, expert_cache_slots);
/// `struct_size` of callers built before `spin_wait` and `micro_batch`
/// (they read as -1 and the default; both arrived in one release).
const LOAD_PARAMS_V3_SIZE: usize = std::mem::offset_of!(fnx_load_params, spin_wait);

/// A loaded model (opaque). Share it between threads freely.
pub struct fnx_model {
    pub(crate) model: Arc<Model>,
    /// The model file's tokenizer, beside the model (built on first use).
    pub(crate) tokenizer: SharedTokenizer,
    /// Cleared by `fnx_free_model`; states check it before every call.
    pub(crate) alive: Arc<AtomicBool>,
}

impl fnx_model {
    /// Borrows a model handle (refused unless it is a live model handle).
    pub(crate) fn from_ptr<'a>(p: *const fnx_model, func: &str) -> Result<&'a fnx_model, Failure> {
        super::handle::get(p, func)
    }
}

/// Default load parameters.
#[no_mangle]
pub extern "C" fn fnx_load_params_default() -> fnx_load_params {
    fnx_load_params {
        struct_size: std::mem::size_of::<fnx_load_params>() as u32,
        n_threads: 0,
        n_ctx: 0,
        backend: FNX_BACKEND_AUTO,
        device_index: 0,
        vram_budget_mb: 0,
        progress_callback: None,
        progress_user_data: std::ptr::null_mut(),
        expert_cache_slots: -1,
        rewind_window: 0,
        routing_profile: std::ptr::null(),
        spin_wait: -1,
        micro_batch: 0,
    }
}

/// Most severe: something failed.
pub const FNX_LOG_ERROR: i32 = 1;
/// Something looks wrong but work continues.
pub const FNX_LOG_WARN: i32 = 2;
/// Milestones (a model loaded, and what it holds).
pub const FNX_LOG_INFO: i32 = 3;
/// Details (timings, sizes).
pub const FNX_LOG_DEBUG: i32 = 4;

/// Receives log messages: `level` is one of `FNX_LOG_*`, `message` a
/// NUL-terminated line without a trailing newline, valid during the call only.
pub type fnx_log_callback = Option<unsafe extern "C" fn(level: i32, message: *const c_char, user_data: *mut c_void)>;

type LogSink = (unsafe extern "C" fn(i32, *const c_char, *mut c_void), usize);
static LOG_SINK: Mutex<Option<LogSink>> = Mutex::new(None);

/// Sends a message to the log callback, if one is set (the message is only
/// formatted then).
pub(crate) fn log(level: i32, message: impl FnOnce() -> String) {
    let sink = *LOG_SINK.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((f, user_data)) = sink {
        let c = CString::new(message().replace('\0', " ")).unwrap_or_default();
        // SAFETY: the callback and its user data were registered by the caller
        // through fnx_set_log_callback; the string lives across the call.
        super::outside(|| unsafe { f(level, c.as_ptr(), user_data as *mut c_void) });
    }
}

/// Sets the process-wide log callback (NULL = silent, the default). It may be
/// called from any thread that uses flashnext, so it must be thread-safe; it
/// must not call `fnx_set_log_callback` itself. Internal errors (caught
/// panics) are logged here at `FNX_LOG_ERROR`, never printed.
///
/// # Safety
/// `callback` must be NULL or a function that stays callable, with
/// `user_data`, until it is replaced.
#[no_mangle]
pub unsafe extern "C" fn fnx_set_log_callback(callback: fnx_log_callback, user_data: *mut c_void) {
    let mut sink = LOG_SINK.lock().unwrap_or_else(|e| e.into_inner());
    *sink = callback.map(|f| (f, user_data as usize));
}

/// Reads the caller's params (either layout it may have been built with).
///
/// # Safety
/// `params` must point to at least `struct_size` readable bytes.
unsafe fn read_params(params: *const fnx_load_params) -> Result<fnx_load_params, Failure> {
    // SAFETY: struct_size is the first field of every layout.
    let size = unsafe { *params.cast::<u32>() } as usize;
    let mut p = fnx_load_params_default();
    if size == std::mem::size_of::<fnx_load_params>() {
        // SAFETY: the caller's struct has this layout.
        p = unsafe { *params };
    } else if [LOAD_PARAMS_V1_SIZE, LOAD_PARAMS_V2_SIZE, LOAD_PARAMS_V3_SIZE].contains(&size) {
        // SAFETY: the caller's struct is an older prefix of this layout.
        unsafe { std::ptr::copy_nonoverlapping(params.cast::<u8>(), (&mut p as *mut fnx_load_params).cast::<u8>(), size) };
    } else {
        return Err(fail(
            FNX_ERR_INVALID_ARGUMENT,
            format!(
                "fnx_load: params.struct_size is {size}, expected {} (initialise it with fnx_load_params_default)",
                std::mem::size_of::<fnx_load_params>()
            ),
        ));
    }
    p.struct_size = std::mem::size_of::<fnx_load_params>() as u32;
    Ok(p)
}

/// The backend the params ask for (`Model::load` applies the environment's
/// `FNX_BACKEND`, `FNX_DEVICE` and `FNX_VRAM_BUDGET_MB`, which win).
fn backend_choice(params: &fnx_load_params) -> Result<Backend, Failure> {
    match params.backend {
        FNX_BACKEND_AUTO => Ok(Backend::Auto),
        FNX_BACKEND_CPU => Ok(Backend::Cpu),
        FNX_BACKEND_VULKAN => Ok(Backend::Vulkan),
        other => Err(fail(FNX_ERR_INVALID_ARGUMENT, format!("fnx_load: unknown backend {other}"))),
    }
}

/// Loads the GGUF model at `path` (UTF-8, NUL-terminated). `params` may be NULL
/// for defaults. On success `*out_model` receives a handle the caller frees
/// with `fnx_free_model`; on failure it is left untouched and
/// `fnx_last_error()` says why (missing file, not GGUF, wrong architecture,
/// a missing or misshaped tensor, ...).
///
/// # Safety
/// `path` must be NULL or a NUL-terminated string; `params` NULL or a valid
/// `fnx_load_params`; `out_model` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_load(
    path: *const c_char,
    params: *const fnx_load_params,
    out_model: *mut *mut fnx_model,
) -> fnx_status {
    guard(
        || {
            non_null!(path, "fnx_load", "path");
            non_null!(out_model, "fnx_load", "out_model");
            // SAFETY: non-NULL, and the caller promises a valid struct.
            let p = if params.is_null() { fnx_load_params_default() } else { unsafe { read_params(params) }? };
            let backend = backend_choice(&p)?;
            super::check_threads(p.n_threads, "fnx_load")?;
            let device_index = usize::try_from(p.device_index)
                .map_err(|_| fail(FNX_ERR_INVALID_ARGUMENT, format!("fnx_load: device_index {} is negative", p.device_index)))?;
            // SAFETY: non-NULL and NUL-terminated per the contract.
            let path = unsafe { CStr::from_ptr(path) }
                .to_str()
                .map_err(|_| fail(FNX_ERR_INVALID_ARGUMENT, "fnx_load: path is not valid UTF-8"))?;
            let cancelled = Arc::new(AtomicBool::new(false));
            let progress = p.progress_callback.map(|f| {
                let (user_data, cancelled) = (p.progress_user_data as usize, cancelled.clone());
                let wrapped = move |fraction: f32| {
                    // SAFETY: the caller's callback and user data, called on this thread during fnx_load.
                    let go_on = super::outside(|| unsafe { f(fraction, user_data as *mut c_void) });
                    if !go_on {
                        cancelled.store(true, Ordering::Relaxed);
                    }
                    go_on
                };
                Arc::new(wrapped) as crate::load::ProgressFn
            });
            let expert_cache_slots = match p.expert_cache_slots {
                -1 => None,
                n => Some(usize::try_from(n).map_err(|_| {
                    fail(FNX_ERR_INVALID_ARGUMENT, format!("fnx_load: expert_cache_slots {n}: expected -1 or a slot count"))
                })?),
            };
            let routing_profile = if p.routing_profile.is_null() {
                None
            } else {
                // SAFETY: non-NULL and NUL-terminated per the contract.
                let s = unsafe { CStr::from_ptr(p.routing_profile) }
                    .to_str()
                    .map_err(|_| fail(FNX_ERR_INVALID_ARGUMENT, "fnx_load: routing_profile is not valid UTF-8"))?;
                Some(std::path::PathBuf::from(s))
            };
            let spin_wait = match p.spin_wait {
                -1 => None,
                0 => Some(false),
                1 => Some(true),
                n => return Err(fail(FNX_ERR_INVALID_ARGUMENT, format!("fnx_load: spin_wait {n}: expected -1, 0 or 1"))),
            };
            let opts = LoadOptions {
                n_ctx: p.n_ctx as usize,
                n_threads: p.n_threads as usize,
                progress,
                backend,
                device_index,
                vram_budget_mb: p.vram_budget_mb,
                expert_cache_slots,
                rewind_window: p.rewind_window as usize,
                routing_profile,
                spin_wait,
                micro_batch: p.micro_batch as usize,
                ..Default::default()
            };
            let start = std::time::Instant::now();
            let model = match Model::load(Path::new(path), &opts) {
                Ok(m) => m,
                Err(_) if cancelled.load(Ordering::Relaxed) => {
                    log(super::FNX_LOG_INFO, || format!("loading {path} cancelled by the progress callback"));
                    return Err(fail(FNX_ERR_CANCELLED, format!("fnx_load: loading {path} was cancelled by the progress callback")));
                }
                Err(e) => {
                    log(super::FNX_LOG_ERROR, || format!("fnx_load {path}: {e}"));
                    return Err(e.into());
                }
            };
            if p.n_ctx as usize > model.config.context_length {
                log(super::FNX_LOG_WARN, || {
                    format!(
                        "n_ctx {} exceeds the model's context length {}; using {}",
                        p.n_ctx, model.config.context_length, model.n_ctx
                    )
                });
            }
            log(super::FNX_LOG_INFO, || describe(path, &model, start.elapsed()));
            let handle = Box::new(fnx_model { model, tokenizer: SharedTokenizer::default(), alive: Arc::new(AtomicBool::new(true)) });
            // SAFETY: checked non-NULL above; written only on success.
            unsafe { *out_model = super::handle::insert(handle) };
            Ok(())
        },
        || {},
    )
}

/// The one-line summary logged when a model is loaded.
fn describe(path: &str, m: &Model, took: std::time::Duration) -> String {
    let c = &m.config;
    let gdn = c.layers.iter().filter(|k| **k == LayerKind::Linear).count();
    let types: Vec<String> = m.tensor_types().iter().map(|(ty, n)| format!("{n} {ty}")).collect();
    format!(
        "loaded {path}: {} layers ({gdn} Gated DeltaNet, {} attention), vocab {}, hidden {}, \
         {} experts ({} per token), context {}; tensors: {}; {:.1} MiB in {:.1} ms; backend: {}",
        c.n_layers,
        c.n_layers - gdn,
        c.vocab,
        c.hidden,
        c.n_experts,
        c.n_experts_used,
        m.n_ctx,
        types.join(", "),
        m.file_size() as f64 / (1024.0 * 1024.0),
        took.as_secs_f64() * 1e3,
        m.backend_note()
    )
}

/// Frees a model handle (NULL is ignored). States created from it stay
/// valid to free, but decoding with them returns `FNX_ERR_MODEL_FREED`.
///
/// # Safety
/// `model` must be NULL or a handle from `fnx_load` not yet freed.
#[no_mangle]
pub unsafe extern "C" fn fnx_free_model(model: *mut fnx_model) {
    if model.is_null() {
        return;
    }
    let _ = guard(
        || {
            let m = super::handle::remove(model, "fnx_free_model")?;
            m.alive.store(false, Ordering::Release);
            drop(m);
            Ok(())
        },
        || {},
    );
}

/// Reads a fact about the model; 0 when `model` is NULL or not a model handle.
fn fact(model: *const fnx_model, func: &str, f: impl FnOnce(&Model) -> u64) -> u64 {
    let mut out = 0;
    let _ = guard(
        || {
            if model.is_null() {
                return Err(fail(super::FNX_ERR_NULL_ARGUMENT, format!("{func}: model is NULL")));
            }
            out = f(&fnx_model::from_ptr(model, func)?.model);
            Ok(())
        },
        || {},
    );
    out
}

/// Number of logits per token (rows of the output matrix); 0 if `model` is NULL.
///
/// # Safety
/// `model` must be NULL or a live handle from `fnx_load`.
#[no_mangle]
pub unsafe extern "C" fn fnx_model_vocab_size(model: *const fnx_model) -> usize {
    fact(model, "fnx_model_vocab_size", |m| m.config.vocab as u64) as usize
}

/// Most positions a state of this model can hold (after `params.n_ctx`).
///
/// # Safety
/// `model` must be NULL or a live handle from `fnx_load`.
#[no_mangle]
pub unsafe extern "C" fn fnx_model_context_length(model: *const fnx_model) -> usize {
    fact(model, "fnx_model_context_length", |m| m.n_ctx as u64) as usize
}

/// Number of decoder layers.
///
/// # Safety
/// `model` must be NULL or a live handle from `fnx_load`.
#[no_mangle]
pub unsafe extern "C" fn fnx_model_n_layers(model: *const fnx_model) -> usize {
    fact(model, "fnx_model_n_layers", |m| m.config.n_layers as u64) as usize
}

/// The backend the model computes on: `FNX_BACKEND_CPU` or
/// `FNX_BACKEND_VULKAN` (what `FNX_BACKEND_AUTO` resolved to; the load log
/// line says why); 0 if `model` is NULL.
///
/// # Safety
/// `model` must be NULL or a live handle from `fnx_load`.
#[no_mangle]
pub unsafe extern "C" fn fnx_model_backend(model: *const fnx_model) -> i32 {
    fact(model, "fnx_model_backend", |m| if m.backend_kind() == BackendKind::Vulkan { FNX_BACKEND_VULKAN } else { FNX_BACKEND_CPU } as u64) as i32
}

/// Writes how often each layer chose each expert since the load (a routing
/// profile, JSON) to the file `path`; give it to a later `fnx_load`
/// (`fnx_load_params.routing_profile`) to fill that load's expert cache with
/// each layer's most used experts. `FNX_ERR_INVALID_ARGUMENT` when the model
/// keeps no expert cache (CPU, or every expert resident).
///
/// # Safety
/// `model` must be NULL or a live handle from `fnx_load`; `path` NULL or a
/// NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn fnx_model_save_routing_profile(model: *const fnx_model, path: *const c_char) -> fnx_status {
    const F: &str = "fnx_model_save_routing_profile";
    guard(
        || {
            non_null!(model, "fnx_model_save_routing_profile", "model");
            non_null!(path, "fnx_model_save_routing_profile", "path");
            let m = fnx_model::from_ptr(model, F)?;
            // SAFETY: non-NULL and NUL-terminated per the contract.
            let path = unsafe { CStr::from_ptr(path) }
                .to_str()
                .map_err(|_| fail(FNX_ERR_INVALID_ARGUMENT, format!("{F}: path is not valid UTF-8")))?;
            let profile = m.model.routing_profile().ok_or_else(|| {
                fail(FNX_ERR_INVALID_ARGUMENT, format!("{F}: this model keeps no expert cache ({})", m.model.backend_note()))
            })?;
            profile.save(Path::new(path)).map_err(|e| {
                let Failure(status, msg) = Failure::from(e);
                fail(status, format!("{F}: {msg}"))
            })
        },
        || {},
    )
}

/// Width of the hidden state.
///
/// # Safety
/// `model` must be NULL or a live handle from `fnx_load`.
#[no_mangle]
pub unsafe extern "C" fn fnx_model_hidden_size(model: *const fnx_model) -> usize {
    fact(model, "fnx_model_hidden_size", |m| m.config.hidden as u64) as usize
}

/// The end-of-sequence token id from the file's tokenizer metadata, or -1 if it has none.
///
/// # Safety
/// `model` must be NULL or a live handle from `fnx_load`.
#[no_mangle]
pub unsafe extern "C" fn fnx_model_eos_token(model: *const fnx_model) -> i64 {
    let v = fact(model, "fnx_model_eos_token", |m| {
        m.metadata.get("tokenizer.ggml.eos_token_id").and_then(|v| v.as_u64()).map_or(u64::MAX, |x| x)
    });
    if v == u64::MAX || model.is_null() {
        -1
    } else {
        v as i64
    }
}
