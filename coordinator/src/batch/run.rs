//! Running one batch: validate its input file, then send its requests through the same
//! path as online ones, at low priority, writing each result as it ends.
//!
//! **Priority.** A batch keeps at most `batch_concurrency` requests in flight, less one
//! for every online request this coordinator is generating, and never fewer than one: online
//! traffic takes the replicas' capacity first, and a batch always moves.
//!
//! **Exactly once.** Results are appended (one line each) to the output or error file by
//! this task alone; after a restart the `custom_id`s already written are skipped, so every
//! request is answered once however often the coordinator dies.

use std::collections::HashSet;
use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use serde_json::{json, Value as Json};
use strata_common::metrics::register;
use strata_common::{Error, Result};
use tokio::task::JoinSet;
use tracing::{info, warn};

use super::store::{finished_ids, now};
use super::{Batches, Job};
use crate::api::http::completions::{self, Api};
use crate::api::http::error::ApiError;
use crate::api::http::params::Fields;
use crate::api::http::respond;
use crate::frontend::admission::Priority;

/// Most requests in one batch (OpenAI's limit).
pub const MAX_REQUESTS: usize = 50_000;
/// Most bytes of one `custom_id`.
const MAX_CUSTOM_ID: usize = 512;

/// Longest line of an input file, bytes (one request; OpenAI's are of this order).
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// One request of a batch's input: its id and where its line lies in the input file.
/// Lines stay on disk while a batch runs — a batch holds only this index of them, however
/// large its file — and each is read and parsed when its request starts.
#[derive(Debug, Clone)]
pub struct Line {
    pub custom_id: String,
    range: std::ops::Range<u64>,
}

impl Line {
    /// The line's bytes, read from the input file.
    pub fn read(&self, input: &std::fs::File) -> std::io::Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let mut raw = vec![0u8; (self.range.end - self.range.start) as usize];
        input.read_exact_at(&mut raw, self.range.start)?;
        Ok(raw)
    }

    /// Its length in bytes.
    pub fn bytes(&self) -> usize {
        (self.range.end - self.range.start) as usize
    }

    /// The request's body (`stream` off), from a line's bytes.
    pub fn body(raw: &[u8]) -> std::result::Result<Fields, String> {
        let v: Json = serde_json::from_slice(raw).map_err(|e| format!("not valid JSON: {e}"))?;
        let Json::Object(mut line) = v else { return Err("a line must be a JSON object".into()) };
        let Some(Json::Object(mut body)) = line.remove("body") else {
            return Err("body must be an object".into());
        };
        body.insert("stream".into(), Json::Bool(false));
        Ok(body)
    }
}

/// The requests of an input file for `endpoint`, read a line at a time, each line
/// checked (and its parse let go); the first bad line is the error, naming its line
/// number.
pub fn parse_input(
    input: impl std::io::BufRead,
    endpoint: &str,
) -> std::result::Result<Vec<Line>, (usize, String)> {
    use std::io::Read;
    let mut input = input;
    let mut lines = Vec::new();
    let mut seen = HashSet::new();
    let (mut offset, mut raw) = (0u64, Vec::new());
    for n in 1.. {
        raw.clear();
        // One byte past the longest line and its end: a longer one is refused unread.
        let limit = (MAX_LINE_BYTES + 3) as u64;
        let got = std::io::BufRead::read_until(&mut (&mut input).take(limit), b'\n', &mut raw)
            .map_err(|e| (n, format!("reading the input file: {e}")))?;
        if got == 0 {
            break;
        }
        let start = offset;
        offset += got as u64;
        let text = trim_line_end(&raw);
        if text.len() > MAX_LINE_BYTES {
            return Err((
                n,
                format!("a line of more than {MAX_LINE_BYTES} bytes; lines are at most {MAX_LINE_BYTES}"),
            ));
        }
        if text.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if lines.len() == MAX_REQUESTS {
            return Err((n, format!("more than {MAX_REQUESTS} requests")));
        }
        let custom_id = check_line(text, endpoint).map_err(|e| (n, e))?;
        if !seen.insert(custom_id.clone()) {
            return Err((n, format!("custom_id {custom_id:?} is used twice")));
        }
        lines.push(Line { custom_id, range: start..start + text.len() as u64 });
    }
    if lines.is_empty() {
        return Err((0, "the input file has no requests".into()));
    }
    Ok(lines)
}

/// A line without its `\n` or `\r\n`.
fn trim_line_end(raw: &[u8]) -> &[u8] {
    let mut end = raw.len();
    while end > 0 && matches!(raw[end - 1], b'\n' | b'\r') {
        end -= 1;
    }
    &raw[..end]
}

