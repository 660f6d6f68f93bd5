use serde_json::json;

use super::forced::{ToolChoice, ToolPlan};
use strata_common::{Constraint, Error};

use super::*;

fn call(name: &str, arguments: &str) -> Call {
    Call { name: Some(name.into()), arguments: arguments.into() }
}

/// What each format's text reads as.
fn cases() -> Vec<(ToolFormat, String, Parsed)> {
    let weather = r#"{"city": "Paris", "days": [1, 2]}"#;
    let p = |content: &str, calls: Vec<Call>| Parsed { content: content.into(), calls };
    vec![
        (
            ToolFormat::Hermes,
            format!("Let me check.\n<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {weather}}}\n</tool_call>\n<tool_call>\n{{\"name\": \"now\", \"arguments\": {{}}}}\n</tool_call>"),
            p("Let me check.", vec![call("get_weather", weather), call("now", "{}")]),
        ),
        (ToolFormat::Hermes, "No tools < needed here.".into(), p("No tools < needed here.", vec![])),
        (
            ToolFormat::Llama3Json,
            format!("<|python_tag|>{{\"name\": \"get_weather\", \"parameters\": {weather}}}; {{\"name\": \"now\", \"parameters\": {{}}}}"),
            p("", vec![call("get_weather", weather), call("now", "{}")]),
        ),
        (ToolFormat::Llama3Json, "Plain {answer}.".into(), p("Plain {answer}.", vec![])),
        (
            ToolFormat::Mistral,
            format!("[TOOL_CALLS] [{{\"name\": \"get_weather\", \"arguments\": {weather}}}, {{\"name\": \"now\", \"arguments\": {{}}}}]"),
            p("", vec![call("get_weather", weather), call("now", "{}")]),
        ),
        (
            ToolFormat::Mistral,
            format!("Sure.[TOOL_CALLS]get_weather[ARGS]{weather}[TOOL_CALLS]now[ARGS]{{}}"),
            p("Sure.", vec![call("get_weather", weather), call("now", "{}")]),
        ),
        (
            ToolFormat::DeepseekV3,
            format!("Checking.{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n{weather}\n```{DS_CALL_END}{DS_CALLS_END}"),
            p("Checking.", vec![call("get_weather", weather)]),
        ),
        (
            ToolFormat::DeepseekV3,
            format!("{DS_CALLS_BEGIN}{DS_CALL_BEGIN}get_weather{DS_SEP}{weather}{DS_CALL_END}{DS_CALLS_END}"),
            p("", vec![call("get_weather", weather)]),
        ),
        (
            ToolFormat::Openai,
            format!("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{weather}<|call|>"),
            p("", vec![call("get_weather", weather)]),
        ),
        (
            ToolFormat::Openai,
            "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hello there.<|return|>".into(),
            p("Hello there.", vec![]),
        ),
    ]
}

#[test]
fn every_format_reads_its_calls_and_content() {
    for (format, text, want) in cases() {
        assert_eq!(format.read(&text, false), want, "{format:?}: {text}");
    }
}

/// Joins a stream's deltas back into content and calls.
fn join(deltas: &[Delta]) -> Parsed {
    let mut out = Parsed::default();
    for d in deltas {
        match d {
            Delta::Reasoning(_) => panic!("no reasoning in these"),
            Delta::Content(c) => out.content.push_str(c),
            Delta::Call { index, name, arguments } => {
                if *index == out.calls.len() {
                    assert!(name.is_some(), "a call starts with its name: {d:?}");
                    out.calls.push(Call { name: name.clone(), arguments: String::new() });
                }
                assert!(
                    name.is_none() || out.calls[*index].arguments.is_empty(),
                    "the name comes once, first"
                );
                out.calls[*index].arguments.push_str(arguments);
            }
        }
    }
    out
}

#[test]
fn streamed_at_any_split_the_deltas_join_to_the_whole_reading() {
    for (format, text, want) in cases() {
        let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
        // Every split into two, and char by char.
        for &cut in &bounds {
            let mut s = ToolStream::new(move |t, partial| Reply {
                reasoning: String::new(),
                parsed: format.read(t, partial),
            });
            let mut deltas = s.push(&text[..cut], false);
            deltas.extend(s.push(&text[cut..], true));
            assert_eq!(join(&deltas), want, "{format:?} split at {cut}: {text}");
        }
        let mut s = ToolStream::new(move |t, partial| Reply {
            reasoning: String::new(),
            parsed: format.read(t, partial),
        });
        let mut deltas = Vec::new();
        for w in bounds.windows(2) {
            deltas.extend(s.push(&text[w[0]..w[1]], w[1] == text.len()));
        }
        assert_eq!(join(&deltas), want, "{format:?} char by char: {text}");
        // Arguments really stream: more than one delta carries them for a long call.
        if want.calls.first().is_some_and(|c| c.arguments.len() > 10) {
            let args =
                deltas.iter().filter(|d| matches!(d, Delta::Call { arguments, .. } if !arguments.is_empty()));
            assert!(args.count() > 3, "{format:?}: arguments arrive as generated");
        }
    }
}

