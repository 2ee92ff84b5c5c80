//! `fnx_job`: a generation (`fnx_generate`'s loop) that runs on a thread of
//! its own, so that the caller's loop (a game's frame loop, a UI's event loop)
//! never blocks: it polls for text, and may cancel, wait for or free the job.
//!
//! The job holds its state (and its sampler) for as long as it runs, as a
//! call holds them: any other call on them meanwhile gets `FNX_ERR_BUSY`
//! saying a job holds them. It lets go before it reports that it finished,
//! so once `fnx_job_poll` says finished (or `fnx_job_wait` returns) the state
//! can be used again. Cancelling is the abort mechanism: the job polls its
//! cancel flag (and the state's abort callback) before every generated
//! token and, in the prompt, before every micro-batch and between its
//! layers; and a cancelled job leaves the state as it was before
//! the job, as an aborted `fnx_generate` does.

use super::generate::{check_fits, check_room, generate_failure, request, run, token_ids, Request};
use super::handle::{with, Lease};
use super::state::{check, poison};
use super::text::{bytes_arg, utf8};
use super::{
    fail, fnx_generate_params, fnx_state, fnx_status, guard, non_null, panic_message, Failure, FNX_ERR_BUFFER_TOO_SMALL,
    FNX_ERR_BUSY, FNX_ERR_CANCELLED, FNX_ERR_INTERNAL, FNX_ERR_OUT_OF_MEMORY, FNX_OK,
};
use crate::error::Error;
use std::ffi::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// What the job's thread and the caller share.
struct Core {
    /// Set by `fnx_job_cancel` and by freeing the job.
    cancel: AtomicBool,
    shared: Mutex<Shared>,
    /// Signalled when `outcome` is set.
    finished: Condvar,
}

#[derive(Default)]
struct Shared {
    /// Generated text not yet polled (whole UTF-8 characters).
    text: Vec<u8>,
    /// Tokens generated so far.
    n_tokens: usize,
    /// The job's status and message, once it has finished.
    outcome: Option<(fnx_status, String)>,
}