/// One line's request checked against the batch: its `custom_id`.
fn check_line(text: &[u8], endpoint: &str) -> std::result::Result<String, String> {
    let v: Json = serde_json::from_slice(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let custom_id = match v.get("custom_id") {
        Some(Json::String(s)) if !s.is_empty() && s.len() <= MAX_CUSTOM_ID => s.clone(),
        _ => return Err(format!("custom_id must be a string of 1 to {MAX_CUSTOM_ID} bytes")),
    };
    if v.get("method").and_then(Json::as_str).is_some_and(|m| m != "POST") {
        return Err("method must be POST".into());
    }
    if v.get("url").and_then(Json::as_str) != Some(endpoint) {
        return Err(format!("url must be the batch's endpoint {endpoint}"));
    }
    if !matches!(v.get("body"), Some(Json::Object(_))) {
        return Err("body must be an object".into());
    }
    Ok(custom_id)
}

/// What one request came to: its result line, and whether it succeeded.
struct Outcome {
    line: Json,
    ok: bool,
}

/// Which request of which batch a line is.
struct Head {
    batch_id: String,
    owner: crate::tenant::Owner,
    index: usize,
}

async fn execute(
    batches: Arc<Batches>,
    api: Api,
    head: Head,
    line: Line,
    input: Arc<std::fs::File>,
) -> Outcome {
    let Head { batch_id, owner, index } = head;
    let request_id = format!("{batch_id}-{index}");
    // Off the async runtime: a line's chat template may run long on its data.
    let (models, at) = (batches.front.models().clone(), line.clone());
    // Under the front end's budget of text worked on at once, as an online request's body.
    let permit = batches.front.texts().acquire(&owner.tenant, line.bytes()).await;
    let parsed = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let raw = at.read(&input).map_err(|e| Error::Internal(format!("reading the batch's input: {e}")))?;
        let body = Line::body(&raw).map_err(|e| ApiError::invalid("body", e))?;
        match api {
            Api::Chat => completions::chat(&*models, body),
            Api::Completion => completions::completion(&*models, &body),
        }
    })
    .await
    .unwrap_or_else(|e| Err(ApiError::from(Error::Internal(format!("building the request: {e}")))));
    let result = match parsed {
        Ok(mut job) => {
            for c in &mut job.choices {
                c.request.priority = Priority::Batch;
            }
            match batches.caller(&owner) {
                Ok(who) => answer_within_rates(&batches, &job, &request_id, &who).await,
                Err(e) => Err(ApiError::from(e)),
            }
        }
        Err(e) => Err(e),
    };
    let (status, body, ok) = match result {
        Ok(body) => (200, body, true),
        Err(e) => (e.status.as_u16(), e.body(), false),
    };
    Outcome {
        line: json!({
            "id": format!("batch_req_{}_{index}", batch_id.trim_start_matches("batch_")),
            "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": null,
        }),
        ok,
    }
}

/// Appends result lines to one file.
struct Results {
    file: std::fs::File,
}

impl Results {
    fn open(path: &std::path::Path) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| Error::Internal(format!("{}: {e}", path.display())))?;
        Ok(Results { file })
    }

    fn append(&mut self, line: &Json) -> Result<()> {
        let mut bytes = line.to_string().into_bytes();
        bytes.push(b'\n');
        self.file.write_all(&bytes).map_err(|e| Error::Internal(format!("writing a batch result: {e}")))
    }
}

/// Runs batch `job` to its end (or until it is cancelled), once one of the places among
/// the batches running at once is free.
pub async fn run(batches: Arc<Batches>, job: Arc<Job>) {
    let id = job.snapshot().id;
    let Ok(_place) = batches.runs.clone().acquire_owned().await else { return };
    if let Err(e) = drive(&batches, &job).await {
        warn!(batch = %id, "batch failed: {e}");
        job.update(&batches, |b| {
            b.status = "failed".into();
            b.failed_at = Some(now());
            b.errors = Some(
                json!({"object": "list", "data": [{"code": "internal_error", "message": e.to_string()}]}),
            );
        });
    }
}

/// The request answered once the tenant's rates let it in: a refusal by its requests per
/// second or tokens per minute (a 429 with a retry hint) is waited out, not failed, so a
/// batch spends the tenant's quota at the quota's pace.
async fn answer_within_rates(
    batches: &Batches,
    job: &completions::Job,
    request_id: &str,
    who: &crate::tenant::Caller,
) -> std::result::Result<Json, ApiError> {
    loop {
        match respond::answer(&batches.front, job, request_id.to_string(), who, None).await {
            Err(e)
                if e.status == axum::http::StatusCode::TOO_MANY_REQUESTS
                    && e.code == Some("rate_limit_exceeded") =>
            {
                let wait = Duration::from_secs(e.retry_after.unwrap_or(1).max(1));
                tokio::time::sleep(wait).await;
            }
            other => return other,
        }
    }
}

