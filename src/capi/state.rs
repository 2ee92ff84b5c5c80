//! `fnx_state`: one sequence being decoded.

use super::handle::{lease, Lease};
use super::{
    fail, fnx_model, fnx_status, guard, log, non_null, Failure, FNX_ERR_ABORTED, FNX_ERR_BUFFER_TOO_SMALL,
    FNX_ERR_MODEL_FREED, FNX_ERR_NO_LOGITS, FNX_ERR_STATE_INVALID, FNX_LOG_DEBUG,
};
use crate::model::State;
use crate::tokenizer::SharedTokenizer;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Polled by decoding calls before every pass (a generated token, or a
/// micro-batch of a prompt) and between the layers of a prompt's pass;
/// return true to abort the call (it then returns `FNX_ERR_ABORTED` and the
/// state is as it was). Within a prompt's pass it is called from one of the
/// model's threads (one call at a time, while the decoding call waits), so
/// it must not rely on running on the calling thread.
pub type fnx_abort_callback = Option<unsafe extern "C" fn(user_data: *mut c_void) -> bool>;

/// Decode state of one sequence (opaque). Use from one thread at a time.
pub struct fnx_state {
    pub(crate) state: State,
    /// The model's tokenizer (shared with the model handle).
    pub(crate) tokenizer: SharedTokenizer,
    model_alive: Arc<AtomicBool>,
    /// Set when an internal error interrupted a decode half way.
    pub(crate) poisoned: bool,
    /// Set by `fnx_state_set_abort_callback`.
    abort: Option<(unsafe extern "C" fn(*mut c_void) -> bool, *mut c_void)>,
}

impl fnx_state {
    /// The abort callback as a closure (never aborts when none is set).
    pub(crate) fn abort_fn(&self) -> impl FnMut() -> bool {
        let abort = self.abort;
        // SAFETY: the caller registered the callback and its user data for this state.
        move || abort.is_some_and(|(f, user_data)| super::outside(|| unsafe { f(user_data) }))
    }
}

/// The abort error every decoding entry point returns.
pub(crate) fn aborted(func: &str) -> Failure {
    fail(FNX_ERR_ABORTED, format!("{func}: aborted by the abort callback; the state is unchanged"))
}

/// Takes a live, usable state handle for the call (registered, not busy,
/// model alive, not poisoned).
pub(crate) fn check(p: *const fnx_state, func: &str) -> Result<Lease<fnx_state>, Failure> {
    let s = check_live(p, func)?;
    if s.poisoned {
        return Err(fail(
            FNX_ERR_STATE_INVALID,
            format!("{func}: an earlier internal error left this state unusable; call fnx_state_reset"),
        ));
    }
    Ok(s)
}

/// Marks a state unusable after a panic interrupted a call on it.
pub(crate) fn poison(p: *const fnx_state) {
    if let Ok(mut s) = lease(p, "") {
        s.poisoned = true;
    }
}

/// Like `check` but accepts a poisoned state (for calls that replace its contents).
fn check_live(p: *const fnx_state, func: &str) -> Result<Lease<fnx_state>, Failure> {
    let s = lease(p, func)?;
    if !s.model_alive.load(Ordering::Acquire) {
        return Err(fail(FNX_ERR_MODEL_FREED, format!("{func}: the state's model has been freed")));
    }
    Ok(s)
}

/// Creates an empty state for `model`. The caller frees it with `fnx_free_state`.
///
/// # Safety
/// `model` must be NULL or a live handle; `out_state` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_new_state(model: *mut fnx_model, out_state: *mut *mut fnx_state) -> fnx_status {
    guard(
        || {
            non_null!(model, "fnx_new_state", "model");
            non_null!(out_state, "fnx_new_state", "out_state");
            let m = fnx_model::from_ptr(model, "fnx_new_state")?;
            let s = Box::new(fnx_state {
                state: State::new(m.model.clone())?,
                tokenizer: m.tokenizer.clone(),
                model_alive: m.alive.clone(),
                poisoned: false,
                abort: None,
            });
            // SAFETY: checked non-NULL; written only on success.
            unsafe { *out_state = super::handle::insert(s) };
            Ok(())
        },
        || {},
    )
}

