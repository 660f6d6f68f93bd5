//! `/v1/completions` and `/v1/chat/completions` bodies → one domain request per choice.
//!
//! A completion may carry several prompts (strings, or token-id arrays) and `n` choices
//! per prompt; a chat request renders its messages with the model's chat template. Each
//! choice becomes one [`GenerateRequest`] that goes through the same admission, routing
//! and failover as a gRPC call. A seeded request with `n` > 1 gives choice `i` the seed
//! `seed + i`, so choices differ and the whole response is reproducible.

use serde_json::{Map, Value as Json};
use strata_common::Error;

use super::error::ApiError;
use super::params::{self, Common, Fields, MAX_CHOICES};
use crate::frontend::admission::{self, GenerateRequest, Priority, Prompt};
use crate::request::chat::ChatInput;
use crate::request::reply::ReplyReader;
use crate::request::tools::forced::ToolPlan;
use crate::routing::Catalog;

/// Most messages in one chat request.
const MAX_MESSAGES: usize = 4096;

/// Which API a request came in on (the response shapes differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Completion,
    Chat,
}

/// One choice to generate.
#[derive(Debug, Clone)]
pub struct Choice {
    pub index: u32,
    /// Which prompt of the request it continues (usage counts each prompt once).
    pub prompt: usize,
    pub request: GenerateRequest,
}

/// A parsed request: its choices and how to answer.
#[derive(Debug)]
pub struct Job {
    pub api: Api,
    pub common: Common,
    pub choices: Vec<Choice>,
    /// Per prompt, text to put before each choice's output (`echo`).
    pub echo: Option<Vec<String>>,
    /// How a chat reply is read for reasoning and tool calls; None: plain text.
    pub reply: Option<ReplyReader>,
}

/// Admission names fields as inference.v1's domain does; OpenAI spells some differently.
pub fn rename(job: &Job) -> impl Fn(&str) -> Option<String> {
    let (api, max_tokens) = (job.api, job.common.max_tokens_field);
    let constraint = job.common.constraint_field.clone();
    move |field| {
        if matches!(field, "response_format" | "guided_regex" | "guided_choice" | "guided_grammar") {
            return constraint.clone();
        }
        if field.starts_with("prompt") {
            return Some(if api == Api::Chat { "messages" } else { "prompt" }.to_string());
        }
        match (api, field) {
            (Api::Chat, "logprobs") => Some("top_logprobs".into()),
            (_, "max_tokens") => Some(max_tokens.into()),
            _ => None,
        }
    }
}

/// Each prompt is tokenized once, here (a build runs on the blocking pool), however many
/// choices share it: `n` copies of a long text would each be tokenized again.
fn choices(
    models: &dyn Catalog,
    common: &Common,
    prompts: Vec<Prompt>,
    fill_context: bool,
) -> Result<Vec<Choice>, ApiError> {
    let total = prompts.len().saturating_mul(common.n);
    if total > MAX_CHOICES {
        return Err(ApiError::invalid("n", format!("prompts × n is {total}; at most {MAX_CHOICES} choices")));
    }
    let model = models.get(&common.model).map_err(ApiError::from)?;
    let prompts = prompts
        .iter()
        .map(|p| admission::prompt_ids(p, &model).map(Prompt::TokenIds))
        .collect::<Result<Vec<_>, Error>>()?;
    let mut out = Vec::with_capacity(total);
    for (p, prompt) in prompts.into_iter().enumerate() {
        for i in 0..common.n {
            let mut params = common.params.clone();
            params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
            out.push(Choice {
                index: out.len() as u32,
                prompt: p,
                request: GenerateRequest {
                    model: common.model.clone(),
                    prompt: Some(prompt.clone()),
                    max_tokens: common.max_tokens,
                    fill_context,
                    params,
                    priority: Priority::Online,
                    cache: common.cache,
                },
            });
        }
    }
    Ok(out)
}

/// The prompts of a /v1/completions body: a string, strings, token ids, or arrays of ids.
pub(super) fn prompts(f: &Fields) -> Result<Vec<Prompt>, ApiError> {
    prompts_bounded(f, MAX_CHOICES)
}

