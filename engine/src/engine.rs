//! The engine: sequences in, tokens out, one batched forward pass per step.
//!
//! Sequences join ([`Engine::add`]) and leave ([`Engine::cancel`], or by finishing) between
//! steps. Each [`Engine::step`] asks the [`Scheduler`] for a plan — decodes of running
//! sequences plus prefill chunks, within the token budget — runs it as one ragged batch
//! over the paged KV cache, and samples one token for every sequence whose chunk reached
//! its end. Blocks return to the pool the moment a sequence finishes or is cancelled.
//!
//! Stop strings are the caller's business (they need the detokenizer): the caller cancels
//! a sequence once its text contains one. Everything that ends on token ids — EOS, stop
//! token ids, max tokens, the context length — ends here.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use strata_common::{Error, FinishReason, Result, SamplingParams};
use tracing::{debug, info};

use crate::backend::Backend;
use crate::dist::{kv_blocks, LeaderExecutor, StepExecutor};
use crate::guide::{prepare_guide, Grammars, Guide, TokenMask};
use crate::kv::BlockPool;
use crate::logits::{Draw, LogitsWanted, StepLogits, StepOutput, MAX_PICK_VOCAB};
use crate::model::Model;
use crate::sampler::Sampler;
pub use crate::sampler::TokenLogprobs;
use crate::scheduler::{Schedule, Scheduled, Scheduler, SchedulerConfig, SeqData};
pub use crate::step::SeqId;
use crate::step::{BatchLayout, KvBlocks, SeqSlice, Step};

mod embed;
mod guided;
mod memory;
mod prompt;
mod scratch;
pub use embed::EmbedDefaults;
use embed::Embedding;
use prompt::PromptLogprobs;

/// The longest sequence an engine accepts: the model's context, cut to `max_model_len`
/// (which may not exceed it) and to what the KV cache holds for one sequence — with a
/// warning then, since requests the model could take are refused.
fn context_limit(model: usize, max_model_len: Option<usize>, kv_positions: usize) -> Result<usize> {
    let limit = match max_model_len {
        Some(0) => return Err(Error::invalid("max_model_len", "must be at least 1")),
        Some(n) if n > model => {
            return Err(Error::invalid(
                "max_model_len",
                format!("{n} exceeds the model's context of {model} tokens"),
            ))
        }
        Some(n) => n,
        None => model,
    };
    if kv_positions < limit {
        tracing::warn!(
            context = limit,
            kv_positions,
            "the KV cache holds {kv_positions} positions for one sequence, less than a full context of {limit}: \
             sequences are limited to {kv_positions} tokens (raise --kv-cache-memory or lower --max-model-len)"
        );
    }
    Ok(limit.min(kv_positions))
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Positions per KV block.
    pub block_size: usize,
    /// Memory for the KV cache; the block count follows from it.
    pub kv_cache_bytes: usize,
    /// `--gpu-memory-utilization`: the KV cache gets what this fraction of the device's
    /// memory leaves after the weights and activations (instead of `kv_cache_bytes`).
    pub memory_utilization: Option<f64>,
    pub scheduler: SchedulerConfig,
    /// Reuse cached KV blocks of shared prompt prefixes.
    pub prefix_caching: bool,
    /// Device and numerics of the ranks' backends.
    pub backend: crate::backend::BackendOptions,
    /// The model and replica its metrics are filed under.
    pub labels: crate::metrics::ReplicaLabels,
    /// The longest prompt + output a sequence may have (`--max-model-len`); None: the
    /// model's context. Never more than the model's context.
    pub max_model_len: Option<usize>,
    /// How embedding requests pool unless they say (`--pooling`); None: the model's.
    pub pooling: Option<strata_common::Pooling>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        let settings = strata_common::config::EngineSettings::default();
        EngineConfig {
            block_size: settings.block_size,
            kv_cache_bytes: strata_common::config::EngineSettings::KV_CACHE_BYTES,
            memory_utilization: None,
            scheduler: SchedulerConfig::default(),
            prefix_caching: settings.prefix_caching,
            backend: Default::default(),
            labels: Default::default(),
            max_model_len: None,
            pooling: None,
        }
    }
}

