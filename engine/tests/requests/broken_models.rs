//! A model whose numbers are broken (NaN weights) never streams tokens: every sequence
//! fails with an error naming the cause, and the canary fails, so a cluster replaces the
//! replica instead of serving token 0 with NaN logprobs forever.

use std::path::Path;

use crate::fixtures::fixtures_dir;
use strata_common::{SamplingParams, SeqEvent};
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::model::Model;
use strata_engine::{Engine, EngineConfig, EngineHandle, RunnerLimits};

/// Copies a fixture model and overwrites tensor `name` with NaN.
fn poisoned(fixture: &str, name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(fixtures_dir().join(fixture)).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dir.path().join(f.file_name())).unwrap();
    }
    let path = dir.path().join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let t = &header[name];
    let (begin, end) =
        (t["data_offsets"][0].as_u64().unwrap() as usize, t["data_offsets"][1].as_u64().unwrap() as usize);
    let nan: &[u8] = match t["dtype"].as_str().unwrap() {
        "F32" => &f32::NAN.to_le_bytes(),
        "BF16" => &[0xc0, 0x7f],
        "F16" => &[0x00, 0x7e],
        other => panic!("dtype {other}"),
    };
    for chunk in bytes[8 + n + begin..8 + n + end].chunks_mut(nan.len()) {
        chunk.copy_from_slice(nan);
    }
    std::fs::write(&path, bytes).unwrap();
    dir
}

fn handle(dir: &Path) -> EngineHandle {
    let model = Model::load(dir, CpuBackend::new()).unwrap();
    let engine =
        Engine::new(model, &EngineConfig { kv_cache_bytes: 16 << 20, ..Default::default() }).unwrap();
    EngineHandle::spawn(engine, RunnerLimits::default(), "broken").unwrap()
}

#[tokio::test]
async fn nan_weights_fail_every_sequence_and_the_canary() {
    let dir = poisoned("llama_gqa", "model.norm.weight");
    let h = handle(dir.path());
    let e = h.canary().await.unwrap_err();
    assert!(e.to_string().contains("non-finite"), "{e}");
    for params in [
        SamplingParams { max_new_tokens: 4, ignore_eos: true, ..Default::default() },
        SamplingParams {
            max_new_tokens: 4,
            ignore_eos: true,
            temperature: 0.8,
            logprobs: Some(2),
            ..Default::default()
        },
    ] {
        let mut s = h.submit(vec![1, 5, 9], params).unwrap();
        match s.next().await {
            Some(SeqEvent::Failed(e)) => assert!(e.to_string().contains("non-finite logits"), "{e}"),
            other => panic!("a broken model streamed {other:?}"),
        }
    }
    // The same model with finite weights passes.
    let good = handle(&fixtures_dir().join("llama_gqa"));
    good.canary().await.unwrap();
}