/// [`prompts`], at most `max` of them.
pub(super) fn prompts_bounded(f: &Fields, max: usize) -> Result<Vec<Prompt>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "prompt must be a string, an array of strings, an array of token ids or an array of such arrays",
        )
    };
    let ids = |items: &[Json]| -> Result<Vec<u32>, ApiError> {
        items
            .iter()
            .map(|v| v.as_u64().filter(|&x| x <= u32::MAX as u64).map(|x| x as u32).ok_or_else(bad))
            .collect()
    };
    match f.get("prompt") {
        None | Some(Json::Null) => Err(ApiError::invalid("prompt", "prompt is required")),
        Some(Json::String(s)) => Ok(vec![Prompt::Text(s.clone())]),
        Some(Json::Array(items)) if items.is_empty() => {
            Err(ApiError::invalid("prompt", "prompt must not be empty"))
        }
        // A list of prompts (not one prompt's token ids) is bounded by count.
        Some(Json::Array(items)) if items.len() > max && !items[0].is_number() => {
            Err(ApiError::invalid("prompt", format!("at most {max} prompts")))
        }
        Some(Json::Array(items)) => match &items[0] {
            Json::Number(_) => Ok(vec![Prompt::TokenIds(ids(items)?)]),
            Json::String(_) => {
                items.iter().map(|v| v.as_str().map(|s| Prompt::Text(s.into())).ok_or_else(bad)).collect()
            }
            Json::Array(_) => items
                .iter()
                .map(|v| v.as_array().ok_or_else(bad).and_then(|a| ids(a)).map(Prompt::TokenIds))
                .collect(),
            _ => Err(bad()),
        },
        Some(_) => Err(bad()),
    }
}

/// A /v1/completions body.
pub fn completion(models: &dyn Catalog, f: &Fields) -> Result<Job, ApiError> {
    params::refuse_unknown(f, params::COMPLETION_FIELDS)?;
    let mut common = params::common(f, &["max_tokens"])?;
    common.params.logprobs = params::completion_logprobs(f)?;
    let prompts = prompts(f)?;
    if params::string(f, "suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "suffix is not supported"));
    }
    let echo = params::boolean(f, "echo")?.unwrap_or(false);
    if echo {
        // The echoed prompt's entries head the logprobs: its tokens' logprobs are computed.
        common.prompt_logprobs.echoed = common.params.logprobs;
        common.params.prompt_logprobs = common.prompt_logprobs.top();
    }
    let echo = if echo {
        let model = models.get(&common.model).map_err(ApiError::from)?;
        let texts = prompts
            .iter()
            .map(|p| match p {
                Prompt::Text(t) | Prompt::Chat(t) => Ok(t.clone()),
                // Decoded only within the context: longer is refused at admission anyway.
                Prompt::TokenIds(ids) if ids.len() > model.config.max_position_embeddings => {
                    Err(Error::invalid(
                        "prompt",
                        format!(
                            "{} tokens exceed the model's context of {}",
                            ids.len(),
                            model.config.max_position_embeddings
                        ),
                    ))
                }
                Prompt::TokenIds(ids) => model.tokenizer.decode(ids),
            })
            .collect::<Result<Vec<_>, Error>>()?;
        Some(texts)
    } else {
        None
    };
    let choices = choices(models, &common, prompts, false)?;
    Ok(Job { api: Api::Completion, common, choices, echo, reply: None })
}

/// A message's content as the template sees it: text, or text parts joined by newlines.
fn content(i: usize, m: &Map<String, Json>) -> Result<Json, ApiError> {
    let param = || format!("messages[{i}].content");
    match m.get("content") {
        None | Some(Json::Null) => Ok(Json::Null),
        Some(Json::String(s)) => Ok(Json::String(s.clone())),
        Some(Json::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for part in parts {
                match (part.get("type").and_then(Json::as_str), part.get("text").and_then(Json::as_str)) {
                    (Some("text"), Some(t)) => texts.push(t),
                    (kind, _) => {
                        return Err(ApiError::invalid(
                            param(),
                            format!("only text parts are supported, got type {}", kind.unwrap_or("(none)")),
                        ))
                    }
                }
            }
            Ok(Json::String(texts.join("\n")))
        }
        Some(_) => Err(ApiError::invalid(param(), "content must be a string or an array of text parts")),
    }
}

pub(super) fn messages(f: &Fields) -> Result<Vec<Json>, ApiError> {
    let Some(Json::Array(list)) = f.get("messages") else {
        return Err(ApiError::invalid(
            "messages",
            "messages is required: an array of {role, content} objects",
        ));
    };
    if list.is_empty() || list.len() > MAX_MESSAGES {
        return Err(ApiError::invalid("messages", format!("give from 1 to {MAX_MESSAGES} messages")));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let Json::Object(m) = m else {
            return Err(ApiError::invalid(format!("messages[{i}]"), "each message must be an object"));
        };
        match m.get("role").and_then(Json::as_str) {
            Some("system" | "user" | "assistant" | "tool" | "developer") => {}
            _ => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    "role must be system, developer, user, assistant or tool",
                ))
            }
        }
        let mut m = m.clone();
        m.insert("content".into(), content(i, &m)?);
        out.push(Json::Object(m));
    }
    Ok(out)
}

