//! Structured outputs as callers spell them → one [`Constraint`].
//!
//! OpenAI's `response_format` (`text`, `json_object`, `json_schema`), vLLM's older
//! `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` and its newer
//! `structured_outputs` object (`json`, `regex`, `choice`, `grammar`, `json_object`) all
//! become the same constraint, enforced by the engine while it decodes. At most one may
//! be given; anything this server cannot enforce is a 400 naming the field, never a
//! request served unconstrained.

use serde_json::Value as Json;
use strata_common::Constraint;

use super::error::ApiError;
use super::params::Fields;

/// vLLM's names for the ways of constraining, with the kind each gives.
const GUIDED: [(&str, Kind); 4] = [
    ("guided_json", Kind::Json),
    ("guided_regex", Kind::Regex),
    ("guided_choice", Kind::Choice),
    ("guided_grammar", Kind::Grammar),
];
const STRUCTURED: [(&str, Kind); 5] = [
    ("json", Kind::Json),
    ("regex", Kind::Regex),
    ("choice", Kind::Choice),
    ("grammar", Kind::Grammar),
    ("json_object", Kind::JsonObject),
];

#[derive(Debug, Clone, Copy)]
enum Kind {
    Json,
    JsonObject,
    Regex,
    Choice,
    Grammar,
}

/// The request's constraint and the name the caller gave it by (errors from compiling it
/// name that field), or None.
pub fn constraint(f: &Fields) -> Result<Option<(Constraint, String)>, ApiError> {
    let mut found: Vec<(Constraint, String)> = Vec::new();
    if let Some(c) = response_format(f)? {
        found.push((c, "response_format".into()));
    }
    for (name, kind) in GUIDED {
        if let Some(v) = f.get(name).filter(|v| !v.is_null()) {
            found.push((read(name, kind, v)?, name.to_string()));
        }
    }
    if f.get("guided_whitespace_pattern").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::invalid(
            "guided_whitespace_pattern",
            "guided_whitespace_pattern is not supported: constrained JSON is written without whitespace between tokens",
        ));
    }
    match f.get("structured_outputs") {
        None | Some(Json::Null) => {}
        Some(Json::Object(o)) => {
            for key in o.keys() {
                let known = STRUCTURED.iter().any(|(n, _)| n == key)
                    || matches!(
                        key.as_str(),
                        "backend"
                            | "disable_fallback"
                            | "disable_any_whitespace"
                            | "disable_additional_properties"
                    );
                if !known {
                    return Err(ApiError::invalid(
                        format!("structured_outputs.{key}"),
                        format!("structured_outputs.{key} is not supported (json, regex, choice, grammar or json_object)"),
                    ));
                }
            }
            for (name, kind) in STRUCTURED {
                let field = format!("structured_outputs.{name}");
                match (kind, o.get(name)) {
                    (_, None | Some(Json::Null)) | (Kind::JsonObject, Some(Json::Bool(false))) => {}
                    (Kind::JsonObject, Some(Json::Bool(true))) => found.push((Constraint::JsonObject, field)),
                    (Kind::JsonObject, Some(_)) => {
                        return Err(ApiError::invalid(
                            field,
                            "structured_outputs.json_object must be true or false",
                        ))
                    }
                    (kind, Some(v)) => found.push((read(&field, kind, v)?, field)),
                }
            }
        }
        Some(_) => {
            return Err(ApiError::invalid("structured_outputs", "structured_outputs must be an object"))
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(_, n)| n.as_str()).collect();
        return Err(ApiError::invalid(
            found[1].1.clone(),
            format!("give one way of constraining the output, got {}", names.join(" and ")),
        ));
    }
    let Some((c, name)) = found.pop() else { return Ok(None) };
    c.validate().map_err(|e| ApiError::from_domain(e, |_| Some(name.clone())))?;
    Ok(Some((c, name)))
}

/// OpenAI's `response_format`: None for text.
fn response_format(f: &Fields) -> Result<Option<Constraint>, ApiError> {
    let r = match f.get("response_format") {
        None | Some(Json::Null) => return Ok(None),
        Some(Json::Object(r)) => r,
        Some(_) => return Err(ApiError::invalid("response_format", "response_format must be an object")),
    };
    match r.get("type").and_then(Json::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => {
            let Some(Json::Object(spec)) = r.get("json_schema") else {
                return Err(ApiError::invalid(
                    "response_format.json_schema",
                    "response_format.json_schema must be an object with the schema under `schema`",
                ));
            };
            match spec.get("schema") {
                // OpenAI's clients send no schema for "any JSON".
                None | Some(Json::Null) => Ok(Some(Constraint::JsonObject)),
                Some(schema @ (Json::Object(_) | Json::Bool(true))) => {
                    Ok(Some(Constraint::JsonSchema(schema.to_string())))
                }
                Some(_) => Err(ApiError::invalid(
                    "response_format.json_schema.schema",
                    "response_format.json_schema.schema must be a JSON schema object",
                )),
            }
        }
        other => Err(ApiError::invalid(
            "response_format.type",
            format!(
                "response_format.type must be text, json_object or json_schema, got {}",
                other.map_or("nothing".to_string(), |t| format!("{t:?}"))
            ),
        )),
    }
}

