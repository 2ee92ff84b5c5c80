//! The C ABI. One file per handle type; this module holds what they share:
//! status codes, the thread-local last error, and the panic boundary.
//!
//! Conventions (also in the README and the generated header):
//! - Functions that can fail return an `fnx_status`; `FNX_OK` (0) is success.
//!   On failure `fnx_last_error()` gives a message for the calling thread.
//! - Out-parameters are written only on success.
//! - Handles are opaque; whoever receives one from `fnx_load`/`fnx_new_state`
//!   owns it and frees it with the matching `fnx_free_*`. They are numbers
//!   from a registry (`handle`), never addresses: freed handles, handles of
//!   another kind and handles in use by a call in progress are refused.
//! - A model may be used from many threads at once; a state by one thread at a time.
//! - Panics never cross the boundary: they become `FNX_ERR_INTERNAL`, with
//!   the message in `fnx_last_error` and the log, never on stderr (`panics`).
//! - Counts larger than any array can hold are `FNX_ERR_INVALID_ARGUMENT`,
//!   checked before anything is read (`check_count`, `slice_arg`).
#![allow(non_camel_case_types)]

mod chat_parser;
mod generate;
mod handle;
mod job;
mod model;
mod panics;
mod sampler;
mod state;
mod text;

pub use chat_parser::*;
pub use generate::*;
pub use job::*;
pub use model::*;
pub use sampler::*;
pub use state::*;
pub use text::*;

use crate::error::Error;
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Result of a fallible call: `FNX_OK` or one of the `FNX_ERR_*` codes.
pub type fnx_status = i32;

/// Success.
pub const FNX_OK: fnx_status = 0;
/// A required pointer argument was NULL.
pub const FNX_ERR_NULL_ARGUMENT: fnx_status = 1;
/// An argument had a value the function cannot accept.
pub const FNX_ERR_INVALID_ARGUMENT: fnx_status = 2;
/// A token id was outside the model's vocabulary.
pub const FNX_ERR_TOKEN_OUT_OF_RANGE: fnx_status = 3;
/// The state holds as many positions as its context limit allows.
pub const FNX_ERR_CONTEXT_FULL: fnx_status = 4;
/// The caller's buffer is shorter than the data to copy.
pub const FNX_ERR_BUFFER_TOO_SMALL: fnx_status = 5;
/// The file could not be opened, mapped or read.
pub const FNX_ERR_IO: fnx_status = 6;
/// The file is not a well-formed GGUF container.
pub const FNX_ERR_INVALID_FILE: fnx_status = 7;
/// The GGUF file does not describe a usable qwen4exp model.
pub const FNX_ERR_INVALID_MODEL: fnx_status = 8;
/// No token has been decoded yet, so there are no logits.
pub const FNX_ERR_NO_LOGITS: fnx_status = 9;
/// The state's model was freed with `fnx_free_model`.
pub const FNX_ERR_MODEL_FREED: fnx_status = 10;
/// The requested compute backend is not available.
pub const FNX_ERR_BACKEND_UNAVAILABLE: fnx_status = 11;
/// Memory could not be obtained.
pub const FNX_ERR_OUT_OF_MEMORY: fnx_status = 12;
/// A bug inside flashnext (a caught panic). The state involved is unusable
/// until reset, except after `fnx_generate` and a multi-token
/// `fnx_decode_tokens`, which roll it back to where it was before the call.
pub const FNX_ERR_INTERNAL: fnx_status = 13;
/// The state was left unusable by an earlier internal error; reset or free it.
pub const FNX_ERR_STATE_INVALID: fnx_status = 14;
/// A handle of the wrong kind, or one already freed. Handles are numbers
/// that are never given out twice (not addresses), so a freed handle is
/// detected even after a new object took its memory.
pub const FNX_ERR_INVALID_HANDLE: fnx_status = 15;
/// Cancelled by the caller: the load progress callback returned false
/// (nothing was loaded), or a job was cancelled with `fnx_job_cancel` or
/// `fnx_job_free` (the state is as it was before the job).
pub const FNX_ERR_CANCELLED: fnx_status = 16;
/// The state's abort callback returned true; the state is as it was before the call.
pub const FNX_ERR_ABORTED: fnx_status = 17;
/// The snapshot is intact but belongs to another model, format version or context limit.
pub const FNX_ERR_SNAPSHOT_MISMATCH: fnx_status = 18;
/// The bytes are not a complete, undamaged state snapshot.
pub const FNX_ERR_SNAPSHOT_CORRUPT: fnx_status = 19;
/// The state, sampler or detokenizer is in use by a call in progress: a
/// callback of that call (e.g. `fnx_generate`'s token callback, an abort
/// callback) or another thread used it; or a running job (`fnx_job_start`)
/// holds it. Nothing was done.
pub const FNX_ERR_BUSY: fnx_status = 20;

