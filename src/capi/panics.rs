//! Where the message of a caught panic goes.
//!
//! Every `fnx_` call runs behind `catch_unwind` (`guard`), so a panic (a bug
//! in flashnext) becomes `FNX_ERR_INTERNAL` with its message in
//! `fnx_last_error()`. The default panic hook would still print the message
//! and a backtrace on the host's standard error when the panic starts, before
//! it is caught. So the first `fnx_` call installs a hook that, for a panic
//! raised on a thread that is inside an `fnx_` call, sends the message and
//! its location to the log callback instead (`FNX_LOG_ERROR`; silent by
//! default; the backtrace at `FNX_LOG_DEBUG` when `RUST_BACKTRACE` asks for
//! one) and remembers the location for `fnx_last_error()`.
//!
//! Every other panic goes to the hook that was installed before (the
//! default one, or the host's own): panics of a Rust host, and panics in the
//! host's callbacks, which run outside the boundary (`outside`). A hook the
//! host installs later replaces this one; flashnext's panics then reach that
//! hook, and are still caught and reported as `FNX_ERR_INTERNAL`. Panics on
//! the worker threads of the compute pool are not inside a call on that
//! thread, so they also go to the previous hook; the call that waits for
//! them still returns `FNX_ERR_INTERNAL`.
//!
//! The library built as `libflashnext.so` carries its own copy of the Rust
//! runtime, whose hook only ever sees the library's own panics; the chaining
//! matters where Rust code links the crate directly.

use super::{log, FNX_LOG_DEBUG, FNX_LOG_ERROR};
use std::cell::{Cell, RefCell};
use std::panic::PanicHookInfo;
use std::sync::Once;

thread_local! {
    /// How many `fnx_` calls this thread is inside (callbacks may nest them).
    static DEPTH: Cell<usize> = const { Cell::new(0) };
    /// Where the last panic caught on this thread was raised.
    static LOCATION: RefCell<Option<String>> = const { RefCell::new(None) };
}

static INSTALL: Once = Once::new();

fn install() {
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if DEPTH.try_with(Cell::get).unwrap_or(0) > 0 {
                report(info);
            } else {
                previous(info);
            }
        }));
    });
}

fn report(info: &PanicHookInfo<'_>) {
    let location = info.location().map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()));
    let message = super::panic_message(info.payload());
    let _ = LOCATION.try_with(|l| *l.borrow_mut() = location.clone());
    let at = location.map(|l| format!(" at {l}")).unwrap_or_default();
    // Host callbacks (the log callback included) run outside the boundary.
    outside(|| {
        log(FNX_LOG_ERROR, || format!("internal error (please report){at}: {message}"));
        let trace = std::backtrace::Backtrace::capture();
        if trace.status() == std::backtrace::BacktraceStatus::Captured {
            log(FNX_LOG_DEBUG, || format!("backtrace of the internal error:\n{trace}"));
        }
    });
}

/// Marks the current thread as inside an `fnx_` call while `f` runs.
pub(crate) fn inside<R>(f: impl FnOnce() -> R) -> R {
    install();
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            let _ = DEPTH.try_with(|d| d.set(d.get().saturating_sub(1)));
        }
    }
    DEPTH.with(|d| d.set(d.get() + 1));
    let _leave = Leave;
    f()
}

/// Runs `f` (a call into the host: a callback) as outside any `fnx_` call,
/// so that the host's panics reach the host's hook.
pub(crate) fn outside<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(usize);
    impl Drop for Restore {
        fn drop(&mut self) {
            let _ = DEPTH.try_with(|d| d.set(self.0));
        }
    }
    let _restore = Restore(DEPTH.try_with(|d| d.replace(0)).unwrap_or(0));
    f()
}

/// Where the last panic caught on this thread was raised (taken once).
pub(crate) fn take_location() -> Option<String> {
    LOCATION.try_with(|l| l.borrow_mut().take()).ok().flatten()
}
