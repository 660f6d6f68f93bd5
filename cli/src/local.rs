//! Running one generation in-process: tokenizer, engine and text stream together.
//!
//! This is the path `strata generate` takes without `--endpoint`. It is the same loop a
//! server runs per request, minus the network: add the sequence, step the engine, feed
//! each token to the text stream, stop on a stop string.

use std::path::Path;

use serde::Serialize;
use strata_common::Parallelism;
use strata_common::{Error, FinishReason, Result, SamplingParams};
use strata_engine::replica::local_replica;
use strata_engine::{Engine, EngineConfig, TokenLogprobs};

use strata_coordinator::request::text::TextStream;
use strata_coordinator::request::tokenizer::Tokenizer;

/// What a prompt is given as.
#[derive(Debug, Clone)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

/// The result of one generation; serialises to the CLI's JSON contract.
#[derive(Debug, Clone, Serialize)]
pub struct GenerateOutput {
    pub prompt_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<LogprobEntry>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LogprobEntry {
    pub token_id: u32,
    pub logprob: f32,
    /// `[token_id, logprob]` pairs, most likely first.
    pub top: Vec<(u32, f32)>,
}

impl From<TokenLogprobs> for LogprobEntry {
    fn from(l: TokenLogprobs) -> Self {
        LogprobEntry { token_id: l.token_id, logprob: l.logprob, top: l.top }
    }
}

/// A model loaded in this process, ready to generate.
pub struct LocalModel {
    pub engine: Engine,
    pub tokenizer: Option<Tokenizer>,
}

impl LocalModel {
    pub fn load(dir: &Path, engine_config: &EngineConfig) -> Result<Self> {
        Self::load_parallel(dir, Parallelism::NONE, engine_config)
    }

    /// Loads the model as a `tp × pp` replica whose ranks are threads of this process.
    pub fn load_parallel(dir: &Path, par: Parallelism, engine_config: &EngineConfig) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::model_file(dir, crate::serve_cli::not_a_model_dir(dir)));
        }
        let engine = local_replica(dir, par, engine_config)?;
        let tokenizer =
            if dir.join("tokenizer.json").exists() { Some(Tokenizer::from_dir(dir)?) } else { None };
        Ok(LocalModel { engine, tokenizer })
    }

    fn tokenizer(&self, why: &str) -> Result<&Tokenizer> {
        self.tokenizer
            .as_ref()
            .ok_or_else(|| Error::invalid(why, "the model directory has no tokenizer.json"))
    }

    /// Runs one generation to the end; `on_text` sees each text delta as it is produced.
    pub fn generate(
        &mut self,
        prompt: Prompt,
        params: SamplingParams,
        mut on_text: impl FnMut(&str),
    ) -> Result<GenerateOutput> {
        let prompt_ids = match prompt {
            Prompt::Text(t) => {
                if t.is_empty() {
                    return Err(Error::invalid("prompt", "must not be empty"));
                }
                let context = self.engine.max_context();
                self.tokenizer("prompt")?.encode(&t, context)?
            }
            Prompt::Ids(ids) => ids,
        };
        if !params.stop.is_empty() {
            self.tokenizer("stop")?;
        }
        let want_logprobs = params.logprobs.is_some();
        let stop = params.stop.clone();
        const SEQ: strata_engine::SeqId = strata_engine::SeqId(0);
        self.engine.add(SEQ, prompt_ids.clone(), params)?;
        let mut stream = self.tokenizer.as_ref().map(|t| TextStream::new(t, stop));
        let mut token_ids = Vec::new();
        let mut logprobs = Vec::new();
        let finish_reason = 'run: loop {
            for event in self.engine.step()? {
                token_ids.push(event.token);
                if let Some(l) = event.logprobs {
                    logprobs.push(LogprobEntry::from(l));
                }
                if let Some(s) = stream.as_mut() {
                    let delta = s.push(event.token)?;
                    on_text(&delta.text);
                    if delta.stopped {
                        self.engine.cancel(SEQ);
                        break 'run FinishReason::Stop;
                    }
                }
                if let Some(f) = event.finish {
                    break 'run f;
                }
            }
            // A sequence the engine gave up on (NaN logits, a cache that cannot hold it)
            // ends the generation with its error; it would never emit another event.
            if let Some(a) = self.engine.take_aborted().into_iter().find(|a| a.seq == SEQ) {
                return Err(a.error);
            }
            if !self.engine.has_work() {
                return Err(Error::Internal("the engine stopped the sequence without finishing it".into()));
            }
        };
        let text = match stream.as_mut() {
            Some(s) => {
                on_text(&s.finish()?.text);
                s.text().to_string()
            }
            None => String::new(),
        };
        Ok(GenerateOutput {
            prompt_ids,
            token_ids,
            text,
            finish_reason,
            logprobs: want_logprobs.then_some(logprobs),
        })
    }
}