/// `fnx_sampler_set_constraint` kind: no constraint (removes one).
pub const FNX_CONSTRAINT_NONE: i32 = 0;
/// `fnx_sampler_set_constraint` kind: a JSON Schema; the output is JSON valid against it.
pub const FNX_CONSTRAINT_JSON_SCHEMA: i32 = 1;
/// `fnx_sampler_set_constraint` kind: a regular expression the whole output matches.
pub const FNX_CONSTRAINT_REGEX: i32 = 2;
/// `fnx_sampler_set_constraint` kind: a grammar in llguidance's Lark syntax (rule `start`).
pub const FNX_CONSTRAINT_LARK: i32 = 3;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// An error on its way to C: a status and the message for `fnx_last_error`.
pub(crate) struct Failure(pub fnx_status, pub String);

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let status = match &e {
            Error::Format(_) => FNX_ERR_INVALID_FILE,
            Error::Model(_) | Error::Convert(_) => FNX_ERR_INVALID_MODEL,
            Error::TokenOutOfRange(_) => FNX_ERR_TOKEN_OUT_OF_RANGE,
            Error::InvalidArgument(_) => FNX_ERR_INVALID_ARGUMENT,
            Error::ContextFull(_) => FNX_ERR_CONTEXT_FULL,
            Error::Io { .. } => FNX_ERR_IO,
            Error::Backend(_) => FNX_ERR_BACKEND_UNAVAILABLE,
            Error::OutOfMemory(_) => FNX_ERR_OUT_OF_MEMORY,
            Error::StateLost(_) => FNX_ERR_STATE_INVALID,
            Error::Aborted => FNX_ERR_ABORTED,
            Error::Internal(_) => FNX_ERR_INTERNAL,
            Error::Snapshot(s) if s.is_mismatch() => FNX_ERR_SNAPSHOT_MISMATCH,
            Error::Snapshot(_) => FNX_ERR_SNAPSHOT_CORRUPT,
        };
        Failure(status, e.to_string())
    }
}

pub(crate) fn fail(status: fnx_status, msg: impl Into<String>) -> Failure {
    Failure(status, msg.into())
}

fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

use crate::error::panic_message;

/// Runs `f` behind the panic boundary and turns its outcome into a status.
/// `on_panic` runs after a caught panic (to mark a state unusable). A panic
/// inside goes to the log callback, not to standard error (see `panics`).
pub(crate) fn guard(f: impl FnOnce() -> Result<(), Failure>, on_panic: impl FnOnce()) -> fnx_status {
    match panics::inside(|| catch_unwind(AssertUnwindSafe(f))) {
        Ok(Ok(())) => FNX_OK,
        Ok(Err(Failure(status, msg))) => {
            set_last_error(&msg);
            status
        }
        Err(p) => {
            on_panic();
            set_last_error(&format!("internal error (please report): {}{}", panic_message(&*p), panic_location()));
            FNX_ERR_INTERNAL
        }
    }
}

/// " at FILE:LINE:COLUMN" of the last panic caught on this thread, or "".
pub(crate) fn panic_location() -> String {
    panics::take_location().map(|l| format!(" at {l}")).unwrap_or_default()
}

/// Panics behind the boundary exactly as a bug inside an `fnx_` call would,
/// for tests of where its message goes. Returns `FNX_ERR_INTERNAL`.
#[doc(hidden)]
pub fn panic_behind_boundary(message: &str) -> fnx_status {
    guard(|| panic!("{message}"), || {})
}

pub(crate) use panics::outside;

/// Returns `Err` with `FNX_ERR_NULL_ARGUMENT` naming `$name` when `$ptr` is NULL.
macro_rules! non_null {
    ($ptr:expr, $func:literal, $name:literal) => {
        if $ptr.is_null() {
            return Err($crate::capi::fail(
                $crate::capi::FNX_ERR_NULL_ARGUMENT,
                concat!($func, ": ", $name, " is NULL"),
            ));
        }
    };
}
pub(crate) use non_null;