impl Core {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        // Every statement leaves `Shared` consistent, so a poisoned lock is still usable.
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A generation running on its own thread (opaque). Unlike other handles it
/// may be polled, cancelled and waited for from several threads at once.
/// Free it with `fnx_job_free` (which cancels it if it still runs) once no
/// other thread is about to use it.
pub struct fnx_job {
    core: Arc<Core>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for fnx_job {
    fn drop(&mut self) {
        self.core.cancel.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            // Freed from the job's own thread (the state's abort callback): the
            // thread ends by itself, cancelled, and cannot wait for itself.
            if t.thread().id() != std::thread::current().id() {
                // The thread catches its own panics; a join error cannot carry anything new.
                let _ = t.join();
            }
        }
    }
}

/// The state and sampler leases and the request, moved to the job's thread.
struct Work {
    state: Lease<fnx_state>,
    req: Request,
}

// SAFETY: the leases hold the state and the sampler exclusively (any other
// use is refused as busy until they are dropped), and what they hold is Send
// (checked below) but for the raw pointers: the leases' own and the abort
// callback's user data, which is the caller's, documented to be called on the
// job's thread.
unsafe impl Send for Work {}

/// What a job moves to its thread, besides raw pointers, must stay `Send`.
const _: fn() = || {
    fn send<T: Send>() {}
    send::<crate::model::State>();
    send::<crate::sampling::Sampler>();
    send::<crate::tokenizer::SharedTokenizer>();
    send::<crate::generate::GenerateOptions>();
};

/// The job's thread: runs the request, lets go of the state and sampler, then
/// publishes the outcome.
fn work(mut w: Work, core: &Core) -> Result<(), Failure> {
    const F: &str = "fnx_job";
    let mut user_abort = w.state.abort_fn();
    let mut abort = || core.cancel.load(Ordering::Acquire) || user_abort();
    let mut emit = |_token: u32, piece: &[u8]| -> bool {
        let mut sh = core.lock();
        sh.text.extend_from_slice(piece);
        sh.n_tokens += 1;
        true
    };
    let result = run(&mut w.state, &mut w.req, &mut abort, &mut emit);
    drop(w);
    match result {
        Ok(_) => Ok(()),
        Err(Error::Aborted) if core.cancel.load(Ordering::Acquire) => Err(fail(
            FNX_ERR_CANCELLED,
            format!("{F}: cancelled (fnx_job_cancel or fnx_job_free); the state is as it was before the job"),
        )),
        Err(e) => Err(generate_failure(e, F)),
    }
}

/// Starts the thread of a checked request.
fn spawn(state: *mut fnx_state, lease: Lease<fnx_state>, req: Request, out_job: *mut *mut fnx_job) -> Result<(), Failure> {
    lease.hold_for_job();
    if let Some(s) = &req.sampler {
        s.hold_for_job();
    }
    let core = Arc::new(Core { cancel: AtomicBool::new(false), shared: Mutex::default(), finished: Condvar::new() });
    let w = Work { state: lease, req };
    let theirs = core.clone();
    let handle = state as usize;
    let thread = std::thread::Builder::new()
        .name("flashnext-job".into())
        .spawn(move || {
            let outcome = super::panics::inside(|| catch_unwind(AssertUnwindSafe(|| work(w, &theirs))));
            let outcome = match outcome {
                Ok(Ok(())) => (FNX_OK, String::new()),
                Ok(Err(Failure(status, msg))) => (status, msg),
                Err(p) => {
                    // `generate` rolls back its own panics; one elsewhere may have left the state half way.
                    poison(handle as *const fnx_state);
                    let msg = format!("fnx_job: internal error (please report): {}{}", panic_message(&*p), super::panic_location());
                    (FNX_ERR_INTERNAL, msg)
                }
            };
            theirs.lock().outcome = Some(outcome);
            theirs.finished.notify_all();
        })
        .map_err(|e| fail(FNX_ERR_OUT_OF_MEMORY, format!("fnx_job_start: cannot start the job's thread: {e}")))?;
    let job = Box::new(fnx_job { core, thread: Some(thread) });
    // SAFETY: checked non-NULL by the caller; written only on success.
    unsafe { *out_job = super::handle::insert(job) };
    Ok(())
}

/// Starts generating on a thread of flashnext's own and returns at once:
/// decodes `prompt` (`n_prompt` tokens; may be empty when the state already
/// has logits), then generates as `fnx_generate` does with `params` (NULL:
/// the defaults). `*out_job` receives the job; take its text with
/// `fnx_job_poll`, and free it with `fnx_job_free`.
///
/// Every argument is checked, and everything `params` points to is copied,
/// before this returns: the same failures as `fnx_generate`'s, and nothing
/// starts. While the job runs it holds `state` and `params->sampler`: other
/// calls on them get `FNX_ERR_BUSY` (`fnx_state_position` answers 0, and
/// `fnx_free_state` and `fnx_sampler_free` leave them alone). The state's abort callback, if set, is polled on the job's thread.
///
/// # Safety
/// `state` NULL or a live handle; `prompt` NULL or `n_prompt` readable ids;
/// `params` NULL or a valid `fnx_generate_params` whose arrays hold the stated
/// counts; `out_job` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_job_start(
    state: *mut fnx_state,
    prompt: *const i32,
    n_prompt: usize,
    params: *const fnx_generate_params,
    out_job: *mut *mut fnx_job,
) -> fnx_status {
    const F: &str = "fnx_job_start";
    guard(
        || {
            non_null!(state, "fnx_job_start", "state");
            non_null!(out_job, "fnx_job_start", "out_job");
            let s = check(state, F)?;
            check_room(&s, prompt, n_prompt, F, "prompt")?;
            // SAFETY: per the contract.
            let prompt = unsafe { token_ids(prompt, n_prompt, F, "prompt") }?;
            // SAFETY: per the contract.
            let req = unsafe { request(&s, prompt, params, F) }?;
            spawn(state, s, req, out_job)
        },
        || {},
    )
}

