//! `/v1/embeddings` through a real `strata serve`, with OpenAI's Python client, against the
//! vectors HF transformers computes on the same fixture (tests/python/embeddings.py); the
//! model's pooling read from its sentence-transformers files.

use strata_tests::fixtures_dir;

use super::http_api::serve_http;
use super::structured::python_with;

const KEY: &str = "sk-embed";

#[tokio::test(flavor = "multi_thread")]
async fn openais_client_gets_hf_transformers_embeddings() {
    // A copy of the fixture that says, as sentence-transformers does, mean then normalize.
    let model = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixtures_dir().join("llama_gqa")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), model.path().join(entry.file_name())).unwrap();
    }
    let modules = r#"[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]"#;
    std::fs::write(model.path().join("modules.json"), modules).unwrap();
    std::fs::create_dir(model.path().join("1_Pooling")).unwrap();
    let pooling = r#"{"word_embedding_dimension": 64, "pooling_mode_mean_tokens": true}"#;
    std::fs::write(model.path().join("1_Pooling/config.json"), pooling).unwrap();
    let (_server, http) = serve_http(model.path(), &["--api-key", KEY]);
    let reference = fixtures_dir().join("../embeddings/reference.json");
    let args =
        [&format!("http://{http}/v1"), "m", KEY, &reference.display().to_string(), "llama_gqa", "mean"];
    let stdout = python_with("embeddings.py", args.iter().map(|s| s.to_string()).collect()).await;
    assert!(stdout.contains("4 passed"), "{stdout}");
}
