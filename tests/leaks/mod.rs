//! Leak checks: a counting global allocator and a way to run one test alone
//! in a child process, so no other test's allocations are counted.
//!
//! A test file that declares `mod leaks;` counts every allocation it makes;
//! only the leak checks read the count.

use std::alloc::{GlobalAlloc, Layout, System};
use std::process::Command;
use std::sync::atomic::{AtomicIsize, Ordering};

struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator; only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Worker threads of the CPU's pool in the child (see [`growth`]).
const CHILD_THREADS: &str = "4";

/// In the test process: runs the test `name` alone in a child process and
/// asserts it passed, then returns false. In that child: returns true, and the
/// caller runs the checks.
pub fn in_child(name: &str) -> bool {
    if std::env::var_os("FNX_LEAK_CHILD").is_some() {
        return true;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--test-threads=1", "--nocapture"])
        .env("FNX_LEAK_CHILD", "1")
        .env("RAYON_NUM_THREADS", CHILD_THREADS)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "leak check failed:\n{text}");
    false
}

/// Bytes still allocated after `n` runs of `op`, in the quietest of a few
/// windows of `n` runs (after one run to warm caches up).
///
/// The CPU's matrix kernels keep a scratch tile per pool worker, made the
/// first time that worker takes a piece of work, and which workers take
/// pieces is up to the scheduler: a worker may first be used in any window.
/// Those fills are bounded by the (small, fixed: [`in_child`]) pool, while a
/// leak of every run shows in every window, so the smallest window's growth
/// is the leak.
pub fn growth(n: usize, mut op: impl FnMut()) -> isize {
    op();
    let mut least = isize::MAX;
    for _ in 0..8 {
        let before = LIVE.load(Ordering::SeqCst);
        for _ in 0..n {
            op();
        }
        least = least.min(LIVE.load(Ordering::SeqCst) - before);
        if least == 0 {
            break;
        }
    }
    least
}

/// The counter sees leaks at all: a leak in every run is counted in full.
pub fn check_counter() {
    let g = growth(3, || {
        std::hint::black_box(Box::leak(std::hint::black_box(Box::new([0u8; 100]))));
    });
    assert!(g >= 300, "a 100-byte leak per run counted as {g} bytes over 3 runs");
}