/// Frees a state (NULL is ignored). A freed handle, a handle of another kind
/// and a state in use by a call in progress are left alone.
///
/// # Safety
/// `state` must be NULL or a handle from `fnx_new_state` not yet freed.
#[no_mangle]
pub unsafe extern "C" fn fnx_free_state(state: *mut fnx_state) {
    if state.is_null() {
        return;
    }
    let _ = guard(
        || {
            drop(super::handle::remove(state, "fnx_free_state")?);
            Ok(())
        },
        || {},
    );
}

/// Decodes `token` at the state's next position and keeps its logits.
/// Errors (`FNX_ERR_TOKEN_OUT_OF_RANGE`, `FNX_ERR_CONTEXT_FULL`, ...) leave the
/// state unchanged.
///
/// # Safety
/// `state` must be NULL or a live handle, not used by another thread meanwhile.
#[no_mangle]
pub unsafe extern "C" fn fnx_decode_token(state: *mut fnx_state, token: i32) -> fnx_status {
    guard(
        || {
            non_null!(state, "fnx_decode_token", "state");
            let mut s = check(state, "fnx_decode_token")?;
            let token = u32::try_from(token).map_err(|_| {
                fail(super::FNX_ERR_TOKEN_OUT_OF_RANGE, format!("fnx_decode_token: token {token} is negative"))
            })?;
            if s.abort.is_some() {
                // Bad arguments are reported as such, even when an abort is pending.
                s.state.check_tokens(&[token])?;
                if s.abort_fn()() {
                    return Err(aborted("fnx_decode_token"));
                }
            }
            s.state.decode(token)?;
            Ok(())
        },
        // Only reached after a panic inside decode.
        || poison(state),
    )
}

/// Copies the logits of the last decoded token into `out`, which must hold
/// at least `fnx_model_vocab_size()` floats (`len` is its capacity).
///
/// # Safety
/// `state` must be NULL or a live handle; `out` NULL or `len` writable floats.
#[no_mangle]
pub unsafe extern "C" fn fnx_get_logits(state: *const fnx_state, out: *mut f32, len: usize) -> fnx_status {
    guard(
        || {
            non_null!(state, "fnx_get_logits", "state");
            non_null!(out, "fnx_get_logits", "out");
            let s = check(state, "fnx_get_logits")?;
            let logits = s
                .state
                .logits()
                .ok_or_else(|| fail(FNX_ERR_NO_LOGITS, "fnx_get_logits: no token has been decoded yet"))?;
            if len < logits.len() {
                return Err(fail(
                    FNX_ERR_BUFFER_TOO_SMALL,
                    format!("fnx_get_logits: buffer holds {len} floats, the vocabulary has {}", logits.len()),
                ));
            }
            // SAFETY: `out` has room for `len >= logits.len()` floats per the contract.
            unsafe { std::ptr::copy_nonoverlapping(logits.as_ptr(), out, logits.len()) };
            Ok(())
        },
        || {},
    )
}

/// Copies the logits after the `i`-th token (from 0) of the last decoding
/// call into `out`, which must hold at least `fnx_model_vocab_size()` floats
/// (`len` is its capacity). Every position has them after
/// `fnx_decode_batch(..., true)`; otherwise only the call's last token
/// (`FNX_ERR_NO_LOGITS` for the others, for `i` past the call's tokens, and
/// for positions a rewind forgot).
///
/// # Safety
/// `state` must be NULL or a live handle; `out` NULL or `len` writable floats.
#[no_mangle]
pub unsafe extern "C" fn fnx_get_logits_ith(state: *const fnx_state, i: usize, out: *mut f32, len: usize) -> fnx_status {
    guard(
        || {
            non_null!(state, "fnx_get_logits_ith", "state");
            non_null!(out, "fnx_get_logits_ith", "out");
            let s = check(state, "fnx_get_logits_ith")?;
            let n = s.state.batch_len();
            let logits = s.state.batch_logits(i).ok_or_else(|| {
                let why = if i >= n {
                    format!("the last call decoded {n} tokens")
                } else {
                    "its logits were not kept (decode with fnx_decode_batch(..., true) to keep every position's)".to_string()
                };
                fail(FNX_ERR_NO_LOGITS, format!("fnx_get_logits_ith: no logits for token {i}: {why}"))
            })?;
            if len < logits.len() {
                return Err(fail(
                    FNX_ERR_BUFFER_TOO_SMALL,
                    format!("fnx_get_logits_ith: buffer holds {len} floats, the vocabulary has {}", logits.len()),
                ));
            }
            // SAFETY: `out` has room for `len >= logits.len()` floats per the contract.
            unsafe { std::ptr::copy_nonoverlapping(logits.as_ptr(), out, logits.len()) };
            Ok(())
        },
        || {},
    )
}

