//! A temporary directory per test process, and the sweep of the directories
//! of test processes that have ended (the harness never drops statics, so a
//! process's converted fixtures outlive it; without the sweep they piled up
//! in the temp directory, a set per test process and run).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// `<temp>/<prefix>-<pid>`, created. The first call for `prefix` in a
/// process removes `<prefix>-<pid>` (and `<prefix>-<pid>-...`) of processes
/// that no longer run: on Linux those without `/proc/<pid>`; elsewhere none.
pub fn process_dir(prefix: &str) -> PathBuf {
    static SWEPT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut swept = SWEPT.lock().unwrap_or_else(|e| e.into_inner());
    if !swept.iter().any(|p| p == prefix) {
        remove_ended(prefix);
        swept.push(prefix.to_string());
    }
    let dir = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn remove_ended(prefix: &str) {
    if !cfg!(target_os = "linux") {
        return;
    }
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    let lead = format!("{prefix}-");
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let pid = name.strip_prefix(&lead).and_then(|rest| rest.split('-').next()).and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid.filter(|&p| p != std::process::id()) {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                std::fs::remove_dir_all(entry.path()).ok();
            }
        }
    }
}
