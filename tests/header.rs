//! The committed C header must be exactly what cbindgen generates from the
//! current source. Regenerate with `FNX_BLESS_HEADER=1 cargo test --test header`.

use std::path::Path;

#[test]
fn header_is_up_to_date() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(root)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let path = root.join("include/flashnext.h");
    if std::env::var_os("FNX_BLESS_HEADER").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/flashnext.h is stale; regenerate it with FNX_BLESS_HEADER=1 cargo test --test header"
    );
}