/// Forgets the sequence (position back to 0). Also clears an unusable state.
///
/// # Safety
/// `state` must be NULL or a live handle, not used by another thread meanwhile.
#[no_mangle]
pub unsafe extern "C" fn fnx_state_reset(state: *mut fnx_state) -> fnx_status {
    guard(
        || {
            non_null!(state, "fnx_state_reset", "state");
            let mut s = check_live(state, "fnx_state_reset")?;
            s.state.reset()?;
            s.poisoned = false;
            Ok(())
        },
        || {},
    )
}

/// Number of tokens decoded so far (the next token's position); 0 if `state` is NULL.
///
/// # Safety
/// `state` must be NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn fnx_state_position(state: *const fnx_state) -> usize {
    let mut pos = 0;
    let _ = guard(
        || {
            non_null!(state, "fnx_state_position", "state");
            pos = lease(state, "fnx_state_position")?.state.position();
            Ok(())
        },
        || {},
    );
    pos
}

/// Returns the state to `position` (from `fnx_state_rewind_floor` to
/// `fnx_state_position`): everything decoded from there on is forgotten,
/// without copying any state (the model keeps the recurrent states of the
/// last `rewind_window` positions: see `fnx_load_params`). The logits are
/// then that position's when they were computed (`FNX_ERR_NO_LOGITS` from
/// `fnx_get_logits` otherwise). `FNX_ERR_INVALID_ARGUMENT`, state unchanged,
/// for a position outside that range.
///
/// # Safety
/// `state` must be NULL or a live handle, not used by another thread meanwhile.
#[no_mangle]
pub unsafe extern "C" fn fnx_state_rewind(state: *mut fnx_state, position: usize) -> fnx_status {
    guard(
        || {
            non_null!(state, "fnx_state_rewind", "state");
            let mut s = check(state, "fnx_state_rewind")?;
            s.state.rewind(position).map_err(|e| {
                let Failure(status, msg) = Failure::from(e);
                fail(status, format!("fnx_state_rewind: {msg}"))
            })
        },
        || {},
    )
}

/// The earliest position `fnx_state_rewind` can return to now.
///
/// # Safety
/// `state` must be NULL or a live handle; `out_position` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_state_rewind_floor(state: *const fnx_state, out_position: *mut usize) -> fnx_status {
    guard(
        || {
            non_null!(state, "fnx_state_rewind_floor", "state");
            non_null!(out_position, "fnx_state_rewind_floor", "out_position");
            let floor = check(state, "fnx_state_rewind_floor")?.state.rewind_floor();
            // SAFETY: checked non-NULL; written only on success.
            unsafe { *out_position = floor };
            Ok(())
        },
        || {},
    )
}

/// Sets the callback that decoding calls on this state (`fnx_decode_token`,
/// `fnx_decode_tokens`, `fnx_decode_batch`, `fnx_generate`) poll before
/// every pass (each generated token, each micro-batch of a prompt); NULL removes
/// it. When it returns true the call stops and returns `FNX_ERR_ABORTED`,
/// leaving the state as it was before the call. It runs on the decoding
/// thread; calls it makes on this state are refused with `FNX_ERR_BUSY`.
/// Copies made with `fnx_state_copy` do not inherit it.
///
/// # Safety
/// `state` must be NULL or a live handle, not used by another thread
/// meanwhile; `callback` must stay callable with `user_data` while set.
#[no_mangle]
pub unsafe extern "C" fn fnx_state_set_abort_callback(
    state: *mut fnx_state,
    callback: fnx_abort_callback,
    user_data: *mut c_void,
) -> fnx_status {
    guard(
        || {
            non_null!(state, "fnx_state_set_abort_callback", "state");
            let mut s = check_live(state, "fnx_state_set_abort_callback")?;
            s.abort = callback.map(|f| (f, user_data));
            Ok(())
        },
        || {},
    )
}