/// One token produced by a step, or the end of a sequence that could not continue.
#[derive(Debug, Clone)]
pub struct StepEvent {
    pub seq: SeqId,
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
    /// On a sequence's first token, when it asked for them: its prompt's logprobs.
    pub prompt_logprobs: Option<Vec<TokenLogprobs>>,
    /// An embedding request's answer (then `token` means nothing and `finish` is set).
    pub embedding: Option<Vec<f32>>,
    /// Set on the sequence's last token.
    pub finish: Option<FinishReason>,
}

/// Whether a row of logits can be sampled: no NaN or +∞, and some token not at −∞ (a
/// masked row holds −∞ for what its constraint forbids).
fn finite_row(row: &[f32]) -> bool {
    row.iter().all(|x| !x.is_nan() && *x < f32::INFINITY) && row.iter().any(|x| x.is_finite())
}

/// What a sequence whose model produced NaN or infinite logits fails with.
fn non_finite() -> Error {
    Error::Internal(
        "the model produced non-finite logits (NaN or infinity): its weights or config.json are broken"
            .into(),
    )
}

/// A row of a step a sequence's chunk asked for beyond its sampled one: which sequence,
/// the position it computes, and its row in the step.
struct ChunkRow {
    seq: SeqId,
    position: usize,
    row: usize,
}

impl StepEvent {
    /// The answer of embedding request `seq`.
    fn embedding(seq: SeqId, v: Vec<f32>) -> Self {
        let finish = Some(FinishReason::Stop);
        StepEvent { seq, token: 0, logprobs: None, prompt_logprobs: None, embedding: Some(v), finish }
    }
}

/// Per-sequence state the scheduler does not need.
struct SeqMeta {
    sampler: Sampler,
    generated: u32,
    /// Where a constrained sequence stands in its constraint.
    guide: Option<Guide>,
    /// Its prompt's logprobs while they are computed, when asked for.
    prompt: Option<PromptLogprobs>,
    /// An embedding request's pooling while its prompt is computed.
    embed: Option<Embedding>,
}

/// A sequence removed because it cannot run: the cache can never hold it, or the model
/// produced non-finite logits for it.
#[derive(Debug)]
pub struct Aborted {
    pub seq: SeqId,
    pub error: Error,
    /// The model's numbers failed (NaN or infinite logits): a broken model, not a request
    /// too large; canaries fail on it.
    pub non_finite: bool,
}

pub struct Engine {
    exec: Box<dyn StepExecutor>,
    scheduler: Scheduler,
    meta: HashMap<SeqId, SeqMeta>,
    eos: HashSet<u32>,
    aborted: Vec<Aborted>,
    /// Sequences the last step took off the queue.
    admitted: Vec<SeqId>,
    /// Tokens the last step computed.
    last_step_tokens: usize,
    labels: crate::metrics::ReplicaLabels,
    /// See [`Engine::max_context`].
    max_context: usize,
    /// Compiles constraints; None when the model has no tokenizer this can read.
    grammars: Option<Arc<Grammars>>,
    /// How embedding requests pool unless they say.
    embed_defaults: EmbedDefaults,
    /// `--pooling`: the pooling over the model's.
    pooling: Option<strata_common::Pooling>,
    /// Apply constraints' masks where the logits are, where the executor can.
    device_masks: bool,
}

impl Engine {
    /// An engine running `model` on this rank alone.
    pub fn new<B: Backend>(mut model: Model<B>, config: &EngineConfig) -> Result<Self> {
        model.label(&config.labels);
        let par = model.shard.par;
        Self::with_executor(Box::new(LeaderExecutor::solo(model)), par, config)
    }

