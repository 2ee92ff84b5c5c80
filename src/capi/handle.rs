//! The registry of live handles.
//!
//! A handle given to C is not the object's address but a number the
//! process never gives out twice, mapped here to the object. So a freed
//! handle is recognised even when its object's memory now holds a new
//! object (which has another number), a handle of another kind or a stray
//! pointer is recognised without reading through it, and nothing is ever
//! read through a handle the registry does not know.
//!
//! The registry also marks a handle busy while a call uses it: states,
//! samplers and detokenizers are taken exclusively ([`lease`]) for the whole
//! call, so a callback of that call (a token or abort callback) or another
//! thread that uses the same handle meanwhile gets `FNX_ERR_BUSY` instead of
//! a second mutable reference. Models are shared ([`get`]). A generation job
//! (`fnx_job_start`) holds its state and sampler for as long as it runs
//! ([`Lease::hold_for_job`]), and calls meanwhile are told so.

use super::{fail, Failure, FNX_ERR_BUSY, FNX_ERR_INVALID_HANDLE};
use std::any::TypeId;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// A type handed to C as a handle.
pub(crate) trait Handle: 'static {
    /// The C type name, for messages.
    const NAME: &'static str;
}

impl Handle for super::fnx_model {
    const NAME: &'static str = "fnx_model";
}
impl Handle for super::fnx_state {
    const NAME: &'static str = "fnx_state";
}
impl Handle for super::fnx_sampler {
    const NAME: &'static str = "fnx_sampler";
}
impl Handle for super::fnx_detokenizer {
    const NAME: &'static str = "fnx_detokenizer";
}
impl Handle for super::fnx_job {
    const NAME: &'static str = "fnx_job";
}
impl Handle for super::fnx_chat_parser {
    const NAME: &'static str = "fnx_chat_parser";
}

/// Who holds a handle.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Busy {
    Free,
    /// A call in progress (and its callbacks).
    Call,
    /// A generation job running on its own thread.
    Job,
}

struct Entry {
    kind: TypeId,
    /// The object, from `Box::into_raw`.
    object: usize,
    busy: Busy,
}

static LIVE: Mutex<BTreeMap<usize, Entry>> = Mutex::new(BTreeMap::new());
/// The next handle number (handles are multiples of 16, so they look like
/// aligned pointers and are never NULL).
static NEXT: AtomicUsize = AtomicUsize::new(1);

fn live() -> MutexGuard<'static, BTreeMap<usize, Entry>> {
    // The map is consistent after every statement, so a panic elsewhere
    // while it was locked does not make it unusable.
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

fn not_live<T: Handle>(func: &str) -> Failure {
    fail(FNX_ERR_INVALID_HANDLE, format!("{func}: not a live {} handle (freed, or of another kind)", T::NAME))
}

fn busy<T: Handle>(func: &str, by: Busy) -> Failure {
    if by == Busy::Job {
        return fail(
            FNX_ERR_BUSY,
            format!(
                "{func}: the {} is in use by a running generation job (fnx_job_start); wait for it, cancel it \
                 or free it first; nothing was done",
                T::NAME
            ),
        );
    }
    fail(
        FNX_ERR_BUSY,
        format!(
            "{func}: the {} is in use by a call in progress (a callback of that call, or another thread); \
             nothing was done",
            T::NAME
        ),
    )
}

/// Looks `h` up as a `T`; with `take`, marks it busy.
fn find<T: Handle>(h: *const T, func: &str, take: bool) -> Result<*mut T, Failure> {
    let mut map = live();
    let e = map.get_mut(&(h as usize)).filter(|e| e.kind == TypeId::of::<T>()).ok_or_else(|| not_live::<T>(func))?;
    if e.busy != Busy::Free {
        return Err(busy::<T>(func, e.busy));
    }
    if take {
        e.busy = Busy::Call;
    }
    Ok(e.object as *mut T)
}

