//! Chat templates: a model's own Jinja template turns a conversation into its prompt text.
//!
//! The template comes from the model directory (`chat_template.jinja`, or `chat_template`
//! in `tokenizer_config.json`: a string, or a list of named templates of which `tool_use`
//! serves requests with tools and `default` the rest). It is rendered as HF transformers
//! renders it with Jinja2: `trim_blocks` and `lstrip_blocks`, loop controls, Python's string
//! and dict methods, `tojson` as Python's `json.dumps` writes it (no HTML escaping, `", "`
//! and `": "` separators, `indent` and `sort_keys`), `raise_exception(message)` (the
//! request's error) and `strftime_now(format)`. The template sees `messages`, `tools`,
//! `add_generation_prompt` and the tokenizer's special tokens (`bos_token`, `eos_token`,
//! `unk_token`, `pad_token`), plus whatever extra variables the caller passes.
//!
//! A rendered prompt already holds the special tokens it needs: it is tokenized without
//! the tokenizer's own (see [`Prompt::Chat`](crate::frontend::admission::Prompt::Chat)).
//!
//! **Bounds.** A caller's messages and tools are data a template may multiply (`tojson`
//! with `indent` writes a deeply nested value hundreds of times its size): a rendering
//! stops with the request's error once its output, or any one `tojson`, passes the
//! byte limit it is given (what the model's context could hold as text), inputs nest at
//! most [`MAX_DEPTH`] deep, and fuel bounds the instructions a template runs.

use std::cell::Cell;
use std::path::Path;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};
use serde_json::{Map, Value as Json};
use strata_common::files::{read_bounded, read_text, MAX_JSON_FILE};
use strata_common::{Error, Result};

/// How much work one rendering may do (MiniJinja's fuel: about one unit per instruction),
/// so a template cannot loop without end on a caller's messages.
const FUEL: u64 = 50_000_000;

/// Deepest nesting of arrays and objects in a rendering's inputs.
pub const MAX_DEPTH: usize = 64;

thread_local! {
    /// Bytes `tojson` may still write in the rendering running on this thread; None once
    /// one went past them.
    static TOJSON_BUDGET: Cell<Option<usize>> = const { Cell::new(Some(usize::MAX)) };
}

/// The rendering's output, refusing bytes past `max`.
struct Bounded<'a> {
    out: Vec<u8>,
    max: usize,
    over: bool,
    /// Told the output so far after each write; its error stops the rendering.
    watch: &'a mut dyn FnMut(&[u8], bool) -> Result<()>,
    /// The watcher's error, once it gave one.
    stopped: Option<Error>,
}