    /// An engine whose steps run on `exec` (a single rank or a replica's leader).
    pub fn with_executor(
        mut exec: Box<dyn StepExecutor>,
        par: strata_common::Parallelism,
        config: &EngineConfig,
    ) -> Result<Self> {
        if config.scheduler.max_num_seqs == 0 || config.scheduler.max_batched_tokens == 0 {
            return Err(Error::invalid(
                "max_num_seqs",
                "max_num_seqs and max_batched_tokens must be at least 1",
            ));
        }
        // On the CPU an in-process replica's ranks share the host's memory.
        let sharing = if config.backend.device == crate::backend::Device::Cpu { par.world() } else { 1 };
        let kv_bytes = memory::kv_cache_bytes(config, exec.config(), sharing)?;
        memory::check_kv_memory(config, kv_bytes)?;
        let element = exec.kv_element_bytes();
        let bs = config.block_size;
        let num_blocks = kv_blocks(exec.config(), par, kv_bytes, bs, element)?;
        exec.alloc_kv(KvBlocks { num_blocks, block_size: bs })?;
        // A table per KV group, each released behind its window (a global group's never).
        let groups = exec.config().kv_groups();
        let pool = BlockPool::with_prefix_caching(num_blocks, bs, config.prefix_caching);
        let eos = exec.config().eos_token_ids.iter().copied().collect();
        let scheduler = Scheduler::new(config.scheduler.clone(), pool).with_kv_groups(&groups.windows);
        let max_sequence = scheduler.max_positions();
        let kv_bound = if scheduler.bounds_sequences() { max_sequence } else { usize::MAX };
        let max_context =
            context_limit(exec.config().max_position_embeddings, config.max_model_len, kv_bound)?;
        info!(
            num_blocks,
            block_size = bs,
            kv_groups = groups.num_groups(),
            max_sequence,
            "KV cache allocated: {} positions in blocks, a sequence of up to {max_sequence} positions",
            num_blocks * bs,
        );
        Ok(Engine {
            exec,
            scheduler,
            meta: HashMap::new(),
            eos,
            aborted: Vec::new(),
            admitted: Vec::new(),
            last_step_tokens: 0,
            labels: config.labels.clone(),
            max_context,
            grammars: None,
            embed_defaults: EmbedDefaults::default(),
            pooling: config.pooling,
            device_masks: true,
        }
        .with_pooling_override())
    }