/// Runs begun without a request ending before a batch is failed instead of resumed.
pub const MAX_RUNS_WITHOUT_PROGRESS: u32 = 3;

/// Validates (when new), then runs the requests not yet answered.
async fn drive(batches: &Arc<Batches>, job: &Arc<Job>) -> Result<()> {
    let b = job.snapshot();
    if b.runs_without_progress >= MAX_RUNS_WITHOUT_PROGRESS {
        return Err(Error::Internal(format!(
            "the coordinator stopped {} times while running this batch without a request ending; \
             it is not resumed again",
            b.runs_without_progress
        )));
    }
    job.update(batches, |b| b.runs_without_progress += 1);
    let api = if b.endpoint == "/v1/chat/completions" { Api::Chat } else { Api::Completion };
    let path = batches.store.data_path(&b.input_file_id);
    let input = std::fs::File::open(&path)
        .map_err(|e| Error::Internal(format!("reading input file {}: {e}", b.input_file_id)))?;
    let endpoint = b.endpoint.clone();
    let (input, parsed) = tokio::task::spawn_blocking(move || {
        let parsed = parse_input(std::io::BufReader::new(&input), &endpoint);
        (input, parsed)
    })
    .await
    .map_err(|e| Error::Internal(format!("reading input file: {e}")))?;
    let input = Arc::new(input);
    let lines = match parsed {
        Ok(lines) => lines,
        Err((line, message)) => {
            job.update(batches, |b| {
                b.status = "failed".into();
                b.failed_at = Some(now());
                b.errors = Some(json!({"object": "list", "data": [
                    {"code": "invalid_request", "message": message, "line": line, "param": null}
                ]}));
            });
            return Ok(());
        }
    };
    let (out_id, err_id) = b.result_file_ids();
    let (out_path, err_path) = (batches.store.data_path(&out_id), batches.store.data_path(&err_id));
    let done: HashSet<String> = finished_ids(&out_path)?.into_iter().collect();
    let failed: HashSet<String> = finished_ids(&err_path)?.into_iter().collect();
    job.update(batches, |b| {
        if b.status == "validating" {
            b.status = "in_progress".into();
            b.in_progress_at = Some(now());
        }
        b.request_counts.total = lines.len() as u64;
        b.request_counts.completed = done.len() as u64;
        b.request_counts.failed = failed.len() as u64;
    });
    let todo: Vec<(usize, Line)> = lines
        .into_iter()
        .enumerate()
        .filter(|(_, l)| !done.contains(&l.custom_id) && !failed.contains(&l.custom_id))
        .collect();
    info!(batch = %b.id, remaining = todo.len(), "batch running");
    let mut files = (Results::open(&out_path)?, Results::open(&err_path)?);
    dispatch(batches, job, api, (todo, input), &mut files).await?;
    finish(batches, job, (out_id, err_id))
}

/// Batch requests in flight (all batches), and batch requests ended by outcome.
struct BatchMetrics {
    in_flight: Gauge,
    ended: Family<OutcomeLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

fn metrics() -> &'static BatchMetrics {
    static METRICS: std::sync::OnceLock<BatchMetrics> = std::sync::OnceLock::new();
    METRICS.get_or_init(|| {
        let m = BatchMetrics { in_flight: Gauge::default(), ended: Family::default() };
        register("batch_requests_in_flight", "Batch requests being generated now", m.in_flight.clone());
        register("batch_requests", "Batch requests ended, by outcome (completed, failed)", m.ended.clone());
        m
    })
}

/// Requests this runner has in flight, counted in the gauge and the batches' shared
/// budget until they end (or the runner stops: dropping its tasks cancels them).
struct InFlight<'a> {
    n: i64,
    budget: &'a std::sync::atomic::AtomicUsize,
}

impl InFlight<'_> {
    /// Takes one of the shared budget's `allowed` places, if one is free (atomically:
    /// batches running side by side never take more than `allowed` together).
    fn try_start(&mut self, allowed: usize) -> bool {
        let taken = self
            .budget
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| (n < allowed).then_some(n + 1));
        if taken.is_ok() {
            self.n += 1;
            metrics().in_flight.inc();
        }
        taken.is_ok()
    }

    fn ended(&mut self) {
        self.n -= 1;
        self.budget.fetch_sub(1, Ordering::Relaxed);
        metrics().in_flight.dec();
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.budget.fetch_sub(self.n as usize, Ordering::Relaxed);
        metrics().in_flight.dec_by(self.n);
    }
}

