//! `strata model compare`: how far one numeric setting moves a model from another (e.g.
//! `--quantize int8` against the checkpoint's dtype): greedy agreement over a prompt set
//! and the log-likelihood of a fixed text, both computed in-process on the same weights.
//! And `strata model quantize`, which writes the int8 copy such a comparison measures.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;
use strata_common::config::EngineSettings;
use strata_common::Parallelism;
use strata_coordinator::request::tokenizer::Tokenizer;
use strata_engine::replica::local_replica;

use crate::config_args::{in_process_config, EngineArgs};
use crate::gpu_check::greedy;

/// The text scored when no --text is given: plain English prose.
const DEFAULT_TEXT: &str = "The river ran low that summer, and the children of the village \
walked along its bed collecting stones. Each evening they laid their finds on the steps of the \
old mill and argued about which were the most beautiful. The miller, who had not turned his \
wheel in years, listened from his window and sometimes came down to settle a dispute. He knew \
the names of the rocks and where the water had carried them from, and by the end of August \
the children knew them too.";

#[derive(Args, Debug)]
pub struct CompareArgs {
    /// Model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// The candidate's engine, as `serve` takes it: the flags that differ from the
    /// reference's are the comparison (here `--quantize` means int8 when left out).
    #[command(flatten)]
    pub engine: EngineArgs,
    /// The reference's dtype (auto: the checkpoint's); the reference is never quantized.
    #[arg(long, default_value = "auto")]
    pub reference_dtype: String,
    /// Prompts for the greedy agreement (random token ids, seeded).
    #[arg(long, default_value_t = 16)]
    pub prompts: usize,
    /// Tokens in each random prompt.
    #[arg(long, default_value_t = 16)]
    pub prompt_len: usize,
    /// Greedy tokens generated per prompt.
    #[arg(long, default_value_t = 32)]
    pub tokens: u32,
    /// A text file to score (default: a built-in paragraph), tokenized by the model's
    /// tokenizer and cut at 1024 tokens.
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Seed of the random prompts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Debug, Serialize)]
pub struct CompareReport {
    pub prompts: usize,
    pub tokens_per_prompt: u32,
    /// Greedy tokens equal to the reference's before the first difference, over all
    /// generated tokens.
    pub greedy_agreement: f64,
    /// Prompts whose whole greedy continuation is identical.
    pub identical_continuations: usize,
    pub text_tokens: usize,
    /// Mean log-probability per token of the text (natural log).
    pub reference_mean_logprob: f64,
    pub candidate_mean_logprob: f64,
    /// Candidate minus reference mean negative log-likelihood per token.
    pub nll_difference_per_token: f64,
    pub reference_perplexity: f64,
    pub candidate_perplexity: f64,
}

pub fn run(args: CompareArgs) -> anyhow::Result<()> {
    if args.prompts == 0 || args.prompt_len == 0 || args.tokens == 0 {
        bail!("--prompts, --prompt-len and --tokens must be at least 1");
    }
    let text = match &args.text {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("--text {}", path.display()))?,
        None => DEFAULT_TEXT.to_string(),
    };
    let tokenizer = Tokenizer::from_dir(&args.model).context("the model's tokenizer")?;
    let mut text_ids = tokenizer.encode(&text, 1 << 20).context("--text")?;
    text_ids.truncate(1024);
    if text_ids.len() < 2 {
        bail!("--text: fewer than 2 tokens to score");
    }
    let mut settings = EngineSettings { quantize: "int8".into(), ..EngineSettings::default() };
    args.engine.apply(&mut settings);
    let candidate_config = in_process_config(settings.clone())?;
    let reference_config = in_process_config(EngineSettings {
        dtype: args.reference_dtype.clone(),
        quantize: "none".into(),
        ..settings
    })
    .context("--reference-dtype")?;
    tracing::info!(model = %args.model.display(), "loading the reference");
    let mut reference = local_replica(&args.model, Parallelism::NONE, &reference_config)?;
    let backend = &candidate_config.backend;
    tracing::info!(quantize = ?backend.quantize, dtype = ?backend.dtype, "loading the candidate");
    let mut candidate = local_replica(&args.model, Parallelism::NONE, &candidate_config)?;

    let vocab = strata_common::ModelConfig::from_dir(&args.model)?.vocab_size as u64;
    let (mut agree, mut identical) = (0usize, 0usize);
    let mut rng = args.seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    for p in 0..args.prompts {
        let prompt: Vec<u32> = (0..args.prompt_len)
            .map(|_| {
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                3 + ((rng >> 33) % (vocab - 3)) as u32
            })
            .collect();
        let want = greedy(&mut reference, &prompt, args.tokens)?;
        let got = greedy(&mut candidate, &prompt, args.tokens)?;
        let same = want.iter().zip(&got).take_while(|(a, b)| a == b).count();
        agree += same;
        identical += usize::from(same == want.len());
        tracing::info!(prompt = p + 1, of = args.prompts, agreeing_tokens = same, "greedy agreement");
    }
    let mean = |v: Vec<f64>| v.iter().sum::<f64>() / v.len() as f64;
    let reference_lp = mean(reference.token_logprobs(&text_ids)?);
    let candidate_lp = mean(candidate.token_logprobs(&text_ids)?);
    let report = CompareReport {
        prompts: args.prompts,
        tokens_per_prompt: args.tokens,
        greedy_agreement: agree as f64 / (args.prompts as f64 * args.tokens as f64),
        identical_continuations: identical,
        text_tokens: text_ids.len(),
        reference_mean_logprob: reference_lp,
        candidate_mean_logprob: candidate_lp,
        nll_difference_per_token: reference_lp - candidate_lp,
        reference_perplexity: (-reference_lp).exp(),
        candidate_perplexity: (-candidate_lp).exp(),
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// Model directory to quantize.
    #[arg(long)]
    pub model: PathBuf,
    /// New directory for the int8 copy (created if missing).
    #[arg(long)]
    pub out: PathBuf,
}

pub fn quantize(args: QuantizeArgs) -> anyhow::Result<()> {
    let mut last = usize::MAX;
    let report = strata_engine::model::quantize::write_int8(&args.model, &args.out, |done, total| {
        let pct = done * 100 / total.max(1);
        if pct / 10 != last / 10 {
            last = pct;
            tracing::info!(done, total, "quantizing: {pct}%");
        }
    })
    .with_context(|| format!("--model {} --out {}", args.model.display(), args.out.display()))?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}
