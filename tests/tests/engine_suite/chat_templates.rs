//! Chat templates: Strata's renderings (MiniJinja, configured as HF configures Jinja2)
//! equal Python Jinja2's, for eight real-world template styles and a set of
//! conversations (tests/fixtures/chat_templates: the templates are data, the goldens were
//! made by Jinja2 with `make_goldens.py`).

use std::path::PathBuf;

use serde_json::{Map, Value as Json};
use strata_coordinator::request::chat::{ChatInput, ChatTemplate};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/chat_templates")
}

fn read(name: &str) -> Json {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join(name)).unwrap()).unwrap()
}

#[test]
fn renderings_equal_jinja2s() {
    let spec = read("cases.json");
    let goldens = read("goldens.json");
    let goldens = goldens.as_object().unwrap();
    assert!(goldens.len() >= 8, "at least eight template styles");
    let specials: Map<String, Json> = spec["specials"].as_object().unwrap().clone();
    let mut checked = 0;
    for (template_name, results) in goldens {
        let source =
            std::fs::read_to_string(fixtures().join(format!("templates/{template_name}.jinja"))).unwrap();
        let template = ChatTemplate::new(vec![("default".into(), source)], specials.clone()).unwrap();
        for (case_name, expected) in results.as_object().unwrap() {
            let case = &spec["cases"][case_name];
            let input = ChatInput {
                messages: case["messages"].as_array().unwrap().clone(),
                tools: case["tools"]
                    .as_bool()
                    .unwrap_or(false)
                    .then(|| spec["tools"].as_array().unwrap().clone()),
                add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap_or(true),
                extra: spec["extra"].as_object().unwrap().clone(),
            };
            let got = template.render(&input, 1 << 20);
            let at = format!("{template_name}/{case_name}");
            if let Some(want) = expected.get("output") {
                assert_eq!(got.as_deref().map_err(|e| e.to_string()), Ok(want.as_str().unwrap()), "{at}");
            } else if let Some(message) = expected.get("raised") {
                let e = got.expect_err(&at).to_string();
                assert!(e.ends_with(message.as_str().unwrap()), "{at}: {e}");
            } else {
                assert!(got.is_err(), "{at}: Jinja2 failed ({}), we rendered", expected["error"]);
            }
            checked += 1;
        }
    }
    assert!(checked >= 64, "{checked} renderings checked");
}

/// The goldens are what Jinja2 renders today (needs target/pyenv with jinja2, which
/// `make test` installs).
#[test]
fn goldens_are_jinja2s() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join("target/pyenv/bin/python");
    assert!(python.exists(), "{} is missing: run scripts/prerequisites.sh", python.display());
    let out = std::process::Command::new(python)
        .arg(fixtures().join("make_goldens.py"))
        .arg("--check")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