/// Makes an independent copy of `state` (same model, same sequence so far):
/// both can then continue differently. The copy has no abort callback. The
/// caller frees it with `fnx_free_state`.
///
/// # Safety
/// `state` must be NULL or a live handle not being modified meanwhile;
/// `out_state` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_state_copy(state: *const fnx_state, out_state: *mut *mut fnx_state) -> fnx_status {
    guard(
        || {
            non_null!(state, "fnx_state_copy", "state");
            non_null!(out_state, "fnx_state_copy", "out_state");
            let s = check(state, "fnx_state_copy")?;
            let copy = Box::new(fnx_state {
                state: s.state.try_clone()?,
                tokenizer: s.tokenizer.clone(),
                model_alive: s.model_alive.clone(),
                poisoned: false,
                abort: None,
            });
            // SAFETY: checked non-NULL; written only on success.
            unsafe { *out_state = super::handle::insert(copy) };
            Ok(())
        },
        || {},
    )
}

/// Bytes `fnx_state_save` will write for the state as it is now.
///
/// # Safety
/// `state` must be NULL or a live handle; `out_size` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_state_save_size(state: *const fnx_state, out_size: *mut usize) -> fnx_status {
    guard(
        || {
            non_null!(state, "fnx_state_save_size", "state");
            non_null!(out_size, "fnx_state_save_size", "out_size");
            let s = check(state, "fnx_state_save_size")?;
            // SAFETY: checked non-NULL.
            unsafe { *out_size = s.state.save_size() };
            Ok(())
        },
        || {},
    )
}

/// Writes a snapshot of the state (position, every cache, the last logits)
/// into `out`, which holds `capacity` bytes; `*out_written` (may be NULL)
/// receives its length. `FNX_ERR_BUFFER_TOO_SMALL` (nothing written) when
/// `capacity < fnx_state_save_size()`. The snapshot carries the model's
/// fingerprint and can be loaded into any state of the same model file.
///
/// # Safety
/// `state` must be NULL or a live handle; `out` NULL or `capacity` writable
/// bytes; `out_written` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_state_save(
    state: *const fnx_state,
    out: *mut u8,
    capacity: usize,
    out_written: *mut usize,
) -> fnx_status {
    guard(
        || {
            non_null!(state, "fnx_state_save", "state");
            non_null!(out, "fnx_state_save", "out");
            let s = check(state, "fnx_state_save")?;
            let size = s.state.save_size();
            if capacity < size {
                return Err(fail(
                    FNX_ERR_BUFFER_TOO_SMALL,
                    format!("fnx_state_save: buffer holds {capacity} bytes, the snapshot needs {size}"),
                ));
            }
            // SAFETY: `out` has `capacity >= size` writable bytes per the contract.
            let buf = unsafe { std::slice::from_raw_parts_mut(out, size) };
            let n = s.state.save_into(buf).map_err(|e| {
                let Failure(status, msg) = Failure::from(e);
                fail(status, format!("fnx_state_save: {msg}"))
            })?;
            if !out_written.is_null() {
                // SAFETY: non-NULL and writable per the contract.
                unsafe { *out_written = n };
            }
            log(FNX_LOG_DEBUG, || format!("saved a state at position {} ({n} bytes)", s.state.position()));
            Ok(())
        },
        || {},
    )
}

/// Replaces the state's contents with a snapshot from `fnx_state_save`
/// (`size` bytes at `data`). Refused, with the state unchanged:
/// `FNX_ERR_SNAPSHOT_MISMATCH` for a snapshot of another model, format
/// version or a longer context than this model allows;
/// `FNX_ERR_SNAPSHOT_CORRUPT` for truncated, damaged or foreign bytes.
/// Success also clears an unusable (poisoned) state. The abort callback is kept.
///
/// # Safety
/// `state` must be NULL or a live handle, not used by another thread
/// meanwhile; `data` NULL or `size` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn fnx_state_load(state: *mut fnx_state, data: *const u8, size: usize) -> fnx_status {
    guard(
        || {
            non_null!(state, "fnx_state_load", "state");
            non_null!(data, "fnx_state_load", "data");
            let mut s = check_live(state, "fnx_state_load")?;
            // SAFETY: the caller guarantees `size` readable bytes.
            let bytes = unsafe { super::slice_arg(data, size, "fnx_state_load", "size") }?;
            s.state.restore(bytes).map_err(|e| {
                let Failure(status, msg) = Failure::from(e);
                fail(status, format!("fnx_state_load: {msg}"))
            })?;
            s.poisoned = false;
            log(FNX_LOG_DEBUG, || format!("loaded a state at position {} ({size} bytes)", s.state.position()));
            Ok(())
        },
        || {},
    )
}
