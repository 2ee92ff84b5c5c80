//! Where a CPU pass spends its wall time, stage by stage: the figures
//! `flashnext bench` prints for a prompt on the CPU (what a many-core host
//! waits for: a stage whose share grows with the cores is one that does not
//! use them).
//!
//! Spans are opened by the pass's calling thread around the stages it
//! orchestrates (a matrix product, the delta rule of a batch, a copy of the
//! inputs), never inside a parallel region, and never nested, so their
//! times add up to the pass's. Collection is per thread and only while
//! [`collect`] runs with `on`: elsewhere a span is a thread-local read and
//! costs nothing measurable.

use std::cell::RefCell;
use std::time::Instant;

/// A stage's accumulated time: its name, how often it ran, milliseconds.
pub type StageTime = (&'static str, u32, f64);

thread_local! {
    static SPANS: RefCell<Option<Vec<StageTime>>> = const { RefCell::new(None) };
}

/// Times the rest of the scope as stage `name` when a collection is on.
#[must_use = "the span measures until it is dropped"]
pub(crate) struct Span {
    name: &'static str,
    start: Option<Instant>,
}

/// Opens a span named `name` (see [`Span`]).
pub(crate) fn span(name: &'static str) -> Span {
    let on = SPANS.with(|s| s.borrow().is_some());
    Span { name, start: on.then(Instant::now) }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some(start) = self.start {
            let ms = 1e3 * start.elapsed().as_secs_f64();
            SPANS.with(|s| {
                if let Some(v) = s.borrow_mut().as_mut() {
                    add(v, (self.name, 1, ms));
                }
            });
        }
    }
}

/// Adds `time` to its stage's entry in `stages` (a new entry at the end for a new stage).
pub(crate) fn add(stages: &mut Vec<StageTime>, (name, count, ms): StageTime) {
    match stages.iter_mut().find(|s| s.0 == name) {
        Some(s) => {
            s.1 += count;
            s.2 += ms;
        }
        None => stages.push((name, count, ms)),
    }
}

/// Runs `f`, collecting its spans on this thread when `on`; the stages in
/// the order they first ran (empty when off).
pub(crate) fn collect<R>(on: bool, f: impl FnOnce() -> R) -> (R, Vec<StageTime>) {
    if !on {
        return (f(), Vec::new());
    }
    let outer = SPANS.with(|s| s.borrow_mut().replace(Vec::new()));
    let r = f();
    let spans = SPANS.with(|s| std::mem::replace(&mut *s.borrow_mut(), outer)).unwrap_or_default();
    (r, spans)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_count_only_while_collecting() {
        drop(span("before"));
        let ((), stages) = collect(true, || {
            for _ in 0..3 {
                let _s = span("a");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            drop(span("b"));
        });
        assert_eq!(stages.iter().map(|s| (s.0, s.1)).collect::<Vec<_>>(), vec![("a", 3), ("b", 1)]);
        assert!(stages[0].2 >= 3.0, "three sleeps of a millisecond took {} ms", stages[0].2);
        let ((), off) = collect(false, || drop(span("a")));
        assert!(off.is_empty());
    }
}
