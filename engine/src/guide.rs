//! Constrained decoding: each step, the tokens a sequence's [`Constraint`] still allows.
//!
//! [`Grammars`] is built once per replica from the model's `tokenizer.json` (the bytes of
//! every token, as a trie) and compiles constraints with llguidance: a JSON schema, a
//! regex, a choice list or a Lark grammar becomes a parser over the token trie. Compiled
//! parsers are cached by constraint (bounded; failures too, so a hostile schema sent again
//! costs nothing), and llguidance's fuel limits bound what one compile or one mask may
//! cost, so a schema built to explode is refused with a clear error instead of a hang.
//!
//! A [`Guide`] is one sequence's parser state. The engine computes its [`TokenMask`] on a
//! helper thread while the step's forward pass runs, applies it to the row's logits before
//! the sampler draws, and feeds the drawn token back. After failover the guide is rebuilt
//! by replaying the tokens the caller already has, so the continuation stays inside the
//! constraint. llguidance computes a mask in tens of microseconds for a 128k vocabulary;
//! its design note (the Earley parser over a lexer, masks from the token trie) is the
//! idea we build on.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};
use strata_common::{Constraint, Error, Result, SamplingParams};
use tracing::{debug, warn};

/// Compiled constraints kept per replica.
const CACHE_ENTRIES: usize = 256;

/// The constraint compiler of one replica: the tokenizer's trie and a cache.
pub struct Grammars {
    factory: ParserFactory,
    /// The model's end-of-sequence ids: all are allowed wherever the grammar may end.
    eos: Arc<[u32]>,
    cache: Mutex<Cache>,
}

#[derive(Default)]
struct Cache {
    compiled: HashMap<Constraint, std::result::Result<TokenParser, String>>,
    order: VecDeque<Constraint>,
}

impl Grammars {
    /// The compiler for the model in `dir`: None when it has no `tokenizer.json` (the
    /// replica then refuses constrained requests, naming why).
    pub fn from_dir(dir: &Path, vocab_size: usize, eos: &[u32]) -> Result<Option<Self>> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Error::invalid("tokenizer.json", format!("cannot read {}: {e}", path.display())))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::invalid("tokenizer.json", format!("not valid JSON: {e}")))?;
        Self::from_tokenizer_json(&json, vocab_size, eos).map(Some)
    }

    /// The compiler for a vocabulary of `vocab_size` ids (the model's; ids the tokenizer
    /// does not name are never allowed) whose token bytes `tokenizer.json` gives.
    pub fn from_tokenizer_json(json: &serde_json::Value, vocab_size: usize, eos: &[u32]) -> Result<Self> {
        let bad = |why: String| Error::invalid("tokenizer.json", why);
        // The reader asserts on shapes it does not know; a model file is not worth a panic.
        let bytes = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(json))
            .map_err(|_| bad("its vocabulary has a form constrained decoding cannot read".into()))?
            .map_err(|e| bad(format!("constrained decoding cannot read its vocabulary: {e}")))?;
        let mut words = bytes;
        words.resize(vocab_size, Vec::new());
        let tok_eos = *eos.iter().find(|&&t| (t as usize) < vocab_size).ok_or_else(|| {
            Error::invalid(
                "eos_token_id",
                "constrained decoding needs an end-of-sequence token in the vocabulary",
            )
        })?;
        let info = TokRxInfo::new(vocab_size as u32, tok_eos);
        let trie = TokTrie::from(&info, &words);
        let env: Arc<dyn TokenizerEnv + Sync> = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| Error::Internal(format!("constrained decoding: {e}")))?;
        factory.quiet();
        Ok(Grammars { factory, eos: eos.into(), cache: Mutex::default() })
    }

    /// A guide for `constraint` past the tokens already `generated` (failover): the
    /// compile is cached; an error names the caller's field.
    pub fn guide(&self, constraint: &Constraint, generated: &[u32]) -> Result<Guide> {
        let parser = self.compiled(constraint)?;
        let mut matcher = Matcher::new(Ok(parser));
        if !generated.is_empty() {
            matcher.consume_tokens(generated).map_err(|e| {
                Error::invalid(
                    "generated",
                    format!("the tokens already generated do not follow the constraint: {e}"),
                )
            })?;
        }
        Ok(Guide { matcher, eos: self.eos.clone(), field: constraint.field() })
    }

    /// Constraints compiled (or refused) and kept.
    pub fn cached(&self) -> usize {
        self.cache.lock().expect("grammar cache").compiled.len()
    }

    /// The bytes of `tokens` (what the caller's text will be).
    pub fn decode(&self, tokens: &[u32]) -> Vec<u8> {
        self.factory.tok_env().tok_trie().decode(tokens)
    }

    /// A fresh parser for `constraint`, compiled once and cloned from the cache after.
    fn compiled(&self, constraint: &Constraint) -> Result<TokenParser> {
        constraint.validate()?;
        let field = constraint.field();
        if let Some(hit) = self.cache.lock().expect("grammar cache").compiled.get(constraint) {
            return hit.as_ref().map(TokenParser::deep_clone).map_err(|e| Error::invalid(field, e.clone()));
        }
        let started = Instant::now();
        let compiled = grammar(constraint)
            .and_then(|g| self.factory.create_parser(g).map_err(|e| e.to_string()))
            .map_err(|e| format!("the constraint cannot be compiled: {e}"));
        let ms = started.elapsed().as_secs_f64() * 1e3;
        match &compiled {
            Ok(_) => debug!(field, ms, "constraint compiled"),
            Err(e) => warn!(field, ms, error = %e, "constraint refused"),
        }
        let out =
            compiled.as_ref().map(TokenParser::deep_clone).map_err(|e| Error::invalid(field, e.clone()));
        let mut cache = self.cache.lock().expect("grammar cache");
        if cache.order.len() >= CACHE_ENTRIES {
            if let Some(old) = cache.order.pop_front() {
                cache.compiled.remove(&old);
            }
        }
        if cache.compiled.insert(constraint.clone(), compiled).is_none() {
            cache.order.push_back(constraint.clone());
        }
        out
    }
}

