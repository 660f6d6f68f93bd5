//! The engine: sequences in, tokens out, one batched forward pass per step.
//!
//! Sequences join ([`Engine::add`]) and leave ([`Engine::cancel`], or by finishing) between
//! steps. Each [`Engine::step`] gives every running sequence its uncomputed tokens — the
//! whole prompt on its first step, one token afterwards — in a single ragged batch over
//! the paged KV cache, then samples one token per sequence. Blocks are returned to the
//! pool the moment a sequence finishes or is cancelled.
//!
//! Stop strings are the caller's business (they need the detokenizer): the caller cancels
//! a sequence once its text contains one. Everything that ends on token ids — EOS, stop
//! token ids, max tokens, the context length — ends here.

use std::collections::HashSet;

use strata_common::{Error, FinishReason, Result, SamplingParams};
use tracing::debug;

use crate::backend::{Backend, BatchLayout, SeqSlice};
use crate::kv::{BlockPool, DEFAULT_BLOCK_SIZE};
use crate::model::Model;
use crate::sampler::Sampler;
pub use crate::sampler::TokenLogprobs;

/// Caller-chosen identifier of a sequence.
pub type SeqId = u64;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Positions per KV block.
    pub block_size: usize,
    /// Memory for the KV cache; the block count follows from it.
    pub kv_cache_bytes: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: DEFAULT_BLOCK_SIZE,
            kv_cache_bytes: 512 << 20,
        }
    }
}

/// One token produced by a step.
#[derive(Debug, Clone)]
pub struct StepEvent {
    pub seq: SeqId,
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
    /// Set on the sequence's last token.
    pub finish: Option<FinishReason>,
}

struct Sequence {
    id: SeqId,
    tokens: Vec<u32>,
    /// Tokens whose K and V are in the cache.
    computed: usize,
    generated: u32,
    blocks: Vec<u32>,
    sampler: Sampler,
}

pub struct Engine<B: Backend> {
    model: Model<B>,
    kv: Vec<B::KvLayer>,
    pool: BlockPool,
    seqs: Vec<Sequence>,
    eos: HashSet<u32>,
}

impl<B: Backend> Engine<B> {
    pub fn new(model: Model<B>, config: &EngineConfig) -> Result<Self> {
        let per_block = model.kv_bytes_per_position() * config.block_size;
        let num_blocks = config.kv_cache_bytes / per_block;
        if num_blocks == 0 {
            return Err(Error::invalid(
                "kv_cache_bytes",
                format!(
                    "{} bytes hold no block of {per_block} bytes",
                    config.kv_cache_bytes
                ),
            ));
        }
        let kv = model.alloc_kv(num_blocks, config.block_size)?;
        debug!(
            num_blocks,
            block_size = config.block_size,
            "KV cache allocated"
        );
        let eos = model.config.eos_token_ids.iter().copied().collect();
        Ok(Engine {
            kv,
            pool: BlockPool::new(num_blocks, config.block_size),
            model,
            seqs: Vec::new(),
            eos,
        })
    }

    pub fn model(&self) -> &Model<B> {
        &self.model
    }

    /// Longest sequence (prompt + output) the model accepts.
    pub fn max_context(&self) -> usize {
        self.model.config.max_position_embeddings
    }

    pub fn num_running(&self) -> usize {
        self.seqs.len()
    }

