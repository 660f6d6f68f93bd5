//! `strata model random`: a random-weight model directory with a real tokenizer.
//!
//! The weights come from [`RandomModelSpec`]; the tokenizer is a byte-level BPE trained
//! by the `tokenizers` crate on a small built-in text, then padded with made-up words up to
//! the model's vocabulary so every id the model can produce decodes to readable text.
//! transformers loads the result with `AutoTokenizer` and `AutoModelForCausalLM`.

use std::path::Path;

use serde_json::{json, Value};
use strata_common::{Architecture, Error, Result};
use strata_engine::model::random::RandomModelSpec;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

const CORPUS: &str = "Strata serves large language models from a cluster of machines. \
A coordinator takes requests from services and routes them to replicas of the model; each \
replica is a group of workers that hold one shard of the weights. The workers run the forward \
pass and exchange activations with each other. When a machine dies, the requests it was \
serving continue on another replica without losing a token. The quick brown fox jumps over \
the lazy dog. Numbers such as 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in text, and so do \
punctuation marks: commas, periods, questions? answers! (parentheses) and \"quotes\". \
Once upon a time there was a small model that wanted to generate the same tokens as the \
reference, token for token, and it did so quickly, on every machine it was given. \
Café, naïve, über, 日本語, emoji 🙂 and other characters outside ASCII are text too.";

const SPECIALS: [&str; 3] = ["<unk>", "<s>", "</s>"];

/// Writes the model and its tokenizer into `dir`.
pub fn write_random_model(
    spec: &RandomModelSpec,
    dir: &Path,
    progress: impl FnMut(usize, usize),
) -> Result<()> {
    spec.write(dir, progress)?;
    write_tokenizer(dir, spec.vocab, spec.arch)
}

/// The chat template random models get (ChatML, as Qwen's).
const CHATML: &str = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

fn write_tokenizer(dir: &Path, vocab: usize, arch: Architecture) -> Result<()> {
    let min_vocab = SPECIALS.len() + 256;
    if vocab < min_vocab {
        return Err(Error::invalid(
            "vocab",
            format!("must be at least {min_vocab} for a byte-level tokenizer"),
        ));
    }
    let trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab.min(1024))
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(SPECIALS.iter().map(|s| AddedToken::from(*s, true)).collect())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut trainer: TrainerWrapper = trainer.into();
    let mut tok = Tokenizer::new(BPE::default());
    tok.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tok.with_decoder(Some(ByteLevel::default()));
    tok.train(&mut trainer, CORPUS.split(". ").map(str::to_owned))
        .map_err(|e| Error::Internal(format!("training the tokenizer: {e}")))?;
    let text =
        tok.to_string(false).map_err(|e| Error::Internal(format!("serialising the tokenizer: {e}")))?;
    let mut value: Value = serde_json::from_str(&text).map_err(|e| Error::Internal(e.to_string()))?;

    // Pad the vocabulary with pronounceable filler words (no merges produce them; they
    // exist so that random models decode every id to something readable).
    let model_vocab = value["model"]["vocab"]
        .as_object_mut()
        .ok_or_else(|| Error::Internal("tokenizer has no vocab".into()))?;
    let mut next = model_vocab.len();
    let syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po", "da", "fe"];
    let mut i = 0usize;
    while next < vocab {
        let mut word = String::from("\u{120}"); // byte-level form of a leading space
        let mut n = i;
        loop {
            word.push_str(syllables[n % syllables.len()]);
            n /= syllables.len();
            if n == 0 {
                break;
            }
        }
        i += 1;
        if !model_vocab.contains_key(&word) {
            model_vocab.insert(word, json!(next));
            next += 1;
        }
    }
    // Llama, Mistral and Mixtral prepend BOS; the Qwen families do not.
    if !matches!(arch, Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe) {
        value["post_processor"] = json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        });
    }
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, serde_json::to_string(&value).expect("JSON"))
        .map_err(|e| Error::model_file(&path, format!("cannot write: {e}")))?;
    let cfg_path = dir.join("tokenizer_config.json");
    let cfg = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": !matches!(arch, Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe),
        "model_max_length": 1_000_000,
        // ChatML, so /v1/chat/completions works on a random model as on a real one.
        "chat_template": CHATML,
    });
    std::fs::write(&cfg_path, cfg.to_string())
        .map_err(|e| Error::model_file(&cfg_path, format!("cannot write: {e}")))?;
    Ok(())
}