/// Checks that `n` items of `T` could be a real array (`n * size_of::<T>()`
/// at most `isize::MAX` bytes): larger counts are
/// `FNX_ERR_INVALID_ARGUMENT`, before anything is read.
pub(crate) fn check_count<T>(n: usize, func: &str, what: &str) -> Result<(), Failure> {
    let max = isize::MAX as usize / std::mem::size_of::<T>().max(1);
    if n > max {
        return Err(fail(
            FNX_ERR_INVALID_ARGUMENT,
            format!("{func}: {what} is {n}, more than any array can hold ({max} at most)"),
        ));
    }
    Ok(())
}

/// The `n` items at `p` (NULL is accepted when `n` is 0), after the NULL and
/// count checks.
///
/// # Safety
/// When `n` > 0, `p` must be NULL or point to `n` readable items that stay
/// unchanged for `'a`.
pub(crate) unsafe fn slice_arg<'a, T>(p: *const T, n: usize, func: &str, what: &str) -> Result<&'a [T], Failure> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(fail(FNX_ERR_NULL_ARGUMENT, format!("{func}: {what} is NULL but its count is {n}")));
    }
    check_count::<T>(n, func, what)?;
    // SAFETY: non-NULL, a real count, and `n` readable items per the contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// The most worker threads `fnx_load` accepts: four per logical CPU, and
/// never fewer than 256. More threads than cores only slow the matrix
/// products down; a count beyond this is a mistake, and honouring it would
/// start that many threads.
pub(crate) fn max_threads() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    cpus.saturating_mul(4).max(256)
}

/// Refuses a thread count beyond [`max_threads`].
pub(crate) fn check_threads(n: u32, func: &str) -> Result<(), Failure> {
    let max = max_threads();
    if n as usize > max {
        return Err(fail(
            FNX_ERR_INVALID_ARGUMENT,
            format!("{func}: n_threads {n} is more than {max} (four per logical CPU, at least 256)"),
        ));
    }
    Ok(())
}

/// The message of the last failed call on this thread, or "" if none. The
/// pointer stays valid until the next failing call on the same thread.
#[no_mangle]
pub extern "C" fn fnx_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// The library version, e.g. "0.1.0" (static string, never freed).
#[no_mangle]
pub extern "C" fn fnx_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// A short constant name for a status code, e.g. "FNX_ERR_CONTEXT_FULL".
#[no_mangle]
pub extern "C" fn fnx_status_name(status: fnx_status) -> *const c_char {
    let s: &'static str = match status {
        FNX_OK => "FNX_OK\0",
        FNX_ERR_NULL_ARGUMENT => "FNX_ERR_NULL_ARGUMENT\0",
        FNX_ERR_INVALID_ARGUMENT => "FNX_ERR_INVALID_ARGUMENT\0",
        FNX_ERR_TOKEN_OUT_OF_RANGE => "FNX_ERR_TOKEN_OUT_OF_RANGE\0",
        FNX_ERR_CONTEXT_FULL => "FNX_ERR_CONTEXT_FULL\0",
        FNX_ERR_BUFFER_TOO_SMALL => "FNX_ERR_BUFFER_TOO_SMALL\0",
        FNX_ERR_IO => "FNX_ERR_IO\0",
        FNX_ERR_INVALID_FILE => "FNX_ERR_INVALID_FILE\0",
        FNX_ERR_INVALID_MODEL => "FNX_ERR_INVALID_MODEL\0",
        FNX_ERR_NO_LOGITS => "FNX_ERR_NO_LOGITS\0",
        FNX_ERR_MODEL_FREED => "FNX_ERR_MODEL_FREED\0",
        FNX_ERR_BACKEND_UNAVAILABLE => "FNX_ERR_BACKEND_UNAVAILABLE\0",
        FNX_ERR_OUT_OF_MEMORY => "FNX_ERR_OUT_OF_MEMORY\0",
        FNX_ERR_INTERNAL => "FNX_ERR_INTERNAL\0",
        FNX_ERR_STATE_INVALID => "FNX_ERR_STATE_INVALID\0",
        FNX_ERR_INVALID_HANDLE => "FNX_ERR_INVALID_HANDLE\0",
        FNX_ERR_CANCELLED => "FNX_ERR_CANCELLED\0",
        FNX_ERR_ABORTED => "FNX_ERR_ABORTED\0",
        FNX_ERR_SNAPSHOT_MISMATCH => "FNX_ERR_SNAPSHOT_MISMATCH\0",
        FNX_ERR_SNAPSHOT_CORRUPT => "FNX_ERR_SNAPSHOT_CORRUPT\0",
        FNX_ERR_BUSY => "FNX_ERR_BUSY\0",
        _ => "FNX_UNKNOWN_STATUS\0",
    };
    s.as_ptr().cast()
}
