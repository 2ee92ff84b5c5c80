//! `fnx_state`: one sequence being decoded.

use super::{
    fail, fnx_model, fnx_status, guard, non_null, Failure, FNX_ERR_BUFFER_TOO_SMALL, FNX_ERR_INVALID_HANDLE,
    FNX_ERR_MODEL_FREED, FNX_ERR_NO_LOGITS, FNX_ERR_STATE_INVALID,
};
use crate::model::State;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Decode state of one sequence (opaque). Use from one thread at a time.
pub struct fnx_state {
    tag: u64,
    state: State,
    model_alive: Arc<AtomicBool>,
    /// Set when an internal error interrupted a decode half way.
    poisoned: bool,
}

const STATE_TAG: u64 = 0x666e_785f_7374_6174; // "fnx_stat"

fn check<'a>(p: *const fnx_state, func: &str) -> Result<&'a fnx_state, Failure> {
    // SAFETY: non-NULL (checked by the caller) handle from fnx_new_state; the tag
    // catches handles of the wrong kind.
    let s = unsafe { &*p };
    if s.tag != STATE_TAG {
        return Err(fail(FNX_ERR_INVALID_HANDLE, format!("{func}: not a live fnx_state handle")));
    }
    if !s.model_alive.load(Ordering::Acquire) {
        return Err(fail(FNX_ERR_MODEL_FREED, format!("{func}: the state's model has been freed")));
    }
    if s.poisoned {
        return Err(fail(
            FNX_ERR_STATE_INVALID,
            format!("{func}: an earlier internal error left this state unusable; call fnx_state_reset"),
        ));
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
                tag: STATE_TAG,
                state: State::new(m.model.clone())?,
                model_alive: m.alive.clone(),
                poisoned: false,
            });
            // SAFETY: checked non-NULL; written only on success.
            unsafe { *out_state = Box::into_raw(s) };
            Ok(())
        },
        || {},
    )
}

/// Frees a state (NULL is ignored).
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
            // SAFETY: see `check`; freed once from the Box made in fnx_new_state.
            if unsafe { (*state).tag } != STATE_TAG {
                return Err(fail(FNX_ERR_INVALID_HANDLE, "fnx_free_state: not a live fnx_state handle"));
            }
            let mut b = unsafe { Box::from_raw(state) };
            b.tag = 0;
            drop(b);
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
            check(state, "fnx_decode_token")?;
            // SAFETY: checked above; the caller guarantees exclusive use.
            let s = unsafe { &mut *state };
            let token = u32::try_from(token).map_err(|_| {
                fail(super::FNX_ERR_TOKEN_OUT_OF_RANGE, format!("fnx_decode_token: token {token} is negative"))
            })?;
            s.state.decode(token)?;
            Ok(())
        },
        // SAFETY: as above; only reached after a panic inside decode.
        || unsafe { (*state).poisoned = true },
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

/// Forgets the sequence (position back to 0). Also clears an unusable state.
///
/// # Safety
/// `state` must be NULL or a live handle, not used by another thread meanwhile.
#[no_mangle]
pub unsafe extern "C" fn fnx_state_reset(state: *mut fnx_state) -> fnx_status {
    guard(
        || {
            non_null!(state, "fnx_state_reset", "state");
            // SAFETY: non-NULL handle; the tag is checked before use.
            let s = unsafe { &mut *state };
            if s.tag != STATE_TAG {
                return Err(fail(FNX_ERR_INVALID_HANDLE, "fnx_state_reset: not a live fnx_state handle"));
            }
            if !s.model_alive.load(Ordering::Acquire) {
                return Err(fail(FNX_ERR_MODEL_FREED, "fnx_state_reset: the state's model has been freed"));
            }
            s.state.reset();
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
            // SAFETY: non-NULL live handle per the contract; tag checked.
            let s = unsafe { &*state };
            if s.tag != STATE_TAG {
                return Err(fail(FNX_ERR_INVALID_HANDLE, "fnx_state_position: not a live fnx_state handle"));
            }
            pos = s.state.position();
            Ok(())
        },
        || {},
    );
    pos
}