    /// This engine, pooling embeddings as the model in `dir` says (see [`EmbedDefaults`]);
    /// a model whose files say nothing readable pools the last token (logged).
    pub fn with_embed_defaults_from(mut self, dir: &std::path::Path) -> Self {
        self.embed_defaults = EmbedDefaults::from_dir(dir).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "embedding defaults unreadable: the last token, normalized");
            EmbedDefaults::default()
        });
        self.with_pooling_override()
    }

    /// The configured pooling (`--pooling`) over the model's.
    fn with_pooling_override(mut self) -> Self {
        if let Some(p) = self.pooling {
            self.embed_defaults.pooling = Ok(p);
        }
        self
    }

    /// This engine, compiling constraints with `grammars` (see [`crate::guide`]).
    pub fn with_grammars(mut self, grammars: Option<Arc<Grammars>>) -> Self {
        self.grammars = grammars;
        self
    }

    /// This engine, compiling constraints against the tokenizer of the model in `dir`; a
    /// model without one (or with one it cannot read, which is logged) serves
    /// unconstrained requests only.
    pub fn with_grammars_from(self, dir: &std::path::Path) -> Self {
        let config = self.exec.config();
        let grammars = match Grammars::from_dir(dir, config.vocab_size, &config.eos_token_ids) {
            Ok(g) => g.map(Arc::new),
            Err(e) => {
                tracing::warn!(error = %e, "constrained decoding is off for this model");
                None
            }
        };
        self.with_grammars(grammars)
    }

    /// Whether constrained sequences have their masks applied where the logits are (a
    /// replica of one rank on a GPU; see [`crate::logits::late`]).
    pub fn masks_on_device(&self) -> bool {
        self.device_masks && self.exec.masks_on_device()
    }

    /// This engine, applying constraints' masks on the host even where the executor could
    /// apply them on the device (to compare the two; sequences added later).
    pub fn with_device_masks(mut self, on: bool) -> Self {
        self.device_masks = on;
        self
    }

    /// The constraint compiler, for compiling off the engine's thread.
    pub fn grammars(&self) -> Option<Arc<Grammars>> {
        self.grammars.clone()
    }

    /// Whatever runs this engine's steps.
    pub fn executor(&self) -> &dyn StepExecutor {
        self.exec.as_ref()
    }

    /// The longest sequence (prompt + output) this engine accepts: the model's context,
    /// `max_model_len` and what its KV cache can hold for one sequence, whichever is least.
    /// A request for more is refused when it arrives, never failed midway.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Sequences admitted or queued and not yet finished.
    /// Most sequences running at once.
    pub fn max_num_seqs(&self) -> usize {
        self.scheduler.config().max_num_seqs
    }

    pub fn num_running(&self) -> usize {
        self.scheduler.num_running() + self.scheduler.num_waiting()
    }

    pub fn num_waiting(&self) -> usize {
        self.scheduler.num_waiting()
    }

    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    /// Preemptions and prefix-cache hits so far.
    pub fn scheduler_stats(&self) -> crate::scheduler::SchedulerStats {
        self.scheduler.stats
    }

    pub fn free_blocks(&self) -> usize {
        self.scheduler.pool().num_free()
    }

    pub fn total_blocks(&self) -> usize {
        self.scheduler.pool().num_blocks()
    }

    /// The longest sequence (prompt and output) the KV cache can ever hold.
    pub fn max_kv_positions(&self) -> usize {
        self.scheduler.max_positions()
    }

    /// Positions per KV block.
    pub fn block_size(&self) -> usize {
        self.scheduler.pool().block_size()
    }

    /// Queues a sequence; it runs as soon as the scheduler admits it.
    pub fn add(&mut self, id: SeqId, prompt: Vec<u32>, params: SamplingParams) -> Result<()> {
        self.add_resumed(id, prompt, Vec::new(), params)
    }

    /// Queues a sequence whose first output tokens, `generated`, were produced elsewhere
    /// (a replica that failed mid-stream): they are prefilled with the prompt, count
    /// toward `max_new_tokens` and the penalties, and generation continues after them.
    pub fn add_resumed(
        &mut self,
        id: SeqId,
        prompt: Vec<u32>,
        generated: Vec<u32>,
        params: SamplingParams,
    ) -> Result<()> {
        let guide = prepare_guide(self.grammars.as_deref(), &params, &generated)?;
        self.add_guided(id, prompt, generated, params, guide)
    }

    /// [`Engine::add_resumed`] with the constraint's guide already compiled (by
    /// [`prepare_guide`], off the engine's thread).
    pub fn add_guided(
        &mut self,
        id: SeqId,
        prompt: Vec<u32>,
        generated: Vec<u32>,
        params: SamplingParams,
        guide: Option<Guide>,
    ) -> Result<()> {
        params.validate()?;
        if params.constraint.is_some() != guide.is_some() {
            return Err(Error::Internal("a constrained sequence without its guide".into()));
        }
        if prompt.is_empty() {
            return Err(Error::invalid("prompt", "must not be empty"));
        }
        let vocab = self.exec.config().vocab_size;
        for (field, ids) in [("prompt", &prompt), ("generated", &generated)] {
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(Error::invalid(
                    field,
                    format!("token id {bad} is outside the vocabulary (size {vocab})"),
                ));
            }
        }
        if generated.len() >= params.max_new_tokens as usize {
            return Err(Error::invalid(
                "generated",
                format!("{} tokens already reach max_tokens {}", generated.len(), params.max_new_tokens),
            ));
        }
        let total = prompt.len() + generated.len();
        if total >= self.max_context() {
            return Err(Error::invalid(
                "prompt",
                format!(
                    "{total} tokens leave no room to generate within the context of {} tokens",
                    self.max_context()
                ),
            ));
        }
        let capacity = self.scheduler.max_positions();
        if total + 1 > capacity {
            return Err(Error::invalid(
                "prompt",
                format!("{total} tokens exceed the KV cache's capacity of {capacity} positions"),
            ));
        }
        let wanted = prompt.len() + params.max_new_tokens as usize;
        if wanted > self.max_context {
            return Err(Error::invalid(
                "max_tokens",
                format!(
                    "{} after a {}-token prompt make {wanted} tokens, beyond this replica's context of {} tokens",
                    params.max_new_tokens,
                    prompt.len(),
                    self.max_context
                ),
            ));
        }
        if self.meta.contains_key(&id) {
            return Err(Error::invalid("request_id", format!("sequence {id} is already running")));
        }
        let priority = params.priority;
        // A resumed sequence's caller has its prompt logprobs already.
        let prompt_lps = params.prompt_logprobs.filter(|_| generated.is_empty());
        let mut sampler = Sampler::resume(params, &prompt, &generated);
        // Its cached prefix blocks are its salt's alone (strata_common::prefix::salt_root).
        let root = strata_common::prefix::salt_root(sampler.params().cache_salt);
        if self.masks_on_device() {
            sampler.mask_upstream();
        }
        let lps = prompt_lps.map(|n| PromptLogprobs::new(n, prompt.len()));
        let embed = match sampler.params().embed {
            Some(_) if !generated.is_empty() => {
                return Err(Error::invalid("generated", "an embedding request generates no tokens to resume"))
            }
            Some(e) => Some(Embedding::new(e, &self.embed_defaults, prompt.len())?),
            None => None,
        };
        let reads_cache = embed.as_ref().is_none_or(Embedding::reads_cache) && prompt_lps.is_none();
        let generated_len = generated.len() as u32;
        self.meta.insert(id, SeqMeta { sampler, generated: generated_len, guide, prompt: lps, embed });
        let mut tokens = prompt;
        tokens.extend(generated);
        let mut seq = SeqData::new(id, tokens).with_priority(priority);
        seq.reads_cache = reads_cache;
        seq.root = root;
        if prompt_lps.is_some() {
            seq.max_chunk = prompt::max_chunk(vocab);
        }
        self.scheduler.add(seq);
        Ok(())
    }

    /// Stops a sequence and frees its blocks; false if it was not known.
    pub fn cancel(&mut self, id: SeqId) -> bool {
        self.meta.remove(&id);
        self.scheduler.remove(id)
    }

    /// The model and replica this engine's metrics are filed under.
    pub fn labels(&self) -> &crate::metrics::ReplicaLabels {
        &self.labels
    }

    /// Sequences the last step took off the queue, in order (a preempted sequence
    /// appears again when it is readmitted).
    pub fn take_admitted(&mut self) -> Vec<SeqId> {
        std::mem::take(&mut self.admitted)
    }

    /// Tokens (prefill chunks and decodes) the last step computed.
    pub fn last_step_tokens(&self) -> usize {
        self.last_step_tokens
    }

    /// Sequences the last steps removed because they can never fit; drained by the caller.
    pub fn take_aborted(&mut self) -> Vec<Aborted> {
        std::mem::take(&mut self.aborted)
    }

    /// Runs one scheduled step and returns the tokens it produced.
    pub fn step(&mut self) -> Result<Vec<StepEvent>> {
        self.step_traced(|_| tracing::Span::none())
    }

    /// [`Engine::step`], its ranks' work inside the span `span_for` makes from the
    /// sequences the step computes (the runner's: a child of one request's trace, linked
    /// to the others').
    pub fn step_traced(
        &mut self,
        span_for: impl FnOnce(&[Scheduled]) -> tracing::Span,
    ) -> Result<Vec<StepEvent>> {
        let mut plan = self.scheduler.schedule();
        for (seq, error) in plan.aborted.drain(..) {
            self.meta.remove(&seq);
            self.aborted.push(Aborted { seq, error, non_finite: false });
        }
        if !plan.preempted.is_empty() {
            debug!(preempted = ?plan.preempted, "KV cache full: preempted for recompute");
        }
        self.admitted = std::mem::take(&mut plan.admitted);
        self.last_step_tokens = plan.num_tokens();
        if plan.seqs.is_empty() {
            return Ok(Vec::new());
        }
        let vocab = self.exec.config().vocab_size;
        let mut step = self.batch(&plan);
        step.draws = self.draws(&plan);
        step.wanted = self.logits_wanted(&plan, vocab);
        let sampled_rows = step.logit_rows.len();
        let prompt_rows = self.add_prompt_rows(&plan, &mut step);
        let hidden_rows = self.add_hidden_rows(&plan, &mut step);
        let span = span_for(&plan.seqs);
        step.trace = strata_common::trace::context_of(&span);
        let (output, masks) = self.execute_guided(&mut step, &plan, &span);
        let StepOutput { logits, drawn, hidden } = output?;
        let (rows, draws) = (step.logit_rows.len(), &step.draws);
        let returned = logits.rows(vocab);
        if returned != rows || drawn.len() != draws.len() {
            return Err(Error::Internal(format!(
                "a step returned {returned} rows and {} draws for {rows} rows and {} draws",
                drawn.len(),
                draws.len()
            )));
        }
        let mut bad_prompts = self.record_prompt_rows(&prompt_rows, &logits, sampled_rows);
        if !hidden_rows.is_empty() {
            bad_prompts.extend(self.record_hidden_rows(&hidden_rows, &hidden));
        }
        let (mut events, sampled, mut failed) = self.sample_rows(&plan, &logits, &drawn, draws, masks);
        events.retain(|e| !bad_prompts.iter().any(|b| b.seq == e.seq));
        failed.retain(|f| !bad_prompts.iter().any(|b| b.seq == f.seq));
        failed.extend(bad_prompts);
        self.scheduler.complete(&plan, &sampled);
        for e in &events {
            if e.finish.is_some() {
                self.cancel(e.seq);
            }
        }
        for f in failed {
            self.cancel(f.seq);
            self.aborted.push(f);
        }
        Ok(events)
    }

    /// Chooses the next token of every sampled row of `plan`: the events to send, the
    /// tokens for the scheduler, and the sequences that cannot go on.
    fn sample_rows(
        &mut self,
        plan: &Schedule,
        logits: &StepLogits,
        drawn: &[crate::logits::Pick],
        draws: &[Draw],
        mut masks: HashMap<SeqId, Result<TokenMask>>,
    ) -> (Vec<StepEvent>, Vec<(SeqId, u32)>, Vec<Aborted>) {
        let vocab = self.exec.config().vocab_size;
        let rows = draws.len().max(logits.rows(vocab));
        let max_context = self.max_context();
        let mut events = Vec::with_capacity(rows);
        let mut sampled = Vec::with_capacity(rows);
        let mut failed = Vec::new();
        for (row, item) in plan.seqs.iter().filter(|s| s.sample).enumerate() {
            if let Some(embed) = self.meta.get_mut(&item.id).and_then(|m| m.embed.take()) {
                sampled.push((item.id, 0));
                match embed.finish() {
                    Ok(v) => events.push(StepEvent::embedding(item.id, v)),
                    Err(error) => failed.push(Aborted { seq: item.id, error, non_finite: false }),
                }
                continue;
            }
            let mask = match masks.remove(&item.id).transpose() {
                Ok(mask) => mask,
                Err(error) => {
                    failed.push(Aborted { seq: item.id, error, non_finite: false });
                    sampled.push((item.id, 0));
                    continue;
                }
            };
            let drawn_here = draws.get(row).is_some_and(|d| d.temperature > 0.0);
            let finite = match logits {
                _ if drawn_here => drawn[row].logit.is_finite() && drawn[row].log_z.is_finite(),
                // A row masked where the logits are holds −∞ for the tokens it may not take.
                StepLogits::Full(l) => finite_row(&l[row * vocab..(row + 1) * vocab]),
                StepLogits::Greedy(p) => p[row].logit.is_finite() && p[row].log_z.is_finite(),
                StepLogits::Top(c) => c[row].finite(),
            };
            if !finite {
                // NaN weights or an out-of-domain config: never emit a token from it.
                failed.push(Aborted { seq: item.id, error: non_finite(), non_finite: true });
                sampled.push((item.id, 0));
                continue;
            }
            let meta = self.meta.get_mut(&item.id).expect("scheduled sequences have metadata");
            let (token, logprobs) = match logits {
                _ if drawn_here => meta.sampler.accept_drawn(drawn[row].token),
                StepLogits::Full(l) => meta.sampler.sample(&l[row * vocab..(row + 1) * vocab], mask.as_ref()),
                StepLogits::Greedy(p) => meta.sampler.accept(p[row]),
                StepLogits::Top(c) => meta.sampler.take(&c[row]),
            };
            meta.generated += 1;
            let guided = if let Some(guide) = &mut meta.guide {
                if let Err(error) = guide.consume(token) {
                    failed.push(Aborted { seq: item.id, error, non_finite: false });
                    sampled.push((item.id, 0));
                    continue;
                }
                Some(guide.is_stopped())
            } else {
                None
            };
            let params = meta.sampler.params();
            // A constrained sequence ends where its constraint does, whatever ignore_eos says.
            let finish = if (!params.ignore_eos || guided.is_some()) && self.eos.contains(&token) {
                Some(FinishReason::Eos)
            } else if params.stop_token_ids.contains(&token) || guided == Some(true) {
                Some(FinishReason::Stop)
            } else if meta.generated >= params.max_new_tokens || item.end + 1 >= max_context {
                Some(FinishReason::Length)
            } else {
                None
            };
            sampled.push((item.id, token));
            let prompt_logprobs = meta.prompt.as_mut().and_then(PromptLogprobs::take_done);
            if prompt_logprobs.is_some() {
                meta.prompt = None;
            }
            events.push(StepEvent {
                seq: item.id,
                token,
                logprobs,
                prompt_logprobs,
                embedding: None,
                finish,
            });
        }
        (events, sampled, failed)
    }

    /// One [`Draw`] per sampled row when the executor draws on the device and some row's
    /// sampler is [`drawable`](Sampler::drawable) (the others get [`Draw::NONE`]); else
    /// none. Each drawable row takes the next number of its sequence's stream.
    fn draws(&mut self, plan: &Schedule) -> Vec<Draw> {
        if !self.exec.draws_on_device() || self.exec.config().vocab_size >= MAX_PICK_VOCAB {
            return Vec::new();
        }
        let sampled = || plan.seqs.iter().filter(|s| s.sample);
        if !sampled().any(|s| self.meta.get(&s.id).is_some_and(|m| m.sampler.drawable())) {
            return Vec::new();
        }
        sampled()
            .map(|s| match self.meta.get_mut(&s.id) {
                Some(m) if m.sampler.drawable() => m.sampler.next_draw(),
                _ => Draw::NONE,
            })
            .collect()
    }

    /// The least of the logits a step's sampled rows need: greedy picks when every row
    /// decodes greedily, their most likely tokens when that is all any row needs (so a GPU
    /// sends candidates, not vocabularies, to the host), else the whole rows.
    fn logits_wanted(&self, plan: &Schedule, vocab: usize) -> LogitsWanted {
        if vocab >= MAX_PICK_VOCAB {
            return LogitsWanted::Full;
        }
        let mut k = 0;
        let on_device = self.exec.draws_on_device();
        for s in plan.seqs.iter().filter(|s| s.sample) {
            let sampler = self.meta.get(&s.id).map(|m| &m.sampler);
            if on_device && sampler.is_some_and(|s| s.drawable()) {
                continue; // drawn on the device: needs nothing else
            }
            match sampler.and_then(|s| s.candidates_needed()) {
                Some(n) => k = k.max(n),
                None => return LogitsWanted::Full,
            }
        }
        // k rounds up (8, 16, 32, 64, 72): a GPU then captures one decode graph per rounded
        // k, not one per mix of requests. More candidates than a sampler needs change
        // nothing (it keeps its own top k of them).
        if k == 0 {
            LogitsWanted::Greedy
        } else {
            LogitsWanted::Top(k.next_power_of_two().clamp(8, crate::logits::MAX_TOP))
        }
    }

    /// The rows of `plan`'s step that `positions` picks from each sequence's chunk
    /// `start..end` (None: none).
    fn chunk_rows(
        &self,
        plan: &Schedule,
        positions: impl Fn(&SeqMeta, usize, usize) -> Option<std::ops::Range<usize>>,
    ) -> Vec<ChunkRow> {
        let mut rows = Vec::new();
        let mut first_row = 0;
        for item in &plan.seqs {
            let picked = self.meta.get(&item.id).and_then(|m| positions(m, item.start, item.end));
            for position in picked.unwrap_or(0..0) {
                rows.push(ChunkRow { seq: item.id, position, row: first_row + position - item.start });
            }
            first_row += item.end - item.start;
        }
        rows
    }

    /// The step of `plan`: token ids, their batch layout, and the rows to sample from
    /// (whole rows, until the caller says what it needs of them).
    fn batch(&self, plan: &Schedule) -> Step {
        let pool = self.scheduler.pool();
        let mut ids = Vec::with_capacity(plan.num_tokens());
        let mut layout = BatchLayout { block_size: pool.block_size(), ..Default::default() };
        let groups = self.scheduler.num_kv_groups() - 1;
        layout.groups = vec![BatchLayout { block_size: pool.block_size(), ..Default::default() }; groups];
        let mut logit_rows = Vec::new();
        for item in &plan.seqs {
            let seq = self.scheduler.seq(item.id).expect("scheduled sequences exist");
            let start = ids.len();
            for pos in item.start..item.end {
                ids.push(seq.tokens[pos]);
                layout.positions.push(pos as u32);
                layout.slots.push(pool.slot(&seq.blocks, pos));
                for (g, table) in layout.groups.iter_mut().zip(&seq.group_blocks) {
                    g.slots.push(pool.slot(table, pos));
                }
            }
            let slice = |table: &[u32]| SeqSlice {
                token_start: start,
                num_tokens: item.end - item.start,
                context_before: item.start,
                block_table: table.to_vec(),
            };
            layout.seqs.push(slice(&seq.blocks));
            for (g, table) in layout.groups.iter_mut().zip(&seq.group_blocks) {
                g.seqs.push(slice(table));
            }
            if item.sample {
                logit_rows.push(ids.len() - 1);
            }
        }
        for g in &mut layout.groups {
            g.positions = layout.positions.clone();
        }
        Step::full_logits(ids, layout, logit_rows)
    }
}