/// Keeps the allowed number of requests in flight until all are answered or the batch
/// is cancelled.
async fn dispatch(
    batches: &Arc<Batches>,
    job: &Arc<Job>,
    api: Api,
    (todo, input): (Vec<(usize, Line)>, Arc<std::fs::File>),
    files: &mut (Results, Results),
) -> Result<()> {
    let (id, owner) = {
        let b = job.snapshot();
        (b.id.clone(), b.owner())
    };
    let mut todo = todo.into_iter().peekable();
    let mut running = JoinSet::new();
    let mut counted = InFlight { n: 0, budget: &batches.running };
    let mut saved = tokio::time::Instant::now();
    loop {
        if job.cancelled() {
            running.abort_all();
            return Ok(());
        }
        // One budget for every batch, each taking what the others leave; one request at
        // least in flight whatever the online load, so batches always move.
        let allowed = batches.concurrency.saturating_sub(batches.front.online_in_flight()).max(1);
        while let Some((index, line)) = todo.next_if(|_| counted.try_start(allowed)) {
            let head = Head { batch_id: id.clone(), owner: owner.clone(), index };
            running.spawn(execute(batches.clone(), api, head, line, input.clone()));
        }
        if running.is_empty() {
            if todo.peek().is_none() {
                return Ok(());
            }
            // Other batches hold the budget: look again shortly.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        tokio::select! {
            next = running.join_next() => {
                let Some(joined) = next else { continue };
                counted.ended();
                let Ok(outcome) = joined else {
                    warn!(batch = %id, "a batch request's task failed; it runs again when the batch resumes");
                    continue;
                };
                metrics().ended.get_or_create(&OutcomeLabels { outcome: if outcome.ok { "completed" } else { "failed" } }).inc();
                if outcome.ok { files.0.append(&outcome.line)? } else { files.1.append(&outcome.line)? }
                job.count(outcome.ok);
            }
            // Online load and cancellation are looked at again at least this often.
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
        if saved.elapsed() >= Duration::from_secs(1) {
            job.save(batches);
            saved = tokio::time::Instant::now();
        }
    }
}

/// Publishes the result files and ends the batch (completed, or cancelled).
fn finish(batches: &Batches, job: &Job, (out_id, err_id): (String, String)) -> Result<()> {
    let cancelled = job.cancelled();
    job.update(batches, |b| {
        if !cancelled {
            b.status = "finalizing".into();
            b.finalizing_at = Some(now());
        }
    });
    let b = job.snapshot();
    let out = batches.publish(&out_id, &format!("{}_output.jsonl", b.id), &b.owner())?;
    let err = if b.request_counts.failed > 0 {
        Some(batches.publish(&err_id, &format!("{}_error.jsonl", b.id), &b.owner())?)
    } else {
        None
    };
    job.update(batches, |b| {
        b.output_file_id = Some(out);
        b.error_file_id = err;
        if cancelled {
            b.status = "cancelled".into();
            b.cancelled_at = Some(now());
        } else {
            b.status = "completed".into();
            b.completed_at = Some(now());
        }
    });
    info!(batch = %b.id, completed = b.request_counts.completed, failed = b.request_counts.failed, "batch ended");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_input_lines_are_named() {
        let ok =
            r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"model":"m","prompt":"x"}}"#;
        assert_eq!(parse_input(ok.as_bytes(), "/v1/completions").unwrap().len(), 1);
        // Lines are kept as places in the file and read and parsed again when they run.
        let text = format!("{ok}\r\n\n{}\n", ok.replace("\"a\"", "\"b\"").replace("\"x\"", "\"y\""));
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("in"), &text).unwrap();
        let file = std::fs::File::open(dir.path().join("in")).unwrap();
        let lines = parse_input(std::io::BufReader::new(&file), "/v1/completions").unwrap();
        let prompts: Vec<Json> =
            lines.iter().map(|l| Line::body(&l.read(&file).unwrap()).unwrap()["prompt"].clone()).collect();
        assert_eq!((lines[1].custom_id.as_str(), prompts), ("b", vec![Json::from("x"), Json::from("y")]));
        let cases = [
            (format!("{ok}\n{ok}"), 2, "used twice"),
            (format!("{ok}\nnot json"), 2, "not valid JSON"),
            (ok.replace("/v1/completions", "/v1/chat/completions"), 1, "endpoint"),
            (ok.replace("\"a\"", "5"), 1, "custom_id"),
            (ok.replace("POST", "GET"), 1, "POST"),
            ("\n\n".to_string(), 0, "no requests"),
            (format!("{ok}\r\n{}", "x".repeat(MAX_LINE_BYTES + 1)), 2, "at most"),
        ];
        for (text, line, words) in cases {
            let (n, message) = parse_input(text.as_bytes(), "/v1/completions").unwrap_err();
            assert_eq!(n, line, "{message}");
            assert!(message.contains(words), "{message}");
        }
    }
}
