use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

use super::*;

const EOS: u32 = 2;

fn grammars() -> Grammars {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/llama_gqa/tokenizer.json");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    // A model vocabulary larger than the tokenizer's: the extra ids are never allowed.
    Grammars::from_tokenizer_json(&json, 400, &[EOS]).unwrap()
}

/// Decodes under `c` as a random-weight model might: any allowed token, uniformly (the
/// end taken whenever allowed with some chance), for at most `steps` tokens.
fn walk(g: &Grammars, c: &Constraint, seed: u64, steps: usize) -> (String, bool) {
    let mut guide = g.guide(c, &[]).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    for _ in 0..steps {
        let mask = guide.mask().unwrap();
        let allowed: Vec<u32> = (0..400).filter(|&t| mask.allows(t)).collect();
        assert!(allowed.iter().all(|&t| t < 384), "ids the tokenizer does not name are never allowed");
        if mask.allows(EOS) && rng.random_bool(0.5) {
            return (String::from_utf8(g.decode(&out)).unwrap(), true);
        }
        let token = allowed[rng.random_range(0..allowed.len())];
        guide.consume(token).unwrap();
        if token == EOS {
            return (String::from_utf8(g.decode(&out)).unwrap(), true);
        }
        out.push(token);
        if guide.is_stopped() {
            return (String::from_utf8(g.decode(&out)).unwrap(), true);
        }
    }
    (String::from_utf8_lossy(&g.decode(&out)).into_owned(), false)
}

#[test]
fn random_walks_under_a_schema_always_give_valid_json() {
    let g = grammars();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
            "ok": {"type": "boolean"}
        },
        "required": ["name", "age", "tags", "ok"],
        "additionalProperties": false
    });
    let c = Constraint::JsonSchema(schema.to_string());
    for seed in 0..30 {
        let (text, ended) = walk(&g, &c, seed, 200);
        assert!(ended, "seed {seed}: no end within 200 tokens: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
        let o = v.as_object().unwrap();
        assert_eq!(o.len(), 4, "{text}");
        assert!(o["name"].as_str().unwrap().chars().count() <= 6, "{text}");
        assert!((0..=120).contains(&o["age"].as_i64().unwrap()), "{text}");
        assert!(o["tags"].as_array().unwrap().iter().all(|t| t == "a" || t == "b"), "{text}");
        assert!(o["ok"].is_boolean(), "{text}");
        assert_eq!(serde_json::to_string(&v).unwrap(), text, "compact JSON");
    }
}

#[test]
fn json_object_choice_and_regex_hold() {
    let g = grammars();
    for seed in 0..20 {
        let (text, _) = walk(&g, &Constraint::JsonObject, seed, 300);
        assert!(text.starts_with('{'), "{text}");
        let choice = Constraint::Choice(vec!["yes".into(), "no".into(), "a|b (c)".into()]);
        let (text, ended) = walk(&g, &choice, seed, 50);
        assert!(ended && ["yes", "no", "a|b (c)"].contains(&text.as_str()), "{text}");
        let (text, ended) = walk(&g, &Constraint::Regex("[0-9]{3}-[a-c]{2}".into()), seed, 50);
        assert!(ended, "{text}");
        let b = text.as_bytes();
        assert!(b.len() == 6 && b[..3].iter().all(u8::is_ascii_digit) && b[3] == b'-', "{text}");
        assert!(b[4..].iter().all(|c| (b'a'..=b'c').contains(c)), "{text}");
    }
    let lark = Constraint::Grammar("start: \"(\" num (\",\" num)* \")\"\nnum: /[0-9]/".into());
    let (text, ended) = walk(&g, &lark, 1, 60);
    assert!(ended && text.starts_with('(') && text.ends_with(')'), "{text}");
}

#[test]
fn failover_replays_the_tokens_already_generated() {
    let g = grammars();
    let c = Constraint::Choice(vec!["yes".into(), "no".into()]);
    let mut first = g.guide(&c, &[]).unwrap();
    let mask = first.mask().unwrap();
    let token = (0..384).find(|&t| mask.allows(t) && g.decode(&[t]) == b"y").expect("a token for y");
    first.consume(token).unwrap();
    let mut resumed = g.guide(&c, &[token]).unwrap();
    let (a, b) = (first.mask().unwrap(), resumed.mask().unwrap());
    assert!((0..400).all(|t| a.allows(t) == b.allows(t)), "the replayed guide allows what the first does");
    assert!(!(0..400).any(|t| b.allows(t) && g.decode(&[t]).starts_with(b"n")), "no longer `no`");
    let off = (0..384).find(|&t| g.decode(&[t]) == b"x").unwrap();
    let e = g.guide(&c, &[off]).unwrap_err().to_string();
    assert!(e.contains("generated"), "{e}");
}

