//! What a request gets from the engine, whatever else runs: continuous batching,
//! preemption and the prefix cache never change outputs; a caller that does not read is
//! bounded; a model with broken numbers fails its sequences and its canary; a request
//! longer than the context is refused on arrival; constrained outputs match their
//! constraints; prompt logprobs are teacher forcing's; embeddings are HF's pooled hidden
//! states.
//!
//! One test binary of several modules, on the fixture models HF transformers made.

#[path = "requests/backpressure.rs"]
mod backpressure;
#[path = "requests/batching.rs"]
mod batching;
#[path = "requests/broken_models.rs"]
mod broken_models;
#[path = "requests/constrained.rs"]
mod constrained;
#[path = "requests/context.rs"]
mod context;
#[path = "requests/embeddings.rs"]
mod embeddings;
#[path = "requests/prompt_logprobs.rs"]
mod prompt_logprobs;

/// The fixture models' files and references (tests/fixtures/models).
mod fixtures {
    use std::path::{Path, PathBuf};

    pub fn fixtures_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models")
    }

    pub fn reference(dir: &Path) -> serde_json::Value {
        let path = dir.join("reference.json");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    pub fn ids(v: &serde_json::Value) -> Vec<u32> {
        v.as_array().expect("array of ids").iter().map(|x| x.as_u64().expect("id") as u32).collect()
    }
}