/// `fnx_job_start` with a prompt given as text: `text_len` bytes of UTF-8,
/// tokenized with the model's tokenizer as `fnx_tokenize` does (no BOS/EOS
/// added; `parse_special` turns special-token text such as `<|im_start|>`
/// into those tokens: true for the output of `fnx_apply_chat_template`,
/// false for untrusted text). Invalid UTF-8 is `FNX_ERR_INVALID_ARGUMENT`, a
/// model file without a tokenizer `FNX_ERR_INVALID_MODEL`.
///
/// # Safety
/// As `fnx_job_start`; `text` NULL or `text_len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn fnx_job_start_text(
    state: *mut fnx_state,
    text: *const c_char,
    text_len: usize,
    parse_special: bool,
    params: *const fnx_generate_params,
    out_job: *mut *mut fnx_job,
) -> fnx_status {
    const F: &str = "fnx_job_start_text";
    guard(
        || {
            non_null!(state, "fnx_job_start_text", "state");
            non_null!(out_job, "fnx_job_start_text", "out_job");
            let text = utf8(bytes_arg(text, text_len, F, "text")?, F, "text")?;
            let s = check(state, F)?;
            let model = s.state.model().clone();
            let tok = s.tokenizer.get(&model).map_err(|e| {
                let f = Failure::from(e);
                Failure(f.0, format!("{F}: {}", f.1))
            })?;
            let prompt = tok.encode(text, false, parse_special).map_err(|e| {
                let f = Failure::from(e);
                Failure(f.0, format!("{F}: {}", f.1))
            })?;
            check_fits(&s, prompt.len(), F)?;
            // SAFETY: per the contract.
            let req = unsafe { request(&s, prompt, params, F) }?;
            spawn(state, s, req, out_job)
        },
        || {},
    )
}

/// The job's shared core. Job handles are never held busy: polls, cancels
/// and waits from several threads at once all go through.
fn job_core(job: *mut fnx_job, func: &str) -> Result<Arc<Core>, Failure> {
    with(job, func, |j| j.core.clone())
}

/// Never blocks: copies the text generated since the last poll to `out`
/// (room for `capacity` bytes; NOT NUL-terminated; whole UTF-8 characters
/// only: what does not fit stays for the next poll) and its length to
/// `*out_len` (0 when nothing is new). `*out_n_tokens` (may be NULL): tokens
/// generated so far. `*out_finished` (may be NULL): true once the job has
/// ended and all its text has been taken; `fnx_job_wait` then returns its
/// outcome at once. `out` may be NULL when `capacity` is 0 (a poll for
/// progress only). When the next character is longer than a non-zero
/// `capacity`: `FNX_ERR_BUFFER_TOO_SMALL` with its length in `*out_len`
/// (room for 4 bytes always suffices). Special tokens (e.g. `<|im_end|>`) give no text. Polling a
/// finished job gives nothing new and stays finished.
///
/// # Safety
/// `job` NULL or a live handle; `out` NULL or room for `capacity` bytes;
/// `out_len` NULL or writable; `out_n_tokens` and `out_finished` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_job_poll(
    job: *mut fnx_job,
    out: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
    out_n_tokens: *mut usize,
    out_finished: *mut bool,
) -> fnx_status {
    const F: &str = "fnx_job_poll";
    guard(
        || {
            non_null!(job, "fnx_job_poll", "job");
            non_null!(out_len, "fnx_job_poll", "out_len");
            super::text::check_out(out, capacity, F, "out")?;
            let core = job_core(job, F)?;
            let mut sh = core.lock();
            let mut n = sh.text.len().min(capacity);
            // Back to the start of a character (continuation bytes are 10xxxxxx).
            while n < sh.text.len() && n > 0 && sh.text[n] & 0xC0 == 0x80 {
                n -= 1;
            }
            if n == 0 && capacity > 0 && !sh.text.is_empty() {
                // The next character is longer than the buffer: say how long.
                let need = 1 + sh.text[1..].iter().take_while(|&&b| b & 0xC0 == 0x80).count();
                // SAFETY: checked non-NULL; the size-query exception.
                unsafe { *out_len = need };
                return Err(fail(
                    FNX_ERR_BUFFER_TOO_SMALL,
                    format!("{F}: the next character takes {need} bytes, the buffer holds {capacity}"),
                ));
            }
            if n > 0 {
                // SAFETY: `out` holds `capacity >= n` bytes per the contract.
                unsafe { std::ptr::copy_nonoverlapping(sh.text.as_ptr(), out.cast::<u8>(), n) };
                sh.text.drain(..n);
            }
            // SAFETY: checked non-NULL, or NULL and skipped; written only on success.
            unsafe {
                *out_len = n;
                if !out_n_tokens.is_null() {
                    *out_n_tokens = sh.n_tokens;
                }
                if !out_finished.is_null() {
                    *out_finished = sh.outcome.is_some() && sh.text.is_empty();
                }
            }
            Ok(())
        },
        || {},
    )
}

