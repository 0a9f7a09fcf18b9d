//! Hides the symbols listed in `legacy.map` from the cdylib's dynamic symbol table.

fn main() {
    let map = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("legacy.map");
    println!("cargo:rerun-if-changed={}", map.display());
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={}", map.display());
}