impl std::io::Write for Bounded<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > self.max {
            self.over = true;
            return Err(std::io::Error::other("the rendered prompt is too long"));
        }
        self.out.extend_from_slice(buf);
        if let Err(e) = (self.watch)(&self.out, false) {
            self.stopped = Some(e);
            return Err(std::io::Error::other("the rendered prompt is too long"));
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// How deep `v` nests (a scalar is 0).
fn depth(v: &Json) -> usize {
    match v {
        Json::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        Json::Object(map) => 1 + map.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// The special tokens a tokenizer config names, as templates see them.
fn specials_of(config: &Json) -> Map<String, Json> {
    let mut specials = Map::new();
    for name in ["bos_token", "eos_token", "unk_token", "pad_token"] {
        let token = match config.get(name) {
            Some(Json::String(s)) => Some(s.clone()),
            // An AddedToken written out: {"content": "<s>", ...}.
            Some(Json::Object(o)) => o.get("content").and_then(Json::as_str).map(str::to_string),
            _ => None,
        };
        if let Some(t) = token {
            specials.insert(name.into(), Json::String(t));
        }
    }
    specials
}

/// A model's chat template, ready to render.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Whether a separate `tool_use` template exists.
    has_tool_use: bool,
    specials: Map<String, Json>,
    /// The tool-call format its templates write, judged from their markers.
    tool_format: Option<crate::request::tools::ToolFormat>,
    /// Whether its templates write reasoning in `<think>` blocks, or gpt-oss channels.
    writes_think: bool,
    harmony: bool,
    /// Set by the operator (`--chat-template`, a deployment's), not the model's own: its
    /// text is the operator's and is not shown to callers.
    operators: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("has_tool_use", &self.has_tool_use).finish()
    }
}

/// What a conversation is rendered from.
#[derive(Debug, Clone, Default)]
pub struct ChatInput {
    /// The messages, as JSON objects (`role`, `content`, and whatever else the caller sent:
    /// `name`, `tool_calls`, `tool_call_id`).
    pub messages: Vec<Json>,
    pub tools: Option<Vec<Json>>,
    pub add_generation_prompt: bool,
    /// More variables for the template (`chat_template_kwargs`).
    pub extra: Map<String, Json>,
}

/// What the operator sets over a model's own chat files: a template (`--chat-template`)
/// and the format tool calls are read in (`--tool-call-parser`).
#[derive(Debug, Clone, Default)]
pub struct ChatSettings {
    /// A Jinja template's source, used instead of the model's.
    pub template: Option<String>,
    pub tool_format: Option<crate::request::tools::ToolFormat>,
}

impl ChatTemplate {
    /// The template of the model in `dir` under `settings`, or None when it has none.
    pub fn from_dir_with(dir: &Path, settings: &ChatSettings) -> Result<Option<Self>> {
        let mut t = match &settings.template {
            Some(source) => {
                let specials = Self::specials(dir)?;
                let mut t = Self::new(vec![("default".into(), source.clone())], specials)
                    .map_err(|e| Error::invalid("chat_template", format!("--chat-template: {e}")))?;
                t.operators = true;
                Some(t)
            }
            None => Self::from_dir(dir)?,
        };
        if let (Some(t), Some(format)) = (t.as_mut(), settings.tool_format) {
            t.tool_format = Some(format);
        }
        Ok(t)
    }

    /// `bos_token`, `eos_token`, … of the model in `dir`, for templates.
    pub(crate) fn specials(dir: &Path) -> Result<Map<String, Json>> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Json = match config_path.exists() {
            true => serde_json::from_slice(&read_bounded(&config_path, MAX_JSON_FILE)?)
                .map_err(|e| Error::model_file(&config_path, format!("not valid JSON: {e}")))?,
            false => Json::Object(Map::new()),
        };
        Ok(specials_of(&config))
    }

    /// The template of the model in `dir`, or None when it has none.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Json = match config_path.exists() {
            true => serde_json::from_slice(&read_bounded(&config_path, MAX_JSON_FILE)?)
                .map_err(|e| Error::model_file(&config_path, format!("not valid JSON: {e}")))?,
            false => Json::Object(Map::new()),
        };
        let jinja_path = dir.join("chat_template.jinja");
        let mut templates: Vec<(String, String)> = Vec::new();
        if jinja_path.exists() {
            templates.push(("default".into(), read_text(&jinja_path, MAX_JSON_FILE)?));
        } else {
            match config.get("chat_template") {
                None | Some(Json::Null) => {}
                Some(Json::String(t)) => templates.push(("default".into(), t.clone())),
                Some(Json::Array(list)) => {
                    for item in list {
                        let (Some(name), Some(t)) = (
                            item.get("name").and_then(Json::as_str),
                            item.get("template").and_then(Json::as_str),
                        ) else {
                            return Err(Error::model_file(
                                &config_path,
                                "chat_template: each entry of the list needs a name and a template",
                            ));
                        };
                        templates.push((name.to_string(), t.to_string()));
                    }
                }
                Some(_) => {
                    return Err(Error::model_file(&config_path, "chat_template: a string or a list"));
                }
            }
        }
        if templates.is_empty() {
            return Ok(None);
        }
        let specials = specials_of(&config);
        let source = if jinja_path.exists() { jinja_path } else { config_path };
        let t = Self::new(templates, specials).map_err(|e| Error::model_file(&source, e.to_string()))?;
        Ok(Some(t))
    }

    /// A template set from `(name, source)` pairs (`default`, optionally `tool_use`).
    pub fn new(templates: Vec<(String, String)>, specials: Map<String, Json>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(FUEL));
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        let mut has_default = false;
        let mut has_tool_use = false;
        let tool_format =
            templates.iter().find_map(|(_, source)| crate::request::tools::ToolFormat::detect(source));
        let writes_think = templates.iter().any(|(_, source)| source.contains("</think>"));
        let harmony = templates.iter().any(|(_, source)| source.contains("<|channel|>"));
        for (name, source) in templates {
            has_default |= name == "default";
            has_tool_use |= name == "tool_use";
            env.add_template_owned(name.clone(), source)
                .map_err(|e| Error::Unsupported(format!("chat template {name:?}: {}", describe(&e))))?;
        }
        if !has_default {
            return Err(Error::Unsupported("chat_template: no template named \"default\"".into()));
        }
        Ok(ChatTemplate { env, has_tool_use, specials, tool_format, writes_think, harmony, operators: false })
    }

    /// How replies to `prompt` (rendered by this template) carry reasoning, if they do.
    pub fn reasoning(&self, prompt: &str) -> Option<crate::request::reply::Reasoning> {
        crate::request::reply::Reasoning::detect(self.writes_think, self.harmony, prompt)
    }

    /// Whether the operator set it (`--chat-template`, a deployment's) rather than the
    /// model's files: such a template is not shown to callers.
    pub fn is_operators(&self) -> bool {
        self.operators
    }

    /// The source of the default template (what vLLM's `/tokenizer_info` reports).
    pub fn source(&self) -> Option<String> {
        self.env.get_template("default").ok().map(|t| t.source().to_string())
    }

    /// The tool-call format the template writes calls in, if it names one.
    pub fn tool_format(&self) -> Option<crate::request::tools::ToolFormat> {
        self.tool_format
    }

    /// The prompt text of a conversation, at most `max_bytes` long. A template's
    /// `raise_exception`, any rendering error, and an output (or one `tojson`) past
    /// `max_bytes` become the request's error, naming `messages`.
    pub fn render(&self, input: &ChatInput, max_bytes: usize) -> Result<String> {
        self.render_watched(input, max_bytes, &mut |_, _| Ok(()))
    }

    /// [`render`](Self::render), telling `watch` the output so far after each write (and
    /// once more at the end, `true`): its error, such as a token count past the context
    /// ([`crate::request::tokenizer::Counter`]), stops the rendering and is the result.
    pub fn render_watched(
        &self,
        input: &ChatInput,
        max_bytes: usize,
        watch: &mut dyn FnMut(&[u8], bool) -> Result<()>,
    ) -> Result<String> {
        let name = if input.tools.is_some() && self.has_tool_use { "tool_use" } else { "default" };
        let template = self.env.get_template(name).map_err(|e| Error::Internal(describe(&e)))?;
        let inputs = [Some(&input.messages), input.tools.as_ref()];
        let deepest =
            inputs.iter().flatten().flat_map(|v| v.iter()).chain(input.extra.values()).map(depth).max();
        // A message (or tool, or extra variable) sits one level inside its list.
        if deepest.unwrap_or(0) + 1 > MAX_DEPTH {
            return Err(Error::invalid("messages", format!("nested more than {MAX_DEPTH} levels deep")));
        }
        let mut vars = self.specials.clone();
        for (k, v) in &input.extra {
            vars.insert(k.clone(), v.clone());
        }
        // `tools` is left undefined without tools, as before any template tested it.
        let base = minijinja::context! {
            messages => Value::from_serialize(&input.messages),
            add_generation_prompt => input.add_generation_prompt,
            ..Value::from_serialize(&vars)
        };
        let ctx = match &input.tools {
            Some(tools) => minijinja::context! { tools => Value::from_serialize(tools), ..base },
            None => base,
        };
        let mut out = Bounded { out: Vec::new(), max: max_bytes, over: false, watch, stopped: None };
        TOJSON_BUDGET.with(|b| b.set(Some(max_bytes)));
        let rendered = template.render_captured_to(ctx, &mut out).map(drop);
        let tojson_over = TOJSON_BUDGET.with(|b| b.replace(Some(usize::MAX))).is_none();
        if let Some(e) = out.stopped.take() {
            return Err(e);
        }
        if out.over || tojson_over {
            return Err(Error::invalid(
                "messages",
                format!("the chat template writes more than {max_bytes} bytes from them (more than the model's context holds)"),
            ));
        }
        rendered.map_err(|e| {
            Error::invalid("messages", format!("the model's chat template: {}", describe(&e)))
        })?;
        (out.watch)(&out.out, true)?;
        String::from_utf8(out.out).map_err(|e| Error::Internal(format!("chat template output: {e}")))
    }
}

