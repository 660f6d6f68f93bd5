//! The config tree as an operator meets it: `--config FILE`, then `STRATA_*` variables,
//! then flags, each overriding the one before; bad keys and values named at start-up.

use std::process::Command;

use strata_proto::inference::v1 as pb;
use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_tests::{fixtures_dir, strata_bin, Server};

fn model() -> String {
    fixtures_dir().join("llama_gqa").to_string_lossy().to_string()
}

/// Runs `strata ARGS` with `env`, expecting a start-up failure; returns stderr.
fn fails(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = Command::new(strata_bin())
        .args(args)
        // Tests run side by side: no default ports (a test's own flags override these).
        .envs([("STRATA_LISTEN", "127.0.0.1:0"), ("STRATA_HTTP_LISTEN", "off")])
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .output()
        .expect("run strata");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "strata {args:?} should fail: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

fn write(dir: &tempfile::TempDir, text: &str) -> String {
    let path = dir.path().join("strata.toml");
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().to_string()
}

async fn served_names(server: &Server) -> Vec<String> {
    let mut c = InferenceClient::connect(server.endpoint()).await.unwrap();
    let models = c.list_models(pb::ListModelsRequest {}).await.unwrap().into_inner().models;
    models.into_iter().map(|m| m.name).collect()
}

#[test]
fn bad_keys_and_values_are_named_with_their_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let typo = write(&tmp, "[engine]\nblok_size = 4\n");
    let e = fails(&["serve", "--config", &typo, "--model", &model()], &[]);
    assert!(e.contains("blok_size") && e.contains("strata.toml"), "{e}");

    let zero = write(&tmp, "[engine]\nblock_size = 0\n");
    let e = fails(&["serve", "--config", &zero, "--model", &model()], &[]);
    assert!(e.contains("engine.block_size") && e.contains("--block-size"), "{e}");

    // More KV cache than the machine has: a validation error, not an aborted allocation.
    let e = fails(&["serve", "--model", &model(), "--kv-cache-memory", "100000GiB"], &[]);
    assert!(e.contains("engine.kv_cache_memory") && e.contains("available"), "{e}");

    // An unknown routing policy is named with the flag and the known ones, before anything starts.
    let e = fails(&["serve", "--model", &model(), "--routing-policy", "round-robin"], &[]);
    assert!(
        e.contains("--routing-policy") && e.contains("round-robin") && e.contains("least-outstanding"),
        "{e}"
    );

    let e = fails(&["serve", "--config", "/nonexistent/strata.toml", "--model", &model()], &[]);
    assert!(e.contains("/nonexistent/strata.toml"), "{e}");

    let e = fails(
        &["coordinator", "--etcd", "http://127.0.0.1:1", "--lease-ttl", "2", "--lease-keepalive", "3"],
        &[],
    );
    assert!(e.contains("registry.lease_keepalive_s") && e.contains("--lease-keepalive"), "{e}");
}

#[test]
fn the_environment_overrides_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let ok = write(&tmp, "[engine]\nblock_size = 8\n");
    let e = fails(&["serve", "--config", &ok, "--model", &model()], &[("STRATA_BLOCK_SIZE", "0")]);
    assert!(e.contains("engine.block_size"), "{e}");
    let e = fails(&["serve", "--model", &model()], &[("STRATA_CONFIG", "/nonexistent/env.toml")]);
    assert!(e.contains("/nonexistent/env.toml"), "{e}");
}

#[tokio::test(flavor = "multi_thread")]
async fn flags_override_the_environment_and_the_file_names_the_models() {
    let tmp = tempfile::tempdir().unwrap();
    let text = format!(
        "[engine]\nblock_size = 0\nmax_num_seqs = 4\n\n[serve]\nmodels = [{{ path = {:?}, name = \"from-file\" }}]\n",
        model()
    );
    let file = write(&tmp, &text);
    // The file's block size is invalid, the environment's too; the flag wins over both.
    let server =
        Server::start_with_env(&["--config", &file, "--block-size", "8"], &[("STRATA_BLOCK_SIZE", "0")]);
    assert_eq!(served_names(&server).await, ["from-file"]);
    drop(server);
    // --model replaces the file's model list.
    let server =
        Server::start(&["--config", &file, "--block-size", "8", "--model", &model(), "--name", "flag"]);
    assert_eq!(served_names(&server).await, ["flag"]);
}

/// Static mode is deprecated: both of its commands say so in a structured log field
/// (before anything else can fail), and still refuse an unauthenticated rendezvous that
/// other machines can reach.
#[test]
fn static_mode_is_deprecated_in_its_logs() {
    let model = model();
    let serve = ["serve", "--model", &model, "--tp", "2", "--worker-rendezvous", "192.0.2.1:7000"];
    let worker = ["worker", "--model", &model, "--tp", "2", "--rank", "1", "--rendezvous", "192.0.2.1:7000"];
    for args in [&serve[..], &worker[..]] {
        let stderr = fails(&[args, &["--log-format", "json"]].concat(), &[]);
        assert!(stderr.contains("--rendezvous-secret"), "{stderr}");
        let warned = stderr
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .any(|v| v["level"] == "WARN" && v["fields"]["deprecated"] == "static mode");
        assert!(warned, "strata {args:?} gave no deprecation warning: {stderr}");
    }
}

/// `--max-model-len` is checked at start: at least 1, at most the model's context.
#[test]
fn a_max_model_len_beyond_the_model_is_refused_at_start() {
    let model = model();
    let zero = fails(&["serve", "--model", &model, "--max-model-len", "0"], &[]);
    assert!(zero.contains("engine.max_model_len") && zero.contains("--max-model-len"), "{zero}");
    let long = fails(&["serve", "--model", &model, "--max-model-len", "513"], &[]);
    assert!(long.contains("--max-model-len 513") && long.contains("512"), "{long}");
    let env = fails(&["serve", "--model", &model], &[("STRATA_MAX_MODEL_LEN", "600")]);
    assert!(env.contains("600"), "{env}");
}
