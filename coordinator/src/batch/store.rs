//! The batch API's files and jobs on disk, under the coordinator's data directory:
//!
//! ```text
//! files/<id>.json    a file's object (what GET /v1/files/<id> answers)
//! files/<id>.data    its bytes
//! batches/<id>.json  a batch's object, rewritten (atomically) as it progresses
//! ```
//!
//! A batch's results are appended to its output and error files as each request ends, one
//! line per request; after a restart the lines already there say which requests are done
//! (a half-written last line, from a process killed mid-write, is cut off).

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use strata_common::{Error, Result};

use crate::tenant::Owner;

/// A file object, as OpenAI's API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileObject {
    pub id: String,
    pub object: String,
    pub bytes: u64,
    pub created_at: u64,
    pub filename: String,
    pub purpose: String,
    pub status: String,
    /// The tenant that owns the file (only it sees the file).
    #[serde(default = "default_tenant")]
    pub tenant: String,
    /// Which creation of that tenant ([`Owner`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tenant_incarnation: String,
}

impl FileObject {
    /// What the file costs its tenant's quota: its bytes and its name's.
    pub fn charged(&self) -> u64 {
        self.bytes + self.filename.len() as u64
    }
}

/// Longest file name an upload may give, bytes (as a file system's).
pub const MAX_FILENAME_BYTES: usize = 255;

/// Most `metadata` pairs of a batch, and their keys' and values' longest (OpenAI's).
pub const MAX_METADATA_PAIRS: usize = 16;
pub const MAX_METADATA_KEY: usize = 64;
pub const MAX_METADATA_VALUE: usize = 512;

/// A batch's `metadata`: an object of at most [`MAX_METADATA_PAIRS`] string values, keys of
/// at most [`MAX_METADATA_KEY`] bytes and values of at most [`MAX_METADATA_VALUE`].
pub fn check_metadata(m: &Json) -> Result<()> {
    let Json::Object(pairs) = m else {
        return Err(Error::invalid("metadata", "metadata must be an object of strings"));
    };
    if pairs.len() > MAX_METADATA_PAIRS {
        return Err(Error::invalid(
            "metadata",
            format!("{} pairs; at most {MAX_METADATA_PAIRS}", pairs.len()),
        ));
    }
    for (k, v) in pairs {
        if k.len() > MAX_METADATA_KEY {
            return Err(Error::invalid(
                "metadata",
                format!("a key of {} bytes; at most {MAX_METADATA_KEY}", k.len()),
            ));
        }
        match v {
            Json::String(v) if v.len() <= MAX_METADATA_VALUE => {}
            Json::String(v) => {
                return Err(Error::invalid(
                    format!("metadata.{k}"),
                    format!("a value of {} bytes; at most {MAX_METADATA_VALUE}", v.len()),
                ))
            }
            _ => return Err(Error::invalid(format!("metadata.{k}"), "metadata values must be strings")),
        }
    }
    Ok(())
}

fn default_tenant() -> String {
    strata_common::tenant::DEFAULT_TENANT.to_string()
}

/// How many of a batch's requests ended, and how.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Counts {
    pub total: u64,
    pub completed: u64,
    pub failed: u64,
}

/// A batch object, as OpenAI's API shows it (and as it is kept).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchObject {
    pub id: String,
    pub object: String,
    pub endpoint: String,
    pub errors: Option<Json>,
    pub input_file_id: String,
    pub completion_window: String,
    pub status: String,
    pub output_file_id: Option<String>,
    pub error_file_id: Option<String>,
    pub created_at: u64,
    pub in_progress_at: Option<u64>,
    pub expires_at: Option<u64>,
    pub finalizing_at: Option<u64>,
    pub completed_at: Option<u64>,
    pub failed_at: Option<u64>,
    pub expired_at: Option<u64>,
    pub cancelling_at: Option<u64>,
    pub cancelled_at: Option<u64>,
    pub request_counts: Counts,
    pub metadata: Option<Json>,
    /// The tenant that created the batch: only it sees the batch, its requests run (and
    /// are accounted) as that tenant's.
    #[serde(default = "default_tenant")]
    pub tenant: String,
    /// Which creation of that tenant ([`Owner`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tenant_incarnation: String,
    /// Runs of the batch begun since a request of it last ended: a batch whose runs keep
    /// ending with the process (a crash it causes) is failed, not resumed again.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub runs_without_progress: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl BatchObject {
    pub fn owner(&self) -> Owner {
        Owner { tenant: self.tenant.clone(), incarnation: self.tenant_incarnation.clone() }
    }

    /// Whether the batch still has work to do (it resumes after a restart).
    pub fn unfinished(&self) -> bool {
        matches!(self.status.as_str(), "validating" | "in_progress" | "finalizing" | "cancelling")
    }

    /// The ids its output and error files get.
    pub fn result_file_ids(&self) -> (String, String) {
        let tail = self.id.trim_start_matches("batch_");
        (format!("file-out-{tail}"), format!("file-err-{tail}"))
    }
}

pub fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A fresh id: `prefix` and 24 hex digits.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}{:016x}{:08x}", rand::random::<u64>(), rand::random::<u32>())
}

/// Ids arrive in URLs: only letters, digits, `-` and `_`, so one never names a path.
pub fn check_id(id: &str) -> Result<()> {
    if id.is_empty()
        || id.len() > 64
        || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(Error::NotFound(format!("no such object {id:?}")));
    }
    Ok(())
}