/// The llguidance grammar of a constraint. JSON is compact (no free whitespace between
/// tokens), so a model cannot pad forever, unless the schema says otherwise (llguidance's
/// `x-guidance` options).
fn grammar(c: &Constraint) -> std::result::Result<TopLevelGrammar, String> {
    Ok(match c {
        Constraint::JsonObject => {
            TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
        }
        Constraint::JsonSchema(s) => {
            let schema: serde_json::Value = serde_json::from_str(s).map_err(|e| e.to_string())?;
            TopLevelGrammar::from_json_schema(compact(schema))
        }
        Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
        Constraint::Choice(options) => {
            let alternatives: Vec<String> = options.iter().map(|o| escape_regex(o)).collect();
            TopLevelGrammar::from_regex(&alternatives.join("|"))
        }
        Constraint::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
    })
}

fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}

/// `s` as a regex that matches it literally.
fn escape_regex(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The guide a sequence with `params` needs (None when it has no constraint), past the
/// tokens already `generated`; an error when the replica cannot compile constraints.
pub fn prepare_guide(
    grammars: Option<&Grammars>,
    params: &SamplingParams,
    generated: &[u32],
) -> Result<Option<Guide>> {
    let Some(constraint) = &params.constraint else { return Ok(None) };
    let grammars = grammars.ok_or_else(|| {
        Error::invalid(
            constraint.field(),
            "this model has no tokenizer.json that constrained decoding can read",
        )
    })?;
    grammars.guide(constraint, generated).map(Some)
}

/// One sequence's position in its constraint.
pub struct Guide {
    matcher: Matcher,
    eos: Arc<[u32]>,
    /// The caller's field the constraint came in: the parser's limits are the caller's
    /// grammar's (an over-ambiguous one gives up), so its errors are invalid input there.
    field: &'static str,
}

impl Guide {
    /// The tokens allowed next (every end-of-sequence id where the output may end).
    pub fn mask(&mut self) -> Result<TokenMask> {
        let mut allowed = self.matcher.compute_mask_or_eos().map_err(|e| {
            Error::invalid(self.field, format!("the constraint's parser gave up on it: {e} (simplify it)"))
        })?;
        if self.eos.iter().any(|&t| allowed.is_allowed(t)) {
            for &t in self.eos.iter() {
                if (t as usize) < allowed.len() {
                    allowed.allow_token(t);
                }
            }
        }
        if allowed.is_zero() {
            return Err(Error::invalid(self.field, "the constraint allows no token of this model here"));
        }
        Ok(TokenMask(allowed))
    }

    /// Advances past `token` (one the mask allowed; an end-of-sequence id ends it).
    pub fn consume(&mut self, token: u32) -> Result<()> {
        if self.eos.contains(&token) {
            return Ok(());
        }
        let field = self.field;
        self.matcher
            .consume_token(token)
            .map_err(|e| Error::invalid(field, format!("the constraint's parser gave up on it: {e}")))
    }

    /// Whether the constraint is complete and allows nothing more.
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide").field("stopped", &self.is_stopped()).finish_non_exhaustive()
    }
}

/// The tokens a constraint allows at one step.
pub struct TokenMask(SimpleVob);

impl TokenMask {
    /// A mask of a `vocab`-token vocabulary allowing `ids`.
    pub fn from_ids(vocab: usize, ids: &[u32]) -> Self {
        let mut v = SimpleVob::alloc(vocab);
        for &t in ids.iter().filter(|&&t| (t as usize) < vocab) {
            v.allow_token(t);
        }
        TokenMask(v)
    }

    /// The mask as `u32` words (token `t` is bit `t % 32` of word `t / 32`).
    pub fn words(&self) -> &[u32] {
        self.0.as_slice()
    }

    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }

    /// The allowed ids, ascending.
    pub fn allowed(&self) -> Vec<u32> {
        let mut out = Vec::new();
        self.0.iter_set_entries(|i| out.push(i as u32));
        out
    }

    /// Sets every disallowed logit to −∞ (a row longer than the mask is cut to it).
    pub fn apply(&self, logits: &mut [f32]) {
        for (i, l) in logits.iter_mut().enumerate() {
            if !self.allows(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests;
