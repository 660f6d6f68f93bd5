//! What a running sequence reports, and what a replica's engine reports about its load.
//!
//! These are the engine's outputs as every other process sees them: the engine produces
//! them, the worker process streams them over worker.v1, and the coordinator turns them
//! into text. They live here so the coordinator never links the engine.

use crate::error::Error;
use crate::sampling::FinishReason;

/// The chosen token's logprob and the top alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token_id: u32,
    pub logprob: f32,
    /// The token's 1-based rank in the distribution (1: the most likely); 0 where it was
    /// not computed (generated tokens; prompt tokens always have it).
    pub rank: u32,
    /// `(token_id, logprob)`, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// What a sequence's stream receives: tokens in order, the last one with `finish` set, or
/// a failure. A stream that ends without either means the replica went away.
#[derive(Debug)]
pub enum SeqEvent {
    /// The prompt's logprobs (requested with `prompt_logprobs`): one per prompt token after
    /// the first, sent once, before the first token.
    Prompt(Vec<TokenLogprobs>),
    Token {
        token: u32,
        logprobs: Option<TokenLogprobs>,
        finish: Option<FinishReason>,
    },
    /// An embedding request's answer (its pooled hidden states); nothing follows.
    Embedding(Vec<f32>),
    Failed(Error),
}

impl SeqEvent {
    /// Whether nothing follows this event.
    pub fn is_last(&self) -> bool {
        matches!(self, SeqEvent::Token { finish: Some(_), .. } | SeqEvent::Embedding(_) | SeqEvent::Failed(_))
    }
}

/// A point-in-time view of one replica's load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_free: usize,
    pub kv_blocks_total: usize,
    /// Positions per KV block (0 when unknown): what prefix-affinity routing hashes by.
    pub block_size: usize,
    /// The longest sequence (prompt + output) the replica can hold: the model's context,
    /// `--max-model-len` and its KV cache's capacity, whichever is least (0 when unknown).
    pub max_context: usize,
}

impl EngineStats {
    /// Sequences running or waiting.
    pub fn outstanding(&self) -> usize {
        self.running + self.waiting
    }

    /// The load of several replicas together.
    pub fn sum(stats: impl IntoIterator<Item = EngineStats>) -> EngineStats {
        stats.into_iter().fold(EngineStats::default(), |a, s| EngineStats {
            running: a.running + s.running,
            waiting: a.waiting + s.waiting,
            kv_blocks_free: a.kv_blocks_free + s.kv_blocks_free,
            kv_blocks_total: a.kv_blocks_total + s.kv_blocks_total,
            block_size: a.block_size.max(s.block_size),
            max_context: match (a.max_context, s.max_context) {
                (0, c) | (c, 0) => c,
                (a, b) => a.min(b),
            },
        })
    }
}