    pub fn free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    pub fn total_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Admits a sequence; it runs from the next step.
    pub fn add(&mut self, id: SeqId, prompt: Vec<u32>, params: SamplingParams) -> Result<()> {
        params.validate()?;
        if prompt.is_empty() {
            return Err(Error::invalid("prompt", "must not be empty"));
        }
        let vocab = self.model.config.vocab_size;
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::invalid(
                "prompt",
                format!("token id {bad} is outside the vocabulary (size {vocab})"),
            ));
        }
        if prompt.len() >= self.max_context() {
            return Err(Error::invalid(
                "prompt",
                format!(
                    "{} tokens leave no room to generate within the context of {} tokens",
                    prompt.len(),
                    self.max_context()
                ),
            ));
        }
        let capacity = self.pool.num_blocks() * self.pool.block_size();
        if prompt.len() + 1 > capacity {
            return Err(Error::invalid(
                "prompt",
                format!(
                    "{} tokens exceed the KV cache's capacity of {capacity} positions",
                    prompt.len()
                ),
            ));
        }
        if self.seqs.iter().any(|s| s.id == id) {
            return Err(Error::invalid(
                "request_id",
                format!("sequence {id} is already running"),
            ));
        }
        let sampler = Sampler::new(params, &prompt);
        self.seqs.push(Sequence {
            id,
            tokens: prompt,
            computed: 0,
            generated: 0,
            blocks: Vec::new(),
            sampler,
        });
        Ok(())
    }

    /// Stops a sequence and frees its blocks; false if it was not running.
    pub fn cancel(&mut self, id: SeqId) -> bool {
        match self.seqs.iter().position(|s| s.id == id) {
            Some(i) => {
                let mut seq = self.seqs.remove(i);
                self.pool.release(&mut seq.blocks);
                true
            }
            None => false,
        }
    }

    /// Runs one forward pass over every running sequence that fits in the cache.
    pub fn step(&mut self) -> Result<Vec<StepEvent>> {
        let mut ids = Vec::new();
        let mut layout = BatchLayout {
            block_size: self.pool.block_size(),
            ..Default::default()
        };
        let mut logit_rows = Vec::new();
        let mut scheduled = Vec::new();
        for (i, seq) in self.seqs.iter_mut().enumerate() {
            if self.pool.grow(&mut seq.blocks, seq.tokens.len()).is_err() {
                continue; // waits for blocks; the scheduler issue adds preemption.
            }
            let start = ids.len();
            for pos in seq.computed..seq.tokens.len() {
                ids.push(seq.tokens[pos]);
                layout.positions.push(pos as u32);
                layout.slots.push(self.pool.slot(&seq.blocks, pos));
            }
            layout.seqs.push(SeqSlice {
                token_start: start,
                num_tokens: ids.len() - start,
                context_before: seq.computed,
                block_table: seq.blocks.clone(),
            });
            logit_rows.push(ids.len() - 1);
            scheduled.push(i);
        }
        if scheduled.is_empty() {
            return if self.seqs.is_empty() {
                Ok(Vec::new())
            } else {
                Err(Error::Overloaded(
                    "KV cache too small for any running sequence".into(),
                ))
            };
        }
        let logits = self.model.forward(&ids, &layout, &mut self.kv, &logit_rows);
        let vocab = self.model.config.vocab_size;
        let max_context = self.max_context();
        let mut events = Vec::with_capacity(scheduled.len());
        for (row, &i) in scheduled.iter().enumerate() {
            let seq = &mut self.seqs[i];
            seq.computed = seq.tokens.len();
            let (token, logprobs) = seq.sampler.sample(&logits[row * vocab..(row + 1) * vocab]);
            seq.tokens.push(token);
            seq.generated += 1;
            let params = seq.sampler.params();
            let finish = if !params.ignore_eos && self.eos.contains(&token) {
                Some(FinishReason::Eos)
            } else if params.stop_token_ids.contains(&token) {
                Some(FinishReason::Stop)
            } else if seq.generated >= params.max_new_tokens || seq.tokens.len() >= max_context {
                Some(FinishReason::Length)
            } else {
                None
            };
            events.push(StepEvent {
                seq: seq.id,
                token,
                logprobs,
                finish,
            });
        }
        for e in &events {
            if e.finish.is_some() {
                self.cancel(e.seq);
            }
        }
        Ok(events)
    }

    /// Raw logits of the last position of `prompt`, computed on a scratch sequence (tests,
    /// reference comparisons). Leaves no state behind.
    pub fn prompt_logits(&mut self, prompt: &[u32]) -> Result<Vec<f32>> {
        let mut blocks = Vec::new();
        self.pool.grow(&mut blocks, prompt.len())?;
        let layout = BatchLayout {
            positions: (0..prompt.len() as u32).collect(),
            slots: (0..prompt.len())
                .map(|p| self.pool.slot(&blocks, p))
                .collect(),
            seqs: vec![SeqSlice {
                token_start: 0,
                num_tokens: prompt.len(),
                context_before: 0,
                block_table: blocks.clone(),
            }],
            block_size: self.pool.block_size(),
        };
        let logits = self
            .model
            .forward(prompt, &layout, &mut self.kv, &[prompt.len() - 1]);
        self.pool.release(&mut blocks);
        Ok(logits)
    }
}