/// A /v1/chat/completions body, rendered with the model's chat template.
pub fn chat(models: &dyn Catalog, mut f: Fields) -> Result<Job, ApiError> {
    params::refuse_unknown(&f, params::CHAT_FIELDS)?;
    if let Some(m) = f.get("modalities").and_then(Json::as_array) {
        if m.iter().any(|x| x != "text") {
            return Err(ApiError::invalid("modalities", "only text output is supported"));
        }
    }
    let mut common = params::common(&f, &["max_tokens", "max_completion_tokens"])?;
    common.params.logprobs = params::chat_logprobs(&f)?;
    if params::boolean(&f, "continue_final_message")?.unwrap_or(false) {
        return Err(ApiError::invalid("continue_final_message", "continue_final_message is not supported"));
    }
    let input = chat_input(&mut f)?;
    let model = models.get(&common.model).map_err(ApiError::from)?;
    let Some(template) = model.tokenizer.chat_template() else {
        return Err(ApiError::invalid(
            "messages",
            format!("model {:?} has no chat template; use /v1/completions", model.name),
        ));
    };
    let parallel = params::boolean(&f, "parallel_tool_calls")?;
    let tools =
        ToolPlan::new(input.tools.as_deref(), f.get("tool_choice"), parallel, template.tool_format())?;
    if let Some(forced) = tools.as_ref().and_then(ToolPlan::constraint) {
        if let Some(other) = &common.constraint_field {
            return Err(ApiError::invalid(
                other.clone(),
                format!("{other} cannot be combined with tool_choice required or a named function"),
            ));
        }
        common.params.constraint = Some(forced);
        common.constraint_field = Some("tool_choice".into());
    }
    let text = model.tokenizer.render_chat(&input, model.config.max_position_embeddings)?;
    let reply = ReplyReader { tools, reasoning: template.reasoning(&text) };
    let reply = (!reply.is_plain()).then_some(reply);
    let choices = choices(models, &common, vec![Prompt::Chat(text)], true)?;
    Ok(Job { api: Api::Chat, common, choices, echo: None, reply })
}

/// What a chat template renders: the messages, the tools, `chat_template_kwargs` and
/// `add_generation_prompt` (default true) of a chat body.
pub(super) fn chat_input(f: &mut Fields) -> Result<ChatInput, ApiError> {
    let messages = messages(f)?;
    // Taken out of the body, not copied: a caller's tools may be megabytes.
    let tools = match f.remove("tools") {
        None | Some(Json::Null) => None,
        Some(Json::Array(t)) => Some(t),
        Some(_) => return Err(ApiError::invalid("tools", "tools must be an array")),
    };
    let extra = match f.remove("chat_template_kwargs") {
        None | Some(Json::Null) => Map::new(),
        Some(Json::Object(o)) => o,
        Some(_) => {
            return Err(ApiError::invalid("chat_template_kwargs", "chat_template_kwargs must be an object"))
        }
    };
    let mut extra = extra;
    // gpt-oss reads its effort from the template; OpenAI's clients send it top-level.
    if let Some(effort) = params::string(f, "reasoning_effort")? {
        if !matches!(effort, "minimal" | "low" | "medium" | "high") {
            return Err(ApiError::invalid(
                "reasoning_effort",
                "reasoning_effort must be minimal, low, medium or high",
            ));
        }
        extra.entry("reasoning_effort").or_insert_with(|| Json::String(effort.to_string()));
    }
    let add_generation_prompt = params::boolean(f, "add_generation_prompt")?.unwrap_or(true);
    Ok(ChatInput { messages, tools, add_generation_prompt, extra })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_long_token_prompt_is_not_many_prompts() {
        let fields = |prompt: Json| {
            params::object(serde_json::json!({"prompt": prompt}).to_string().as_bytes()).unwrap()
        };
        let long: Vec<u32> = (0..1000).collect();
        assert!(
            matches!(&prompts(&fields(serde_json::json!(long))).unwrap()[..], [Prompt::TokenIds(ids)] if ids.len() == 1000)
        );
        let many = vec!["x"; MAX_CHOICES + 1];
        let e = prompts(&fields(serde_json::json!(many))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let lists = vec![vec![1, 2]; MAX_CHOICES + 1];
        assert!(prompts(&fields(serde_json::json!(lists))).is_err());
    }
}
