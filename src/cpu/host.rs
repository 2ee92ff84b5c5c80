//! The host: what it is (for reports), its peak memory, and its read
//! bandwidth (the bound for CPU decode).

use rayon::prelude::*;
use serde::Serialize;
use std::time::Instant;

/// A description of the host (from `/proc`; empty fields elsewhere).
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// CPU model name.
    pub cpu: String,
    pub logical_cpus: usize,
    pub mem_total_bytes: u64,
    /// Kernel release.
    pub os: String,
}

fn proc_field(path: &str, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == key).then(|| v.trim().to_string())
    })
}

/// A `/proc` size in kB ("123 kB") as bytes.
fn kb(v: Option<String>) -> Option<u64> {
    v?.split_whitespace()
        .next()?
        .parse::<u64>()
        .ok()
        .map(|k| k * 1024)
}

impl Machine {
    pub fn describe() -> Self {
        Machine {
            cpu: proc_field("/proc/cpuinfo", "model name")
                .unwrap_or_else(|| std::env::consts::ARCH.to_string()),
            logical_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            mem_total_bytes: kb(proc_field("/proc/meminfo", "MemTotal")).unwrap_or(0),
            os: std::fs::read_to_string("/proc/sys/kernel/osrelease").map_or_else(
                |_| std::env::consts::OS.to_string(),
                |s| format!("Linux {}", s.trim()),
            ),
        }
    }
}

/// The process's peak resident set (`VmHWM`), mapped model pages included.
pub fn peak_rss_bytes() -> Option<u64> {
    kb(proc_field("/proc/self/status", "VmHWM"))
}

/// CPU seconds this process has used (user and system, every thread) from
/// `/proc/self/stat`, in clock ticks of 1/100 s; `None` off Linux.
pub fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) closed by ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

/// Bytes of the buffer [`measure_read_bandwidth`] reads: far larger than any cache.
const BANDWIDTH_BUFFER: usize = 1 << 30;

/// Host read bandwidth in GB/s: the best of five parallel sums over a 1 GiB
/// buffer on the current rayon pool (as many threads as decode uses).
pub fn measure_read_bandwidth() -> f64 {
    let buf: Vec<u64> = (0..BANDWIDTH_BUFFER / 8)
        .into_par_iter()
        .map(|i| i as u64)
        .collect();
    let chunk = (buf.len() / (4 * rayon::current_num_threads())).max(1 << 16);
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        let sum: u64 = buf
            .par_chunks(chunk)
            .map(|c| {
                // Four independent lanes keep several loads in flight.
                let mut acc = [0u64; 4];
                for q in c.chunks_exact(4) {
                    for (a, v) in acc.iter_mut().zip(q) {
                        *a = a.wrapping_add(*v);
                    }
                }
                acc.iter().fold(0u64, |s, a| s.wrapping_add(*a))
            })
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(sum);
        best = best.min(t.elapsed().as_secs_f64());
    }
    BANDWIDTH_BUFFER as f64 / best / 1e9
}
