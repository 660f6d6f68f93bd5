//! A property pass over what callers send: random and adversarial JSON through the HTTP
//! request readers, chat templates and batch input lines — an error or a value, never a
//! panic, and no rendering past its byte limit.

use rand::{Rng, SeedableRng};
use serde_json::{json, Map, Value as Json};

use super::completions::{messages, prompts};
use super::params;
use crate::batch::run::parse_input;
use crate::request::chat::{ChatInput, ChatTemplate};

/// Strings that have broken parsers: empty, huge, control characters, surrogate-ish
/// text, numbers as text, template syntax.
const WORDS: &[&str] = &[
    "",
    "user",
    "assistant",
    "system",
    "tool",
    "{{ x }}",
    "{% for %}",
    "\u{0}",
    "é\u{301}",
    "1e309",
    "-0",
    "NaN",
    "\u{fffd}",
    "<|im_start|>",
];

fn value(rng: &mut impl Rng, depth: usize) -> Json {
    match rng.random_range(0..if depth > 6 { 5 } else { 8 }) {
        0 => Json::Null,
        1 => json!(rng.random::<bool>()),
        2 => json!(rng.random::<i64>() >> rng.random_range(0..64)),
        3 => json!(rng.random::<f64>() * 10f64.powi(rng.random_range(-30..30))),
        4 => json!(WORDS[rng.random_range(0..WORDS.len())].repeat(rng.random_range(0..4))),
        5 => Json::Array((0..rng.random_range(0..5)).map(|_| value(rng, depth + 1)).collect()),
        _ => Json::Object(object(rng, depth + 1)),
    }
}

/// An object mixing the fields the readers look for with random ones, of random types.
fn object(rng: &mut impl Rng, depth: usize) -> Map<String, Json> {
    const KEYS: &[&str] = &[
        "model",
        "prompt",
        "messages",
        "role",
        "content",
        "max_tokens",
        "n",
        "stop",
        "temperature",
        "top_p",
        "logprobs",
        "top_logprobs",
        "seed",
        "stream",
        "echo",
        "prompt_logprobs",
        "tools",
        "best_of",
        "custom_id",
        "method",
        "url",
        "body",
        "type",
        "text",
    ];
    (0..rng.random_range(0..6))
        .map(|_| (KEYS[rng.random_range(0..KEYS.len())].to_string(), value(rng, depth)))
        .collect()
}

#[test]
fn random_bodies_templates_and_batch_lines_never_panic() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let template = ChatTemplate::new(
        vec![(
            "default".into(),
            include_str!("../../../../tests/fixtures/chat_templates/templates/llama31_tools.jinja").into(),
        )],
        Map::new(),
    )
    .unwrap();
    for _ in 0..3000 {
        let f = object(&mut rng, 0);
        let _ = params::common(&f, &["max_tokens"]);
        let _ = params::chat_logprobs(&f);
        let _ = params::completion_logprobs(&f);
        let _ = prompts(&f);
        if let Ok(msgs) = messages(&f) {
            let tools = f.get("tools").and_then(Json::as_array).cloned();
            let input = ChatInput { messages: msgs, tools, add_generation_prompt: true, extra: Map::new() };
            if let Ok(text) = template.render(&input, 1 << 16) {
                assert!(text.len() <= 1 << 16);
            }
        }
        let line = Json::Object(f).to_string();
        let _ = parse_input(format!("{line}\n{line}\r\n").as_bytes(), "/v1/completions");
        let _ = params::object(line.as_bytes());
        let cut = rng.random_range(0..=line.len());
        let _ = params::object(&line.as_bytes()[..cut]);
    }
}
