//! `tools` and `tool_choice` of a chat request: which calls the reply may or must make.
//!
//! `none` reads no calls; `auto` reads them from the model's format (when the model has
//! one); `required` and a named function are enforced by constrained decoding, as vLLM
//! does: `required` constrains the output to a JSON array of `{"name", "parameters"}`
//! objects, one of the tools each (one at most without `parallel_tool_calls`); a named
//! function constrains it to that function's parameters. Either way the calls are read
//! from that JSON, whatever format the model would have written.

use std::borrow::Cow;

use serde_json::{json, Value as Json};
use strata_common::{Constraint, Error, Result};

use super::{json_array_calls, Call, Parsed, ToolFormat};

/// What `tool_choice` asks.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// How one chat request's reply is read for tool calls.
#[derive(Debug, Clone)]
pub struct ToolPlan {
    pub choice: ToolChoice,
    /// The model's own format (for `auto`).
    pub format: Option<ToolFormat>,
    pub parallel: bool,
    /// What enforces `required` or a named function (built once, from the tools'
    /// schemas, which the plan does not keep: a caller's schemas may be megabytes).
    constraint: Option<Constraint>,
}

impl ToolPlan {
    /// The plan for a request's `tools`, `tool_choice` and `parallel_tool_calls`, for a
    /// model whose replies are in `format`; None when nothing is to be read.
    pub fn new(
        tools: Option<&[Json]>,
        choice: Option<&Json>,
        parallel: Option<bool>,
        format: Option<ToolFormat>,
    ) -> Result<Option<Self>> {
        let tools = match tools {
            Some(t) if !t.is_empty() => t,
            _ => {
                return match choice {
                    None | Some(Json::Null) => Ok(None),
                    Some(Json::String(s)) if s == "none" => Ok(None),
                    Some(_) => Err(Error::invalid("tool_choice", "tool_choice needs tools")),
                }
            }
        };
        let tools = tools.iter().enumerate().map(|(i, t)| function(i, t)).collect::<Result<Vec<_>>>()?;
        let choice =
            match choice {
                None | Some(Json::Null) => ToolChoice::Auto,
                Some(Json::String(s)) => match s.as_str() {
                    "none" => ToolChoice::None,
                    "auto" => ToolChoice::Auto,
                    "required" => ToolChoice::Required,
                    other => {
                        return Err(Error::invalid(
                            "tool_choice",
                            format!("tool_choice must be none, auto, required or a function, got {other:?}"),
                        ))
                    }
                },
                Some(Json::Object(o)) => {
                    let name = o.get("function").and_then(|f| f.get("name")).and_then(Json::as_str);
                    match (o.get("type").and_then(Json::as_str), name) {
                        (Some("function"), Some(name)) if tools.iter().any(|t| t.0 == name) => {
                            ToolChoice::Named(name.to_string())
                        }
                        (Some("function"), Some(name)) => {
                            return Err(Error::invalid("tool_choice", format!("no tool is named {name:?}")))
                        }
                        _ => return Err(Error::invalid(
                            "tool_choice",
                            "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": …}}",
                        )),
                    }
                }
                Some(_) => {
                    return Err(Error::invalid("tool_choice", "tool_choice must be a string or an object"))
                }
            };
        if choice == ToolChoice::Auto && format.is_none() {
            return Err(Error::invalid(
                "tool_choice",
                format!(
                    "tool_choice auto needs the model's tool-call format: its chat template names none; start the server with --tool-call-parser ({}), or use required or a named function",
                    ToolFormat::NAMES
                ),
            ));
        }
        if choice == ToolChoice::None {
            return Ok(None);
        }
        let parallel = parallel.unwrap_or(true);
        let constraint = forcing(&choice, &tools, parallel);
        Ok(Some(ToolPlan { choice, format, parallel, constraint }))
    }

    /// The constraint that enforces `required` or a named function.
    pub fn constraint(&self) -> Option<Constraint> {
        self.constraint.clone()
    }

    /// Content and calls of the reply's text (see [`ToolFormat::read`] for `partial`).
    pub fn read(&self, text: &str, partial: bool) -> Parsed {
        let mut parsed = match (&self.choice, self.format) {
            (ToolChoice::Named(name), _) => Parsed {
                content: String::new(),
                calls: vec![Call { name: Some(name.clone()), arguments: text.to_string() }],
            },
            (ToolChoice::Required, _) => {
                Parsed { content: String::new(), calls: json_array_calls(text, partial) }
            }
            (_, Some(format)) => format.read(text, partial),
            (_, None) => Parsed { content: text.to_string(), calls: Vec::new() },
        };
        if !partial && self.choice == ToolChoice::Required {
            // A call cut off by max_tokens before its name is not a call.
            parsed.calls.retain(|c| c.name.is_some());
        }
        if !partial && self.choice == ToolChoice::Auto {
            if parsed.calls.iter().any(|c| c.name.is_none()) {
                // Not the format after all: the reply is text.
                return Parsed { content: text.to_string(), calls: Vec::new() };
            }
            if !self.parallel {
                parsed.calls.truncate(1);
            }
        }
        parsed
    }

    /// OpenAI's finish reason for a reply that ended normally with `calls` calls.
    pub fn finish_reason(&self, calls: usize) -> &'static str {
        match self.choice {
            ToolChoice::Named(_) => "stop",
            _ if calls == 0 => "stop",
            _ => "tool_calls",
        }
    }
}

/// The constraint that enforces `choice` over `tools` (name, parameters' schema).
fn forcing(choice: &ToolChoice, tools: &[(String, Cow<'_, Json>)], parallel: bool) -> Option<Constraint> {
    match choice {
        ToolChoice::Named(name) => {
            let schema = tools.iter().find(|t| &t.0 == name).map(|t| &t.1)?;
            Some(Constraint::JsonSchema(schema.to_string()))
        }
        ToolChoice::Required => {
            let items: Vec<Json> = tools
                .iter()
                .map(|(name, parameters)| {
                    json!({
                        "type": "object",
                        "properties": {"name": {"const": name}, "parameters": parameters},
                        "required": ["name", "parameters"],
                        "additionalProperties": false,
                    })
                })
                .collect();
            let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": items}});
            if !parallel {
                schema["maxItems"] = json!(1);
            }
            Some(Constraint::JsonSchema(schema.to_string()))
        }
        ToolChoice::Auto | ToolChoice::None => None,
    }
}

/// Tool `i`: its name and parameters (an empty object schema when it has none).
fn function(i: usize, tool: &Json) -> Result<(String, Cow<'_, Json>)> {
    let field = format!("tools[{i}]");
    if tool.get("type").and_then(Json::as_str) != Some("function") {
        return Err(Error::invalid(format!("{field}.type"), "only function tools are supported"));
    }
    let f = tool.get("function").ok_or_else(|| Error::invalid(format!("{field}.function"), "is required"))?;
    let name =
        f.get("name").and_then(Json::as_str).filter(|n| !n.is_empty()).ok_or_else(|| {
            Error::invalid(format!("{field}.function.name"), "a non-empty name is required")
        })?;
    let parameters = match f.get("parameters") {
        None | Some(Json::Null) => {
            Cow::Owned(json!({"type": "object", "properties": {}, "additionalProperties": false}))
        }
        Some(p @ Json::Object(_)) => Cow::Borrowed(p),
        Some(_) => {
            return Err(Error::invalid(
                format!("{field}.function.parameters"),
                "must be a JSON schema object",
            ))
        }
    };
    Ok((name.to_string(), parameters))
}