#[test]
fn hostile_constraints_are_refused_quickly_and_refusals_are_cached() {
    let g = grammars();
    let mut deep = json!({"type": "integer"});
    for _ in 0..200 {
        deep = json!({"type": "array", "items": deep});
    }
    let hostile = [
        Constraint::JsonSchema(deep.to_string()),
        Constraint::JsonSchema(
            json!({"type": "string", "pattern": "(a|aa)*(a|aa)*(a|aa)*b{1000}"}).to_string(),
        ),
        Constraint::Regex("((a?){40}a{40}){30}".into()),
        Constraint::Regex("(x+x+)+y[^z]{100000}".into()),
        Constraint::JsonSchema(
            json!({"type": "object", "oneOf": [{"type": "object"}, {"type": "object"}]}).to_string(),
        ),
        Constraint::JsonSchema(json!({"$ref": "#/$defs/missing"}).to_string()),
        Constraint::Grammar("start: start start | ".into()),
        Constraint::Grammar("start: x x x x x x x x\nx: x x | x x x | \"a\" | \"a\" \"a\" | ".into()),
        Constraint::Grammar("start: s\ns: s s s | s s | \"a\" | \"b\" | \"a\" s \"b\" | ".into()),
        Constraint::Regex("[".into()),
    ];
    for c in &hostile {
        let started = Instant::now();
        let result = g.guide(c, &[]).and_then(|mut guide| guide.mask().map(|_| ()));
        let took = started.elapsed();
        assert!(took < Duration::from_secs(5), "{c:?} took {took:?}");
        if let Err(e) = result {
            assert!(e.to_string().contains(c.field()) || e.to_string().contains("constraint"), "{e}");
            assert_eq!(e.class(), strata_common::ErrorClass::InvalidInput, "the caller's constraint: {e}");
        }
    }
    let refused = &hostile[hostile.len() - 1];
    let e = g.guide(refused, &[]).unwrap_err();
    assert!(e.to_string().contains("guided_regex"), "{e}");
    let before = g.cached();
    let again = Instant::now();
    assert!(g.guide(refused, &[]).is_err());
    assert!(again.elapsed() < Duration::from_millis(50));
    assert_eq!(g.cached(), before, "a refusal is answered from the cache");
}

#[test]
fn masks_allow_every_end_of_sequence_id_where_the_output_may_end() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/llama_gqa/tokenizer.json");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let g = Grammars::from_tokenizer_json(&json, 384, &[EOS, 1]).unwrap();
    let c = Constraint::Choice(vec!["no".into()]);
    let mut guide = g.guide(&c, &[]).unwrap();
    let mask = guide.mask().unwrap();
    assert!(!mask.allows(EOS) && !mask.allows(1), "nothing ends an empty output");
    let n = (0..384).find(|&t| mask.allows(t) && g.decode(&[t]) == b"no");
    let tokens: Vec<u32> = match n {
        Some(t) => vec![t],
        None => {
            let n = (0..384).find(|&t| g.decode(&[t]) == b"n").unwrap();
            let o = (0..384).find(|&t| g.decode(&[t]) == b"o").unwrap();
            vec![n, o]
        }
    };
    for t in tokens {
        guide.consume(t).unwrap();
    }
    let mut logits = vec![0.0f32; 384];
    if !guide.is_stopped() {
        let mask = guide.mask().unwrap();
        assert!(mask.allows(EOS) && mask.allows(1), "both end ids once the choice is complete");
        mask.apply(&mut logits);
        assert_eq!(logits.iter().filter(|l| l.is_finite()).count(), 2);
    }
}

/// An over-ambiguous grammar makes the parser give up partway: that is the caller's
/// constraint's error (a 400 naming `guided_grammar`), never an internal one (a 500).
#[test]
fn a_parser_that_gives_up_is_the_callers_constraint_error() {
    let g = grammars();
    // Every "a" can end or start any number of empty `s`: the parser's rows grow past
    // llguidance's bound after a few hundred tokens.
    let c = Constraint::Grammar("start: s*\ns: s? s? s? \"a\"?".into());
    let mut guide = g.guide(&c, &[]).unwrap();
    let mut gave_up = None;
    for _ in 0..400 {
        let mask = match guide.mask() {
            Ok(m) => m,
            Err(e) => {
                gave_up = Some(e);
                break;
            }
        };
        let a = (0..384).find(|&t| mask.allows(t) && g.decode(&[t]) == b"a").expect("\"a\" is allowed");
        if let Err(e) = guide.consume(a) {
            gave_up = Some(e);
            break;
        }
    }
    let e = gave_up.expect("the parser gives up on this grammar");
    assert_eq!(e.class(), strata_common::ErrorClass::InvalidInput, "{e}");
    assert!(e.to_string().contains("guided_grammar"), "{e}");
}