pub struct Store {
    root: PathBuf,
}

fn io(path: &Path, e: std::io::Error) -> Error {
    Error::Internal(format!("{}: {e}", path.display()))
}

/// Writes `value` as JSON to `path` atomically (a crash leaves the old or the new file).
fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let text = serde_json::to_vec_pretty(value).map_err(|e| Error::Internal(e.to_string()))?;
    let mut f = std::fs::File::create(&tmp).map_err(|e| io(&tmp, e))?;
    f.write_all(&text).and_then(|_| f.sync_all()).map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io(path, e))
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
    serde_json::from_slice(&bytes).map_err(|e| Error::Internal(format!("{}: {e}", path.display())))
}

impl Store {
    pub fn open(root: &Path) -> Result<Self> {
        for sub in ["files", "batches"] {
            let dir = root.join(sub);
            std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
        }
        Ok(Store { root: root.to_path_buf() })
    }

    pub fn data_path(&self, file_id: &str) -> PathBuf {
        self.root.join("files").join(format!("{file_id}.data"))
    }

    /// Where an upload is written before it becomes a file.
    pub fn upload_path(&self, file_id: &str) -> PathBuf {
        self.root.join("files").join(format!("{file_id}.upload"))
    }

    pub fn save_file(&self, f: &FileObject) -> Result<()> {
        write_json(&self.root.join("files").join(format!("{}.json", f.id)), f)
    }

    pub fn file(&self, id: &str) -> Result<FileObject> {
        check_id(id)?;
        let path = self.root.join("files").join(format!("{id}.json"));
        if !path.exists() {
            return Err(Error::NotFound(format!("no such file {id:?}")));
        }
        read_json(&path)
    }

    pub fn files(&self) -> Result<Vec<FileObject>> {
        let mut out: Vec<FileObject> = self.list("files")?;
        out.sort_by_key(|f| std::cmp::Reverse(f.created_at));
        Ok(out)
    }

    pub fn delete_file(&self, id: &str) -> Result<()> {
        self.file(id)?;
        let _ = std::fs::remove_file(self.data_path(id));
        let meta = self.root.join("files").join(format!("{id}.json"));
        std::fs::remove_file(&meta).map_err(|e| io(&meta, e))
    }

    pub fn save_batch(&self, b: &BatchObject) -> Result<()> {
        write_json(&self.root.join("batches").join(format!("{}.json", b.id)), b)
    }

    pub fn batches(&self) -> Result<Vec<BatchObject>> {
        self.list("batches")
    }

    fn list<T: for<'de> Deserialize<'de>>(&self, sub: &str) -> Result<Vec<T>> {
        let dir = self.root.join(sub);
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&dir).map_err(|e| io(&dir, e))? {
            let path = entry.map_err(|e| io(&dir, e))?.path();
            if path.extension().is_some_and(|e| e == "json") {
                out.push(read_json(&path)?);
            }
        }
        Ok(out)
    }
}

/// The `custom_id`s of the complete lines in a results file, after cutting off a
/// half-written last line. Read a line at a time (a results file may be gigabytes).
pub fn finished_ids(path: &Path) -> Result<Vec<String>> {
    use std::io::BufRead;
    let Ok(file) = std::fs::File::open(path) else { return Ok(Vec::new()) };
    let mut reader = std::io::BufReader::new(file);
    let (mut ids, mut line, mut complete) = (Vec::new(), Vec::new(), 0u64);
    loop {
        line.clear();
        let n = reader.read_until(b'\n', &mut line).map_err(|e| io(path, e))?;
        if n == 0 || line.last() != Some(&b'\n') {
            if n > 0 {
                let f = std::fs::OpenOptions::new().write(true).open(path).map_err(|e| io(path, e))?;
                f.set_len(complete).map_err(|e| io(path, e))?;
            }
            return Ok(ids);
        }
        complete += n as u64;
        if line.len() > 1 {
            let v: Json = serde_json::from_slice(&line).map_err(|e| io(path, std::io::Error::other(e)))?;
            if let Some(id) = v.get("custom_id").and_then(Json::as_str) {
                ids.push(id.to_string());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_never_name_paths() {
        assert!(check_id("file-abc_1").is_ok());
        for bad in ["", "../x", "a/b", "a.b", &"x".repeat(65)] {
            assert!(check_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn metadata_is_bounded_as_openai_bounds_it() {
        use serde_json::json;
        assert!(check_metadata(&json!({"a": "b"})).is_ok());
        let many: serde_json::Map<String, Json> = (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
        for (bad, words) in [
            (json!("x"), "object"),
            (Json::Object(many), "at most 16"),
            (json!({"k".repeat(65): "v"}), "at most 64"),
            (json!({"k": "v".repeat(513)}), "at most 512"),
            (json!({"k": {"nested": 1}}), "strings"),
        ] {
            let e = check_metadata(&bad).unwrap_err().to_string();
            assert!(e.contains(words), "{e}");
        }
    }

    #[test]
    fn a_half_written_line_is_cut_off() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.data");
        std::fs::write(&path, "{\"custom_id\":\"a\"}\n{\"custom_id\":\"b\"}\n{\"custom_i").unwrap();
        assert_eq!(finished_ids(&path).unwrap(), vec!["a", "b"]);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"custom_id\":\"a\"}\n{\"custom_id\":\"b\"}\n");
        assert!(finished_ids(&dir.path().join("none")).unwrap().is_empty());
    }
}