/// The message of a template error (a `raise_exception` message as it was raised).
fn describe(e: &minijinja::Error) -> String {
    match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(d)) => d.to_string(),
        (_, Some(d)) => format!("{} ({d})", e.kind()),
        _ => e.kind().to_string(),
    }
}

fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// The local time formatted with strftime codes; an unknown code is the template's error.
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    use std::fmt::Write;
    let mut out = String::new();
    write!(out, "{}", chrono::Local::now().format(&format)).map_err(|_| {
        minijinja::Error::new(ErrorKind::InvalidOperation, format!("strftime_now: bad format {format:?}"))
    })?;
    Ok(out)
}

/// `tojson` as HF's Jinja environment defines it: Python's `json.dumps(value,
/// ensure_ascii=False, indent=indent, sort_keys=sort_keys)`.
fn tojson(
    value: Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, minijinja::Error> {
    let indent = match indent.or(kwargs.get::<Option<Value>>("indent")?) {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v).map_err(|_| {
            minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: indent must be a non-negative integer",
            )
        })?),
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let _ = kwargs.get::<Option<Value>>("ensure_ascii")?;
    let _ = kwargs.get::<Option<Value>>("separators")?;
    kwargs.assert_all_used()?;
    let too_long = || minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: the value is too long");
    let budget = TOJSON_BUDGET.with(Cell::get).ok_or_else(too_long)?;
    let mut out = String::new();
    python_json(&value, indent, sort_keys, 0, &mut out, budget)?;
    // A value that fills the budget exactly is fine; one past it ends the rendering.
    let left = budget.checked_sub(out.len());
    TOJSON_BUDGET.with(|b| b.set(left));
    if left.is_none() {
        return Err(too_long());
    }
    Ok(Value::from_safe_string(out))
}

