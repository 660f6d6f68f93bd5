//! Embedding requests: a prompt's final hidden states (after the final norm), pooled into
//! one vector — the last token's, the mean of all, or the first's — and scaled to unit
//! length where the model says so. Nothing is generated.
//!
//! The request is prefilled like any other; its chunks return the hidden states of the
//! positions its pooling reads (every position for the mean, one otherwise), which are
//! summed or kept on the host as they come, and the step that finishes the prompt answers
//! with the vector. Pooling the last token may start from a cached prefix (the last
//! position is always computed); the others compute every position. The model's defaults
//! come from its sentence-transformers files (`modules.json`, the pooling module's
//! `config.json`), else the last token, normalized — what decoder embedding models use.

use std::path::Path;

use serde_json::Value as Json;
use strata_common::files::{read_bounded, MAX_JSON_FILE};
use strata_common::{Embed, Error, Pooling, Result};

use super::{non_finite, Aborted, ChunkRow, Engine};
use crate::scheduler::Schedule;
use crate::step::Step;

/// How a model's embeddings are made unless a request says otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbedDefaults {
    /// Err: the model's pooling is one this engine does not do (named).
    pub pooling: std::result::Result<Pooling, String>,
    pub normalize: bool,
}

impl Default for EmbedDefaults {
    fn default() -> Self {
        EmbedDefaults { pooling: Ok(Pooling::Last), normalize: true }
    }
}

impl EmbedDefaults {
    /// The defaults of the model in `dir`: its sentence-transformers modules when it has
    /// them (a `Normalize` module normalizes; the pooling module's config names the mode).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let modules_path = dir.join("modules.json");
        if !modules_path.is_file() {
            return Ok(EmbedDefaults::default());
        }
        let modules = read_json(&modules_path)?;
        let Some(modules) = modules.as_array() else {
            return Err(Error::model_file(&modules_path, "not a list of modules"));
        };
        let kind = |m: &Json| m.get("type").and_then(Json::as_str).unwrap_or("").to_string();
        let normalize = modules.iter().any(|m| kind(m).ends_with("Normalize"));
        let pooling_module = modules.iter().find(|m| kind(m).ends_with("Pooling"));
        let pooling = match pooling_module.and_then(|m| m.get("path")).and_then(Json::as_str) {
            None => Ok(Pooling::Last),
            Some(path) if path.split('/').any(|p| p == "..") => {
                return Err(Error::model_file(
                    &modules_path,
                    format!("pooling path {path:?} leaves the model"),
                ))
            }
            Some(path) => pooling_of(&read_json(&dir.join(path).join("config.json"))?),
        };
        Ok(EmbedDefaults { pooling, normalize })
    }
}

fn read_json(path: &Path) -> Result<Json> {
    serde_json::from_slice(&read_bounded(path, MAX_JSON_FILE)?)
        .map_err(|e| Error::model_file(path, format!("not valid JSON: {e}")))
}

/// The pooling a sentence-transformers pooling config turns on.
fn pooling_of(config: &Json) -> std::result::Result<Pooling, String> {
    let on = |key: &str| config.get(key).and_then(Json::as_bool).unwrap_or(false);
    let modes = [
        ("pooling_mode_lasttoken", Some(Pooling::Last)),
        ("pooling_mode_mean_tokens", Some(Pooling::Mean)),
        ("pooling_mode_cls_token", Some(Pooling::Cls)),
        ("pooling_mode_max_tokens", None),
        ("pooling_mode_mean_sqrt_len_tokens", None),
        ("pooling_mode_weightedmean_tokens", None),
    ];
    let chosen: Vec<_> = modes.iter().filter(|(k, _)| on(k)).collect();
    match chosen[..] {
        [(_, Some(p))] => Ok(*p),
        [(k, None)] => Err(format!("the model pools by {k}")),
        [] => Ok(Pooling::Last),
        _ => Err("the model concatenates several poolings".into()),
    }
}

