//! What a constrained request's output must match: a JSON schema, any JSON object, a
//! regular expression, one of a list of strings, or a grammar.
//!
//! The same value travels from the front end (OpenAI's `response_format`, vLLM's
//! `guided_*` and `structured_outputs`, inference.v1's `constraint`) through worker.v1 to
//! the engine, which compiles it against the model's tokenizer and masks the logits each
//! step (engine `guide`). Here it is only data with bounds: a caller's spec is checked for
//! size before anything compiles it, so a huge one is refused by its length, not by the
//! time it takes.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Most bytes in a constraint's text (a schema, a regex, a grammar, all choices together).
pub const MAX_CONSTRAINT_BYTES: usize = 64 * 1024;
/// Most strings `Choice` may list.
pub const MAX_CHOICES: usize = 1024;

/// What the output must match.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Constraint {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON value valid under this JSON schema (the schema's text).
    JsonSchema(String),
    /// Text the regular expression matches whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A context-free grammar in Lark syntax (llguidance's dialect, which reads most of
    /// Lark and the GBNF-like `::=` rules as well).
    Grammar(String),
}

impl Constraint {
    /// The field a caller names it by, for errors.
    pub fn field(&self) -> &'static str {
        match self {
            Constraint::JsonObject | Constraint::JsonSchema(_) => "response_format",
            Constraint::Regex(_) => "guided_regex",
            Constraint::Choice(_) => "guided_choice",
            Constraint::Grammar(_) => "guided_grammar",
        }
    }

    /// Bytes of its text.
    pub fn len(&self) -> usize {
        match self {
            Constraint::JsonObject => 0,
            Constraint::JsonSchema(s) | Constraint::Regex(s) | Constraint::Grammar(s) => s.len(),
            Constraint::Choice(c) => c.iter().map(String::len).sum(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0 && !matches!(self, Constraint::JsonObject)
    }

    /// Checks the bounds and the shape that do not need the tokenizer: size, a schema that
    /// is a JSON object (or `true`), a non-empty choice list.
    pub fn validate(&self) -> Result<()> {
        let field = self.field();
        if self.len() > MAX_CONSTRAINT_BYTES {
            return Err(Error::invalid(
                field,
                format!("the constraint is {} bytes; at most {MAX_CONSTRAINT_BYTES}", self.len()),
            ));
        }
        match self {
            Constraint::JsonObject => Ok(()),
            Constraint::JsonSchema(s) => match serde_json::from_str::<serde_json::Value>(s) {
                Ok(serde_json::Value::Object(_)) | Ok(serde_json::Value::Bool(true)) => Ok(()),
                Ok(_) => Err(Error::invalid(field, "a JSON schema must be a JSON object")),
                Err(e) => Err(Error::invalid(field, format!("the JSON schema is not valid JSON: {e}"))),
            },
            Constraint::Regex(s) | Constraint::Grammar(s) if s.trim().is_empty() => {
                Err(Error::invalid(field, "must not be empty"))
            }
            Constraint::Regex(_) | Constraint::Grammar(_) => Ok(()),
            Constraint::Choice(c) if c.is_empty() => {
                Err(Error::invalid(field, "must list at least one string"))
            }
            Constraint::Choice(c) if c.len() > MAX_CHOICES => {
                Err(Error::invalid(field, format!("at most {MAX_CHOICES} choices, got {}", c.len())))
            }
            Constraint::Choice(_) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_and_shapes_are_checked_before_compiling() {
        let ok = [
            Constraint::JsonObject,
            Constraint::JsonSchema(r#"{"type": "integer"}"#.into()),
            Constraint::JsonSchema("true".into()),
            Constraint::Regex("[a-z]+".into()),
            Constraint::Choice(vec!["yes".into(), "no".into()]),
            Constraint::Grammar("start: \"a\"+".into()),
        ];
        for c in ok {
            c.validate().unwrap_or_else(|e| panic!("{c:?}: {e}"));
        }
        let bad = [
            (Constraint::JsonSchema("[1]".into()), "JSON object"),
            (Constraint::JsonSchema("{".into()), "not valid JSON"),
            (Constraint::Regex(" ".into()), "empty"),
            (Constraint::Choice(Vec::new()), "at least one"),
            (Constraint::Choice(vec!["x".into(); MAX_CHOICES + 1]), "at most"),
            (Constraint::Grammar("x".repeat(MAX_CONSTRAINT_BYTES + 1)), "bytes"),
        ];
        for (c, why) in bad {
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(c.field()), "{c:?}: {e}");
        }
    }
}
