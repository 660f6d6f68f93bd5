//! `strata batch run`: sends a JSONL file of OpenAI-style requests (the Batch API's input
//! format) to an HTTP endpoint and writes one result line per request (the Batch API's
//! output format), with a progress bar. Interrupted, it resumes: `custom_id`s already in
//! the output are skipped (a half-written last line is cut off first).
//!
//! Overload (429), unavailability (503) and lost connections are retried with backoff; any
//! other answer, success or error, is the request's result.

use std::collections::HashSet;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::{Args, Subcommand};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

#[derive(Subcommand, Debug)]
pub enum BatchCommand {
    /// Send every request of a JSONL file to an OpenAI-style endpoint; write the results.
    Run(RunArgs),
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// The server, e.g. http://127.0.0.1:8000 (each line's `url` is appended).
    #[arg(long)]
    pub endpoint: String,
    /// Requests, one JSON object per line: {"custom_id", "method", "url", "body"}.
    #[arg(long)]
    pub input: PathBuf,
    /// Results, one line per request; existing lines are kept and their requests skipped.
    #[arg(long)]
    pub output: PathBuf,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// API key sent as `Authorization: Bearer`.
    #[arg(long, env = "STRATA_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Attempts per request when the server is overloaded or unreachable.
    #[arg(long, default_value_t = 8)]
    pub retries: u32,
}

/// Largest response body read.
const MAX_RESPONSE: usize = 64 << 20;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn run(command: BatchCommand, rt: tokio::runtime::Runtime) -> anyhow::Result<()> {
    match command {
        BatchCommand::Run(args) => rt.block_on(run_file(args)),
    }
}

/// The requests of the input not yet answered in the output.
fn pending(args: &RunArgs) -> anyhow::Result<(Vec<(String, Value)>, usize)> {
    let done: HashSet<String> =
        strata_coordinator::batch::store::finished_ids(&args.output)?.into_iter().collect();
    let text =
        std::fs::read_to_string(&args.input).with_context(|| format!("--input {}", args.input.display()))?;
    let mut todo = Vec::new();
    let mut seen = HashSet::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: Value =
            serde_json::from_str(line).with_context(|| format!("--input line {}: not JSON", i + 1))?;
        let Some(id) = v.get("custom_id").and_then(Value::as_str).map(str::to_string) else {
            bail!("--input line {}: custom_id must be a string", i + 1);
        };
        if !seen.insert(id.clone()) {
            bail!("--input line {}: custom_id {id:?} is used twice", i + 1);
        }
        if v.get("url").and_then(Value::as_str).is_none() || !v.get("body").is_some_and(Value::is_object) {
            bail!("--input line {}: needs url (e.g. /v1/chat/completions) and a body object", i + 1);
        }
        if !done.contains(&id) {
            todo.push((id, v));
        }
    }
    Ok((todo, done.len()))
}

async fn run_file(args: RunArgs) -> anyhow::Result<()> {
    let base = args.endpoint.trim_end_matches('/').trim_end_matches("/v1").to_string();
    if !base.starts_with("http://") {
        bail!(
            "--endpoint {}: give an http:// URL (TLS belongs to the load balancer in front)",
            args.endpoint
        );
    }
    if args.concurrency == 0 {
        bail!("--concurrency must be at least 1");
    }
    let (todo, skipped) = pending(&args)?;
    let mut out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.output)
        .with_context(|| format!("--output {}", args.output.display()))?;
    let bar = ProgressBar::new(todo.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    tracing::info!(pending = todo.len(), skipped, "sending requests");
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let permits = Arc::new(Semaphore::new(args.concurrency));
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(Value, bool)>(64);
    let key = args.api_key.clone();
    for (n, (id, line)) in todo.into_iter().enumerate() {
        let (client, permits, tx, base, key) =
            (client.clone(), permits.clone(), tx.clone(), base.clone(), key.clone());
        let retries = args.retries;
        tokio::spawn(async move {
            let Ok(_permit) = permits.acquire_owned().await else { return };
            let result = send(&client, &base, key.as_deref(), &id, n, &line, retries).await;
            let _ = tx.send(result).await;
        });
    }
    drop(tx);
    let (mut ok, mut failed) = (0usize, 0usize);
    while let Some((line, success)) = rx.recv().await {
        let mut bytes = line.to_string().into_bytes();
        bytes.push(b'\n');
        out.write_all(&bytes).context("writing --output")?;
        if success {
            ok += 1
        } else {
            failed += 1
        }
        bar.inc(1);
        bar.set_message(format!("{failed} failed"));
    }
    out.sync_all().context("writing --output")?;
    bar.finish();
    tracing::info!(succeeded = ok, failed, skipped, "batch done");
    eprintln!("{ok} succeeded, {failed} failed, {skipped} already in {}", args.output.display());
    Ok(())
}

/// One request, retried while the server is overloaded or unreachable; its result line.
async fn send(
    client: &HttpClient,
    base: &str,
    key: Option<&str>,
    id: &str,
    n: usize,
    line: &Value,
    retries: u32,
) -> (Value, bool) {
    let url = format!("{base}{}", line["url"].as_str().unwrap_or_default());
    let body = Bytes::from(line["body"].to_string());
    let mut backoff = Duration::from_millis(200);
    let mut attempt = 0;
    let (status, response) = loop {
        attempt += 1;
        match post(client, &url, key, body.clone()).await {
            Ok((status, _)) if (status == 429 || status == 503) && attempt < retries => {}
            Ok(answer) => break answer,
            Err(_) if attempt < retries => {}
            Err(e) => {
                let error = json!({"code": "request_failed", "message": format!("{e:#}")});
                return (
                    json!({"id": format!("req-{n}"), "custom_id": id, "response": null, "error": error}),
                    false,
                );
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(10));
    };
    let line = json!({
        "id": format!("req-{n}"),
        "custom_id": id,
        "response": {"status_code": status, "body": response},
        "error": null,
    });
    (line, status == 200)
}

async fn post(
    client: &HttpClient,
    url: &str,
    key: Option<&str>,
    body: Bytes,
) -> anyhow::Result<(u16, Value)> {
    let mut req = hyper::Request::post(url).header(hyper::header::CONTENT_TYPE, "application/json");
    if let Some(k) = key {
        req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {k}"));
    }
    let resp = client.request(req.body(Full::new(body))?).await.with_context(|| format!("POST {url}"))?;
    let status = resp.status().as_u16();
    let bytes = Limited::new(resp.into_body(), MAX_RESPONSE)
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("reading the response of {url}: {e}"))?
        .to_bytes();
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    Ok((status, value))
}
