//! `scripts/build-shaders.sh`: compiles every shader module with `glslc` into
//! `shaders/spirv/` and rewrites its manifest (see `build/shaders.rs`).
//! Usage: `regenerate REPOSITORY_ROOT` (`GLSLC` names another glslc binary).

#[path = "shaders.rs"]
#[allow(dead_code)]
mod shaders;

use std::path::PathBuf;

fn main() {
    let root = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| ".".into()));
    let glslc = std::env::var("GLSLC").unwrap_or_else(|_| "glslc".into());
    let src = root.join("shaders");
    match shaders::regenerate(&glslc, &src, &src.join("spirv")) {
        Ok(m) => println!("shaders/spirv/: {} modules compiled by {}", m.modules.len(), m.glslc),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