fn read(name: &str, kind: Kind, v: &Json) -> Result<Constraint, ApiError> {
    let text = |what: &str| match v {
        Json::String(s) => Ok(s.clone()),
        _ => Err(ApiError::invalid(name, format!("{name} must be {what}"))),
    };
    Ok(match kind {
        Kind::Json => match v {
            Json::Object(_) | Json::Bool(true) => Constraint::JsonSchema(v.to_string()),
            // vLLM takes a schema as JSON text too.
            Json::String(s) => Constraint::JsonSchema(s.clone()),
            _ => return Err(ApiError::invalid(name, format!("{name} must be a JSON schema (an object)"))),
        },
        Kind::JsonObject => Constraint::JsonObject,
        Kind::Regex => Constraint::Regex(text("a regular expression (a string)")?),
        Kind::Grammar => Constraint::Grammar(text("a grammar (a string)")?),
        Kind::Choice => match v {
            Json::Array(items) => Constraint::Choice(
                items
                    .iter()
                    .map(|i| i.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| ApiError::invalid(name, format!("{name} must be an array of strings")))?,
            ),
            _ => return Err(ApiError::invalid(name, format!("{name} must be an array of strings"))),
        },
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn of(v: Json) -> Result<Option<(Constraint, String)>, ApiError> {
        constraint(v.as_object().unwrap())
    }

    #[test]
    fn every_spelling_gives_the_same_constraint() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let want = Constraint::JsonSchema(schema.to_string());
        let bodies = [
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
            json!({"guided_json": schema}),
            json!({"guided_json": schema.to_string()}),
            json!({"structured_outputs": {"json": schema}}),
        ];
        for b in bodies {
            assert_eq!(of(b.clone()).unwrap().unwrap().0, want, "{b}");
        }
        assert_eq!(
            of(json!({"response_format": {"type": "json_object"}})).unwrap().unwrap().0,
            Constraint::JsonObject
        );
        assert_eq!(
            of(json!({"structured_outputs": {"json_object": true}})).unwrap().unwrap().0,
            Constraint::JsonObject
        );
        assert_eq!(
            of(json!({"guided_regex": "a+"})).unwrap().unwrap(),
            (Constraint::Regex("a+".into()), "guided_regex".into())
        );
        let choice = of(json!({"structured_outputs": {"choice": ["a", "b"]}})).unwrap().unwrap();
        assert_eq!(
            choice,
            (Constraint::Choice(vec!["a".into(), "b".into()]), "structured_outputs.choice".into())
        );
        assert_eq!(
            of(json!({"guided_grammar": "start: \"a\""})).unwrap().unwrap().0,
            Constraint::Grammar("start: \"a\"".into())
        );
        assert!(of(json!({"response_format": {"type": "text"}})).unwrap().is_none());
        assert!(of(json!({})).unwrap().is_none());
    }

    #[test]
    fn what_cannot_be_enforced_is_refused_naming_the_field() {
        let cases = [
            (json!({"response_format": {"type": "yaml"}}), "response_format.type"),
            (json!({"response_format": "json"}), "response_format"),
            (json!({"response_format": {"type": "json_schema"}}), "response_format.json_schema"),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}),
                "response_format.json_schema.schema",
            ),
            (json!({"guided_json": 5}), "guided_json"),
            (json!({"guided_json": "{not json"}), "guided_json"),
            (json!({"guided_choice": ["a", 1]}), "guided_choice"),
            (json!({"guided_choice": []}), "guided_choice"),
            (json!({"guided_regex": "a", "guided_choice": ["a"]}), "guided_choice"),
            (json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}), "guided_regex"),
            (json!({"structured_outputs": {"structural_tag": "x"}}), "structured_outputs.structural_tag"),
            (json!({"structured_outputs": 3}), "structured_outputs"),
            (json!({"guided_whitespace_pattern": " "}), "guided_whitespace_pattern"),
        ];
        for (body, field) in cases {
            let e = of(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {}", e.body());
        }
    }
}
