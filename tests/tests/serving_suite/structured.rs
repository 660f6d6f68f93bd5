//! Structured outputs and tool calls through a real `strata serve`: OpenAI's Python
//! client and the `jsonschema` validator over 120 generated schemas plus hostile ones
//! (tests/python/structured_outputs.py), tools with every tool_choice, streamed and not
//! (tests/python/tool_calls.py), Anthropic's SDK on /v1/messages
//! (tests/python/anthropic_messages.py), OpenAI's client on /v1/responses
//! (tests/python/responses_api.py), and inference.v1's `constraint` over gRPC.

use std::path::Path;

use strata_proto::inference::v1 as pb;
use strata_proto::inference::v1::inference_client::InferenceClient;

use strata_tests::fixtures_dir;

use super::http_api::{chat_model, serve_http};

/// Runs `tests/python/{script}` against the HTTP API at `http`; its stdout.
async fn python(script: &str, http: String) -> String {
    python_with(script, vec![format!("http://{http}/v1"), "m".into(), "unused".into()]).await
}

/// Runs `tests/python/{script}` with `args`; its stdout.
pub(crate) async fn python_with(script: &str, args: Vec<String>) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join("target/pyenv/bin/python");
    assert!(python.exists(), "{} missing: run `make prerequisites`", python.display());
    let script = root.join("tests/python").join(script);
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(&python).arg(&script).args(&args).output().unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

#[tokio::test(flavor = "multi_thread")]
async fn constrained_outputs_validate_for_third_party_clients() {
    let model = chat_model("llama_gqa");
    let (_server, http) = serve_http(model.path(), &[]);
    let stdout = python("structured_outputs.py", http).await;
    assert!(stdout.contains("8 passed"), "{stdout}");
}

/// A ChatML template that lists the tools, writes calls as Hermes does and reasoning
/// in `<think>` blocks (as Qwen3's does).
const TOOL_TEMPLATE: &str = "{% if tools %}{{ '<|im_start|>system\\nTools:' }}{% for t in tools %}{{ ' ' + t['function']['name'] }}{% endfor %}{{ '. Call as <tool_call>{json}</tool_call><|im_end|>\\n' }}{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['reasoning_content'] %}{{ '<think>' + m['reasoning_content'] + '</think>' }}{% endif %}{{ (m['content'] or '') + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

#[tokio::test(flavor = "multi_thread")]
async fn tool_calls_for_openais_client_with_every_tool_choice() {
    // The fixture ships no chat template: --chat-template gives one, which names no
    // tool-call format, so --tool-call-parser says how `auto` reads calls.
    let model = fixtures_dir().join("llama_gqa");
    let template = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(template.path(), TOOL_TEMPLATE.replace("<tool_call>{json}</tool_call>", "a JSON call"))
        .unwrap();
    let flags = ["--chat-template", template.path().to_str().unwrap(), "--tool-call-parser", "hermes"];
    let (_server, http) = serve_http(&model, &flags);
    let stdout = python("tool_calls.py", http).await;
    assert!(stdout.contains("7 passed"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread")]
async fn grpc_callers_constrain_outputs_and_an_empty_constraint_is_refused() {
    let model = chat_model("llama_gqa");
    let (server, _http) = serve_http(model.path(), &[]);
    let mut c = InferenceClient::connect(server.endpoint()).await.unwrap();
    let request = |kind| pb::GenerateRequest {
        model: "m".into(),
        prompt: Some(pb::generate_request::Prompt::Text("Code:".into())),
        max_tokens: Some(30),
        sampling: Some(pb::SamplingParams { temperature: 1.0, seed: Some(3), ..Default::default() }),
        constraint: Some(pb::Constraint { kind }),
        ..Default::default()
    };
    for seed in 0..5u64 {
        let mut r = request(Some(pb::constraint::Kind::Regex("[A-Z]{2}-[0-9]{3}".into())));
        r.sampling.as_mut().unwrap().seed = Some(seed);
        let text = c.generate(r).await.unwrap().into_inner().text;
        let b = text.as_bytes();
        assert!(b.len() == 6 && b[..2].iter().all(u8::is_ascii_uppercase) && b[2] == b'-', "{text}");
        assert!(b[3..].iter().all(u8::is_ascii_digit), "{text}");
    }
    let choices = pb::Choices { choices: vec!["on".into(), "off".into()] };
    let text =
        c.generate(request(Some(pb::constraint::Kind::Choice(choices)))).await.unwrap().into_inner().text;
    assert!(text == "on" || text == "off", "{text}");
    let status = c.generate(request(None)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().contains("constraint"), "{}", status.message());
    let status = c.generate(request(Some(pb::constraint::Kind::Regex("(".into())))).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{}", status.message());
}

/// A copy of a fixture model whose chat template is [`TOOL_TEMPLATE`].
fn tool_model() -> tempfile::TempDir {
    let model = chat_model("llama_gqa");
    let path = model.path().join("tokenizer_config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["chat_template"] = serde_json::json!(TOOL_TEMPLATE);
    std::fs::write(&path, config.to_string()).unwrap();
    model
}

#[tokio::test(flavor = "multi_thread")]
async fn anthropics_sdk_speaks_the_messages_api() {
    let model = tool_model();
    let (_server, http) = serve_http(model.path(), &["--api-key", "sk-anthropic"]);
    let args = vec![format!("http://{http}"), "m".into(), "sk-anthropic".into()];
    let stdout = python_with("anthropic_messages.py", args).await;
    assert!(stdout.contains("4 passed"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread")]
async fn openais_client_speaks_the_responses_api() {
    let model = tool_model();
    let (_server, http) = serve_http(model.path(), &[]);
    let stdout = python("responses_api.py", http).await;
    assert!(stdout.contains("5 passed"), "{stdout}");
}