/// Registers `object` and returns its handle (never one given out before).
pub(crate) fn insert<T: Handle>(object: Box<T>) -> *mut T {
    let id = NEXT.fetch_add(1, Ordering::Relaxed).wrapping_mul(16);
    let entry = Entry { kind: TypeId::of::<T>(), object: Box::into_raw(object) as usize, busy: Busy::Free };
    live().insert(id, entry);
    id as *mut T
}

/// Borrows the object behind a shared handle (a model) for the call.
/// Refused for a handle that is not a live `T`.
pub(crate) fn get<'a, T: Handle>(h: *const T, func: &str) -> Result<&'a T, Failure> {
    // SAFETY: the registry holds the object until `remove`, which callers
    // must not race with a use of the same handle (the documented contract).
    find(h, func, false).map(|p| unsafe { &*p })
}

/// The object behind an exclusive handle, held busy until dropped.
pub(crate) struct Lease<T: Handle> {
    handle: usize,
    object: *mut T,
}

impl<T: Handle> std::ops::Deref for Lease<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the object stays registered (and allocated) while busy:
        // `remove` refuses busy handles.
        unsafe { &*self.object }
    }
}

impl<T: Handle> std::ops::DerefMut for Lease<T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; the lease is the only reference, since a
        // second lease of a busy handle is refused.
        unsafe { &mut *self.object }
    }
}

impl<T: Handle> Lease<T> {
    /// Marks the handle as held by a generation job (until the lease is
    /// dropped), so that calls meanwhile say so.
    pub(crate) fn hold_for_job(&self) {
        if let Some(e) = live().get_mut(&self.handle) {
            e.busy = Busy::Job;
        }
    }
}

impl<T: Handle> Drop for Lease<T> {
    fn drop(&mut self) {
        if let Some(e) = live().get_mut(&self.handle) {
            e.busy = Busy::Free;
        }
    }
}

/// Takes the object behind `h` for the call: refused for a handle that is
/// not a live `T` (`FNX_ERR_INVALID_HANDLE`) or that is busy (`FNX_ERR_BUSY`).
pub(crate) fn lease<T: Handle>(h: *const T, func: &str) -> Result<Lease<T>, Failure> {
    let object = find(h, func, true)?;
    Ok(Lease { handle: h as usize, object })
}

/// Runs `f` on the object behind `h` with the registry locked, without
/// marking it busy: for handles whose calls only take shared parts out of
/// the object (a job's core), so that calls from several threads at once
/// never see each other as busy, and a concurrent `remove` waits for `f`.
/// `f` must be short and must not use the registry.
pub(crate) fn with<T: Handle, R>(h: *const T, func: &str, f: impl FnOnce(&T) -> R) -> Result<R, Failure> {
    let map = live();
    let e = map.get(&(h as usize)).filter(|e| e.kind == TypeId::of::<T>()).ok_or_else(|| not_live::<T>(func))?;
    if e.busy != Busy::Free {
        return Err(busy::<T>(func, e.busy));
    }
    // SAFETY: a registered object stays allocated until `remove`, which takes the lock held here.
    Ok(f(unsafe { &*(e.object as *const T) }))
}

/// Unregisters `h` and gives its object back, to be dropped. Refused for a
/// handle that is not a live `T` or that is busy: nothing is freed then.
pub(crate) fn remove<T: Handle>(h: *const T, func: &str) -> Result<Box<T>, Failure> {
    let mut map = live();
    match map.get(&(h as usize)) {
        Some(e) if e.kind == TypeId::of::<T>() && e.busy != Busy::Free => Err(busy::<T>(func, e.busy)),
        Some(e) if e.kind == TypeId::of::<T>() => {
            let object = e.object as *mut T;
            map.remove(&(h as usize));
            // SAFETY: made by `Box::into_raw` in `insert`, and unregistered
            // just now, so it is given back once.
            Ok(unsafe { Box::from_raw(object) })
        }
        _ => Err(not_live::<T>(func)),
    }
}
