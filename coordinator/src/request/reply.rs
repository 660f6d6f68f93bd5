//! How a chat reply is read: reasoning apart from the answer, tool calls out of it.
//!
//! Reasoning is separated when the model's chat template writes it: `<think>…</think>`
//! (DeepSeek-R1, Qwen3; the block may already be open at the end of the prompt, as
//! DeepSeek-R1's template leaves it) or gpt-oss's `analysis` channel. Whatever follows is
//! read for tool calls by the request's [`ToolPlan`].

use super::tools::forced::ToolPlan;
use super::tools::{harmony_reasoning, split_think, Parsed, Reply, ToolFormat};

/// Where a model writes its reasoning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reasoning {
    /// Between `<think>` and `</think>`; `starts_inside`: the prompt opened the block.
    Think { starts_inside: bool },
    /// gpt-oss's analysis channel.
    Harmony,
}

impl Reasoning {
    /// The reasoning format of a template's text, given the prompt it rendered.
    pub fn detect(template_writes_think: bool, harmony: bool, prompt: &str) -> Option<Self> {
        if harmony {
            return Some(Reasoning::Harmony);
        }
        if !template_writes_think {
            return None;
        }
        let open = prompt.rfind("<think>");
        let starts_inside = open.is_some() && open > prompt.rfind("</think>");
        Some(Reasoning::Think { starts_inside })
    }
}

/// One request's way of reading its replies.
#[derive(Debug, Clone, Default)]
pub struct ReplyReader {
    pub tools: Option<ToolPlan>,
    pub reasoning: Option<Reasoning>,
}

impl ReplyReader {
    /// Whether it reads anything beyond plain text.
    pub fn is_plain(&self) -> bool {
        self.tools.is_none() && self.reasoning.is_none()
    }

    /// Reasoning, content and calls of `text` (`partial`: as far as final while the reply
    /// is still being generated).
    pub fn read(&self, text: &str, partial: bool) -> Reply {
        let (reasoning, rest) = match self.reasoning {
            Some(Reasoning::Think { starts_inside }) => split_think(text, partial, starts_inside),
            Some(Reasoning::Harmony) => (harmony_reasoning(text, partial), text),
            None => (String::new(), text),
        };
        let parsed = match (&self.tools, self.reasoning) {
            (Some(plan), _) => plan.read(rest, partial),
            (None, Some(Reasoning::Harmony)) => {
                Parsed { calls: Vec::new(), ..ToolFormat::Openai.read(rest, partial) }
            }
            (None, _) => Parsed { content: rest.to_string(), calls: Vec::new() },
        };
        Reply { reasoning, parsed }
    }
}