/// JSON as Python's `json.dumps` writes it, straight from the template's value (no copy
/// of it); stops soon after `out` passes `limit` bytes.
fn python_json(
    v: &Value,
    indent: Option<usize>,
    sort_keys: bool,
    depth: usize,
    out: &mut String,
    limit: usize,
) -> std::result::Result<(), minijinja::Error> {
    use minijinja::value::ValueKind;
    if out.len() > limit {
        return Ok(());
    }
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            // Never more than one byte past the limit, however wide the indent.
            let room = limit.saturating_sub(out.len()) + 1;
            out.extend(std::iter::repeat_n(' ', n.saturating_mul(depth).min(room)));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Seq | ValueKind::Iterable if v.len() != Some(0) => {
            out.push('[');
            for (i, item) in v.try_iter()?.enumerate() {
                if out.len() > limit {
                    return Ok(());
                }
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                python_json(&item, indent, sort_keys, depth + 1, out, limit)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map if v.len() != Some(0) => {
            let key_text = |k: &Value| k.as_str().map_or_else(|| k.to_string(), str::to_string);
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if sort_keys {
                keys.sort_by_key(|k| key_text(k));
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if out.len() > limit {
                    return Ok(());
                }
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&Json::String(key_text(k)).to_string());
                out.push_str(": ");
                python_json(&v.get_item(k)?, indent, sort_keys, depth + 1, out, limit)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => out.push_str("[]"),
        ValueKind::Map => out.push_str("{}"),
        _ => {
            let json = serde_json::to_value(v)
                .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
            match json {
                Json::Number(n) if n.is_f64() => {
                    let f = n.as_f64().unwrap_or(0.0);
                    // Python writes whole floats with a ".0"; Rust's shortest form agrees otherwise.
                    if f.fract() == 0.0 && f.abs() < 1e16 {
                        out.push_str(&format!("{f:.1}"));
                    } else {
                        out.push_str(&n.to_string());
                    }
                }
                other => out.push_str(&other.to_string()),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const LIMIT: usize = 1 << 20;

    fn template(source: &str) -> ChatTemplate {
        let mut specials = Map::new();
        specials.insert("bos_token".into(), json!("<s>"));
        ChatTemplate::new(vec![("default".into(), source.into())], specials).unwrap()
    }

    fn input(messages: Json) -> ChatInput {
        ChatInput { messages: messages.as_array().unwrap().clone(), ..Default::default() }
    }

    #[test]
    fn tojson_writes_what_python_writes() {
        let t = template("{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ '<a&b>' | tojson }}");
        let mut extra = Map::new();
        extra.insert("x".into(), json!({"b": [1, 2.0, "é\n"], "a": {}}));
        let out = t.render(&ChatInput { extra, ..Default::default() }, LIMIT).unwrap();
        assert_eq!(
            out,
            "{\"b\": [1, 2.0, \"é\\n\"], \"a\": {}}|{\n  \"b\": [\n    1,\n    2.0,\n    \"é\\n\"\n  ],\n  \"a\": {}\n}|\"<a&b>\""
        );
    }

    #[test]
    fn raise_exception_is_the_requests_error() {
        let t = template("{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user message') }}{% endif %}ok");
        let e = t.render(&input(json!([{"role": "system", "content": "x"}])), LIMIT).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid messages: the model's chat template: Conversations must start with a user message"
        );
        assert_eq!(t.render(&input(json!([{"role": "user", "content": "x"}])), LIMIT).unwrap(), "ok");
    }

    /// A caller's data multiplied by the template (Llama 3.1 writes `tools |
    /// tojson(indent=4)`: nesting multiplies indentation) stops at the byte limit, as does
    /// plain output past it; inputs nest at most MAX_DEPTH deep.
    #[test]
    fn renderings_stop_at_their_byte_limit_and_inputs_at_their_depth() {
        let t = template("{% for t in tools %}{{ t | tojson(indent=4) }}{% endfor %}");
        // 40,000 short strings 12 levels down: ~0.5 MB of JSON, 2.5 MB indented.
        let leaves = json!(vec!["0123456789"; 40_000]);
        let nested = (0..12).fold(leaves, |d, _| json!([d]));
        let huge = ChatInput { tools: Some(vec![nested]), ..Default::default() };
        let e = t.render(&huge, LIMIT).unwrap_err().to_string();
        assert!(e.contains("more than 1048576 bytes"), "{e}");
        let small = ChatInput { tools: Some(vec![json!([[1], [2]])]), ..Default::default() };
        assert_eq!(t.render(&small, LIMIT).unwrap().len(), 48);
        // The budget is the rendering's: a second small render after a refused one works.
        assert!(t.render(&small, 60).is_ok());
        assert!(t.render(&small, 40).is_err());

        let echo = template("{% for m in messages %}{{ m.content }}{% endfor %}");
        let long = input(json!([{"role": "user", "content": "y".repeat(5000)}]));
        assert!(echo.render(&long, 4999).unwrap_err().to_string().contains("more than 4999 bytes"));
        assert_eq!(echo.render(&long, 5000).unwrap().len(), 5000);

        let wrapped = |n: usize| (0..n).fold(json!(1), |d, _| json!([d]));
        // messages → a message → its field `x`: two levels before `x`'s own.
        let with = |x: Json| input(json!([{"role": "user", "content": "x", "x": x}]));
        assert!(echo.render(&with(wrapped(MAX_DEPTH - 2)), LIMIT).is_ok());
        let e = echo.render(&with(wrapped(MAX_DEPTH - 1)), LIMIT).unwrap_err().to_string();
        assert!(e.contains("nested more than 64"), "{e}");
    }

    #[test]
    fn a_template_that_never_ends_runs_out_of_fuel() {
        let t = template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}");
        let e = t.render(&ChatInput::default(), LIMIT).unwrap_err();
        assert!(e.to_string().contains("fuel"), "{e}");
    }

    #[test]
    fn strftime_now_formats_the_local_date() {
        let t = template("{{ strftime_now('%Y-%m-%d') }}");
        let today = chrono::Local::now().format("%Y-%m-%d").to_string();
        let out = t.render(&ChatInput::default(), LIMIT).unwrap();
        // Around midnight the day may turn between the two calls.
        assert!(out == today || out.len() == 10, "{out}");
        assert!(template("{{ strftime_now('%Q') }}").render(&ChatInput::default(), LIMIT).is_err());
    }

    #[test]
    fn templates_come_from_the_model_directory() {
        let dir = tempfile::tempdir().unwrap();
        assert!(ChatTemplate::from_dir(dir.path()).unwrap().is_none());
        let config = json!({
            "bos_token": {"content": "<s>", "lstrip": false},
            "chat_template": [
                {"name": "default", "template": "{{ bos_token }}d"},
                {"name": "tool_use", "template": "{{ bos_token }}t{{ tools | length }}"}
            ]
        });
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&ChatInput::default(), LIMIT).unwrap(), "<s>d");
        let tools = ChatInput { tools: Some(vec![json!({})]), ..Default::default() };
        assert_eq!(t.render(&tools, LIMIT).unwrap(), "<s>t1");
        std::fs::write(dir.path().join("chat_template.jinja"), "{{ '{%' }").unwrap();
        let e = ChatTemplate::from_dir(dir.path()).unwrap_err();
        assert!(e.to_string().contains("chat_template.jinja"), "{e}");
    }
}
