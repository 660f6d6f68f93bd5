//! Helpers shared by the end-to-end tests in `tests/`.

use std::path::{Path, PathBuf};

/// `tests/fixtures/models`, the HF-made models with reference outputs.
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join("models")
}

/// Every fixture model directory (those holding a reference.json), sorted by name.
pub fn fixture_models() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .expect("tests/fixtures/models exists (run tests/fixtures/make_fixtures.py)")
        .map(|e| e.expect("readable fixtures dir").path())
        .filter(|p| p.join("reference.json").exists())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no fixture models found");
    dirs
}

/// The `strata` binary built by `cargo build` into the same target directory as the test.
pub fn strata_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("STRATA_BIN") {
        return PathBuf::from(p);
    }
    // target/<profile>/deps/<test-binary> → target/<profile>/strata
    let exe = std::env::current_exe().expect("test executable path");
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join(format!("strata{}", std::env::consts::EXE_SUFFIX)))
        .expect("target directory");
    assert!(
        bin.exists(),
        "{} not found: run `cargo build --bin strata` before the tests",
        bin.display()
    );
    bin
}

/// Reads a fixture's reference.json.
pub fn reference(dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    serde_json::from_str(&text).expect("valid reference.json")
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

pub fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("array of numbers")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}