/// Asks the job to stop and returns at once. The job stops before its next
/// token (prompt tokens included); it then ends with `FNX_ERR_CANCELLED` and
/// leaves the state as it was before the job. A job that already finished
/// keeps its outcome.
///
/// # Safety
/// `job` NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn fnx_job_cancel(job: *mut fnx_job) -> fnx_status {
    guard(
        || {
            non_null!(job, "fnx_job_cancel", "job");
            job_core(job, "fnx_job_cancel")?.cancel.store(true, Ordering::Release);
            Ok(())
        },
        || {},
    )
}

/// Blocks until the job has ended and returns its outcome: `FNX_OK` (then
/// `*out_n_generated`, may be NULL, receives the number of generated tokens),
/// `FNX_ERR_CANCELLED` after `fnx_job_cancel`, or the status `fnx_generate`
/// would have returned (`FNX_ERR_ABORTED`, `FNX_ERR_CONTEXT_FULL`, ...), with
/// its message in `fnx_last_error()`. Returns at once, with the same outcome,
/// once the job has ended. Text not yet polled stays for `fnx_job_poll`. It
/// does not hold the job while it waits: another thread may poll, cancel or
/// free it meanwhile (freeing it wakes this call). Called from the job's own
/// thread (the state's abort callback) it would wait for itself:
/// `FNX_ERR_BUSY`.
///
/// # Safety
/// `job` NULL or a live handle; `out_n_generated` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_job_wait(job: *mut fnx_job, out_n_generated: *mut usize) -> fnx_status {
    guard(
        || {
            non_null!(job, "fnx_job_wait", "job");
            let (core, on_its_thread) = with(job, "fnx_job_wait", |j| {
                let own = j.thread.as_ref().is_some_and(|t| t.thread().id() == std::thread::current().id());
                (j.core.clone(), own)
            })?;
            if on_its_thread {
                return Err(fail(
                    FNX_ERR_BUSY,
                    "fnx_job_wait: called on the job's own thread (from the state's abort callback): it would wait \
                     for itself; nothing was done",
                ));
            }
            let mut sh = core.lock();
            while sh.outcome.is_none() {
                sh = core.finished.wait(sh).unwrap_or_else(|e| e.into_inner());
            }
            match sh.outcome.clone() {
                Some((FNX_OK, _)) => {
                    if !out_n_generated.is_null() {
                        // SAFETY: non-NULL and writable per the contract; written only on success.
                        unsafe { *out_n_generated = sh.n_tokens };
                    }
                    Ok(())
                }
                Some((status, msg)) => Err(Failure(status, msg)),
                None => unreachable!("the loop above waits for an outcome"),
            }
        },
        || {},
    )
}

/// Frees a job (NULL is ignored): a job still running is cancelled and
/// waited for (it stops before its next token), so the state is free again
/// when this returns. Text not yet polled is dropped. Called from the job's
/// own thread (the state's abort callback), it cannot wait: the job then
/// ends by itself, cancelled, right after the callback returns.
///
/// # Safety
/// `job` must be NULL or a handle from `fnx_job_start` / `fnx_job_start_text` not yet freed.
#[no_mangle]
pub unsafe extern "C" fn fnx_job_free(job: *mut fnx_job) {
    if job.is_null() {
        return;
    }
    let _ = guard(
        || {
            drop(super::handle::remove(job, "fnx_job_free")?);
            Ok(())
        },
        || {},
    );
}