#[test]
fn templates_name_their_format() {
    let cases = [
        ("{{ '<tool_call>' }}", Some(ToolFormat::Hermes)),
        ("[TOOL_CALLS]", Some(ToolFormat::Mistral)),
        ("<｜tool▁call▁begin｜>", Some(ToolFormat::DeepseekV3)),
        ("<|channel|>", Some(ToolFormat::Openai)),
        ("<|python_tag|>", Some(ToolFormat::Llama3Json)),
        ("{{ messages }}", None),
    ];
    for (template, want) in cases {
        assert_eq!(ToolFormat::detect(template), want, "{template}");
    }
    for name in ToolFormat::NAMES.split(", ") {
        assert!(ToolFormat::parse(name).is_some(), "{name}");
    }
    assert!(ToolFormat::parse("pythonic").is_none());
}

fn tools() -> Vec<serde_json::Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}),
        json!({"type": "function", "function": {"name": "now"}}),
    ]
}

#[test]
fn tool_choice_is_honoured_or_refused() {
    let t = tools();
    let plan = |choice: serde_json::Value, format| ToolPlan::new(Some(&t), Some(&choice), None, format);
    assert!(plan(json!("none"), None).unwrap().is_none());
    let auto = plan(json!("auto"), Some(ToolFormat::Hermes)).unwrap().unwrap();
    assert!(auto.constraint().is_none());
    let e = plan(json!("auto"), None).unwrap_err().to_string();
    assert!(e.contains("--tool-call-parser"), "{e}");
    let required = plan(json!("required"), None).unwrap().unwrap();
    let Some(Constraint::JsonSchema(schema)) = required.constraint() else { panic!() };
    assert!(schema.contains("get_weather") && schema.contains("\"minItems\":1"), "{schema}");
    let text = r#"[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"now","parameters":{}}]"#;
    let read = required.read(text, false);
    assert_eq!(read.calls, vec![call("get_weather", r#"{"city":"Oslo"}"#), call("now", "{}")]);
    assert_eq!(required.finish_reason(read.calls.len()), "tool_calls");
    let named = plan(json!({"type": "function", "function": {"name": "now"}}), None).unwrap().unwrap();
    assert_eq!(named.choice, ToolChoice::Named("now".into()));
    assert_eq!(named.read("{}", false).calls, vec![call("now", "{}")]);
    for (bad, field) in [
        (json!("sometimes"), "tool_choice"),
        (json!({"type": "function", "function": {"name": "missing"}}), "tool_choice"),
        (json!({"type": "function"}), "tool_choice"),
        (json!(3), "tool_choice"),
    ] {
        let e = plan(bad.clone(), Some(ToolFormat::Hermes)).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument { field: f, .. } if f == field), "{bad}: {e}");
    }
    let no_tools = ToolPlan::new(None, Some(&json!("required")), None, None).unwrap_err();
    assert!(no_tools.to_string().contains("needs tools"), "{no_tools}");
    let bad_tool = [json!({"type": "function", "function": {"parameters": {}}})];
    let e = ToolPlan::new(Some(&bad_tool), None, None, Some(ToolFormat::Hermes)).unwrap_err();
    assert!(e.to_string().contains("tools[0].function.name"), "{e}");
}

#[test]
fn auto_reads_unparseable_calls_as_text_and_parallel_false_keeps_one() {
    let t = tools();
    let plan = ToolPlan::new(Some(&t), None, Some(false), Some(ToolFormat::Hermes)).unwrap().unwrap();
    let broken = "<tool_call>{not json</tool_call>";
    assert_eq!(plan.read(broken, false), Parsed { content: broken.into(), calls: vec![] });
    let two = r#"<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "now", "arguments": {}}</tool_call>"#;
    assert_eq!(plan.read(two, false).calls.len(), 1);
}

#[test]
fn reasoning_is_split_from_the_reply_whole_or_streamed() {
    let cases = [
        ("<think>Plan it.</think>\n\nThe answer.", false, ("Plan it.", "The answer.")),
        ("Plan it.</think>The answer.", true, ("Plan it.", "The answer.")),
        ("No thinking here.", false, ("", "No thinking here.")),
        ("<think>Cut off by length", false, ("Cut off by length", "")),
    ];
    for (text, inside, (reasoning, rest)) in cases {
        assert_eq!(split_think(text, false, inside), (reasoning.to_string(), rest), "{text}");
        let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
        let mut s = ToolStream::new(move |t, partial| {
            let (reasoning, rest) = split_think(t, partial, inside);
            Reply { reasoning, parsed: Parsed { content: rest.to_string(), calls: Vec::new() } }
        });
        let (mut r, mut c) = (String::new(), String::new());
        for w in bounds.windows(2) {
            for d in s.push(&text[w[0]..w[1]], w[1] == text.len()) {
                match d {
                    Delta::Reasoning(x) => r.push_str(&x),
                    Delta::Content(x) => c.push_str(&x),
                    Delta::Call { .. } => panic!("no calls"),
                }
            }
        }
        assert_eq!((r.as_str(), c.as_str()), (reasoning, rest), "{text} streamed");
    }
    let harmony = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi.<|return|>";
    assert_eq!(harmony_reasoning(harmony, false), "Think.");
}