/// One embedding request's state while its prompt is computed.
pub(super) struct Embedding {
    pooling: Pooling,
    normalize: bool,
    prompt_len: usize,
    /// Mean pooling: the sum of positions `0..summed`.
    sum: Vec<f64>,
    summed: usize,
    /// Last or first pooling: the position's hidden state.
    kept: Option<Vec<f32>>,
}

impl Embedding {
    /// The state of a request for `embed` of a `prompt_len`-token prompt under `defaults`.
    pub(super) fn new(embed: Embed, defaults: &EmbedDefaults, prompt_len: usize) -> Result<Self> {
        let pooling = match (embed.pooling, &defaults.pooling) {
            (Some(p), _) => p,
            (None, Ok(p)) => *p,
            (None, Err(why)) => {
                return Err(Error::Unsupported(format!("{why}: ask for pooling last, mean or cls")))
            }
        };
        let normalize = embed.normalize.unwrap_or(defaults.normalize);
        Ok(Embedding { pooling, normalize, prompt_len, sum: Vec::new(), summed: 0, kept: None })
    }

    /// Whether the request may start from cached blocks (only the last position is read).
    pub(super) fn reads_cache(&self) -> bool {
        self.pooling == Pooling::Last
    }

    /// Positions of the chunk `start..end` whose hidden states it needs.
    fn positions(&self, start: usize, end: usize) -> std::ops::Range<usize> {
        match self.pooling {
            Pooling::Last => {
                let last = self.prompt_len - 1;
                if (start..end).contains(&last) {
                    last..last + 1
                } else {
                    0..0
                }
            }
            Pooling::Mean => start.max(self.summed).min(end)..end,
            Pooling::Cls => 0..usize::from(start == 0 && self.kept.is_none()),
        }
    }

    fn take(&mut self, position: usize, row: &[f32]) {
        match self.pooling {
            Pooling::Mean if position == self.summed => {
                self.sum.resize(row.len(), 0.0);
                self.sum.iter_mut().zip(row).for_each(|(s, &x)| *s += x as f64);
                self.summed += 1;
            }
            Pooling::Mean => {}
            Pooling::Last | Pooling::Cls => self.kept = Some(row.to_vec()),
        }
    }

    /// The pooled vector, once the prompt is computed.
    pub(super) fn finish(self) -> Result<Vec<f32>> {
        let mut v = match self.pooling {
            Pooling::Mean if self.summed == self.prompt_len => {
                self.sum.iter().map(|&s| (s / self.summed as f64) as f32).collect()
            }
            Pooling::Last | Pooling::Cls if self.kept.is_some() => self.kept.unwrap_or_default(),
            _ => return Err(Error::Internal("an embedding finished before its prompt was computed".into())),
        };
        if self.normalize {
            let norm = v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt();
            if norm > 0.0 {
                v.iter_mut().for_each(|x| *x = (*x as f64 / norm) as f32);
            }
        }
        Ok(v)
    }
}

impl Engine {
    /// The rows of `step` whose hidden states its embedding requests need.
    pub(super) fn add_hidden_rows(&self, plan: &Schedule, step: &mut Step) -> Vec<ChunkRow> {
        let rows = self.chunk_rows(plan, |m, start, end| m.embed.as_ref().map(|e| e.positions(start, end)));
        step.hidden_rows.extend(rows.iter().map(|r| r.row));
        rows
    }

    /// Pools the hidden states `hidden` of `rows`; the requests whose states are not
    /// finite, or that came back short, cannot go on.
    pub(super) fn record_hidden_rows(&mut self, rows: &[ChunkRow], hidden: &[f32]) -> Vec<Aborted> {
        let mut failed: Vec<Aborted> = Vec::new();
        let width = self.exec.config().hidden_size;
        if hidden.len() != rows.len() * width {
            let why = format!("a step returned {} hidden values for {} rows", hidden.len(), rows.len());
            for r in rows.iter().filter(|r| !failed.iter().any(|f| f.seq == r.seq)).collect::<Vec<_>>() {
                failed.push(Aborted { seq: r.seq, error: Error::Internal(why.clone()), non_finite: false });
            }
            return failed;
        }
        for (r, row) in rows.iter().zip(hidden.chunks_exact(width.max(1))) {
            if !row.iter().all(|x| x.is_finite()) {
                if !failed.iter().any(|f| f.seq == r.seq) {
                    failed.push(Aborted { seq: r.seq, error: non_finite(), non_finite: true });
                }
            } else if let Some(e) = self.meta.get_mut(&r.seq).and_then(|m| m.embed.as_mut()) {
                e.take(r.position, row);
            }
        }
        failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(pooling: Pooling, normalize: bool, len: usize) -> Embedding {
        let embed = Embed { pooling: Some(pooling), normalize: Some(normalize) };
        Embedding::new(embed, &EmbedDefaults::default(), len).unwrap()
    }

    #[test]
    fn each_pooling_reads_its_positions_once_whatever_the_chunks() {
        let mut mean = state(Pooling::Mean, false, 4);
        assert_eq!(mean.positions(0, 3), 0..3);
        for p in 0..3 {
            mean.take(p, &[p as f32, 1.0]);
        }
        assert_eq!(mean.positions(0, 3), 3..3, "a recomputed chunk adds nothing");
        mean.take(1, &[100.0, 100.0]);
        assert_eq!(mean.positions(3, 4), 3..4);
        mean.take(3, &[3.0, 1.0]);
        assert_eq!(mean.finish().unwrap(), [1.5, 1.0]);
        let last = state(Pooling::Last, true, 4);
        assert_eq!((last.positions(0, 3), last.positions(2, 4)), (0..0, 3..4));
        assert!(last.reads_cache());
        let mut cls = state(Pooling::Cls, true, 4);
        assert_eq!(cls.positions(0, 2), 0..1);
        cls.take(0, &[3.0, 4.0]);
        assert_eq!((cls.positions(0, 2), cls.positions(2, 4)), (0..0, 0..0));
        assert_eq!(cls.finish().unwrap(), [0.6, 0.8]);
        assert!(state(Pooling::Mean, true, 2).finish().is_err(), "not computed yet");
    }

    #[test]
    fn sentence_transformers_configs_choose_the_pooling() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(EmbedDefaults::from_dir(dir.path()).unwrap(), EmbedDefaults::default());
        let modules = r#"[{"idx":0,"path":"","type":"sentence_transformers.models.Transformer"},
            {"idx":1,"path":"1_Pooling","type":"sentence_transformers.models.Pooling"}]"#;
        std::fs::write(dir.path().join("modules.json"), modules).unwrap();
        std::fs::create_dir(dir.path().join("1_Pooling")).unwrap();
        let write = |cfg: &str| std::fs::write(dir.path().join("1_Pooling/config.json"), cfg).unwrap();
        write(r#"{"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": false}"#);
        let d = EmbedDefaults::from_dir(dir.path()).unwrap();
        assert_eq!((d.pooling, d.normalize), (Ok(Pooling::Mean), false));
        write(r#"{"pooling_mode_max_tokens": true}"#);
        let d = EmbedDefaults::from_dir(dir.path()).unwrap();
        assert!(d.pooling.as_ref().is_err_and(|e| e.contains("max")), "{d:?}");
        let e = Embedding::new(Embed::default(), &d, 3).err().unwrap().to_string();
        assert!(e.contains("max") && e.contains("pooling"), "{e}");
        let bad = r#"[{"path":"../x","type":"sentence_transformers.models.Pooling"}]"#;
        std::fs::write(dir.path().join("modules.json"), bad).unwrap();
        assert!(EmbedDefaults::from_dir(dir.path()).is_err());
    }
}
