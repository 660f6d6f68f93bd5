//! `strata model fetch`: a model directory from an HTTP(S) URL (a web server, or a bucket
//! an S3-compatible store serves over HTTP(S)) or an `s3://BUCKET/PREFIX` (requests signed
//! with AWS Signature V4 from the AWS_* credentials, when set), checked file by file
//! against the SHA-256 sums the directory publishes (`SHA256SUMS`, as `sha256sum` writes
//! it).
//!
//! Every file is written beside its final name and renamed there only once its sum
//! matches, so an interrupted or corrupted fetch never leaves a file that looks whole; a
//! second run fetches only what is missing or different. The manifest is bounded before
//! it is read, and its names may not leave the directory.

use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use sha2::{Digest, Sha256};

/// Largest manifest read, and most files it may name.
const MAX_MANIFEST: u64 = 1 << 20;
const MAX_FILES: usize = 10_000;

#[derive(Args, Debug)]
pub struct FetchArgs {
    /// Where the directory is: http(s)://HOST/PATH (its files are PATH/NAME), or
    /// s3://BUCKET/PREFIX in AWS S3 or an S3-compatible store (--s3-endpoint); S3 requests
    /// are signed with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN)
    /// when set, in AWS_REGION (default us-east-1).
    #[arg(long)]
    pub url: String,
    /// An S3-compatible store's endpoint (http(s)://HOST[:PORT]; buckets addressed by
    /// path) [default: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS S3 itself].
    #[arg(long, value_name = "URL")]
    pub s3_endpoint: Option<String>,
    /// The directory to write (made if missing); files already there with the right sum
    /// are kept.
    #[arg(long)]
    pub out: PathBuf,
    /// The manifest's name under --url: one `<sha256 hex>  <file>` line per file.
    #[arg(long, default_value = "SHA256SUMS")]
    pub manifest: String,
    /// Most bytes fetched in all (a size: 500GiB).
    #[arg(long, default_value = "2048GiB")]
    pub max_bytes: String,
    /// Seconds the server may send nothing — before a response's head, or between reads
    /// of a file — before the fetch fails (connecting has 30 s).
    #[arg(long, default_value_t = 60.0, value_name = "SECONDS")]
    pub read_timeout: f64,
}

/// One file the manifest names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub sha256: [u8; 32],
    pub name: String,
}

/// Parses a `sha256sum` manifest: `<64 hex digits>` then one or two spaces (or ` *`, the
/// binary marker) and a relative name that stays inside the directory.
pub fn parse_manifest(text: &str) -> anyhow::Result<Vec<Entry>> {
    let mut entries = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |why: &str| anyhow::anyhow!("manifest line {}: {why}: {line:?}", n + 1);
        let (hex, rest) = line.split_at_checked(64).ok_or_else(|| bad("too short"))?;
        let name =
            rest.strip_prefix("  ").or_else(|| rest.strip_prefix(" *")).ok_or_else(|| bad("no name"))?;
        let mut sha256 = [0u8; 32];
        for (i, b) in sha256.iter_mut().enumerate() {
            *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2).unwrap_or(""), 16)
                .map_err(|_| bad("not a SHA-256 in hex"))?;
        }
        let path = Path::new(name);
        let inside = !name.is_empty() && path.components().all(|c| matches!(c, Component::Normal(_)));
        if !inside || name.contains('\\') {
            return Err(bad("a name that leaves the directory"));
        }
        entries.push(Entry { sha256, name: name.to_string() });
        if entries.len() > MAX_FILES {
            bail!("the manifest names more than {MAX_FILES} files");
        }
    }
    if entries.is_empty() {
        bail!("the manifest names no file");
    }
    Ok(entries)
}

fn hex(sum: &[u8]) -> String {
    sum.iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 of a file on disk, or None when it is missing.
fn file_sum(path: &Path) -> anyhow::Result<Option<[u8; 32]>> {
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| path.display().to_string()),
    };
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).with_context(|| path.display().to_string())?;
    Ok(Some(h.finalize().into()))
}

fn join(base: &str, name: &str) -> String {
    format!("{}/{}", base.trim_end_matches('/'), name)
}

/// Where the files come from.
enum Source {
    Http(String),
    S3(Box<S3Source>),
}

struct S3Source {
    bucket: rusty_s3::Bucket,
    credentials: Option<rusty_s3::Credentials>,
    prefix: String,
}

/// How long a signed S3 URL stays valid (one file's download must start within it).
const SIGNED_FOR: std::time::Duration = std::time::Duration::from_secs(3600);

impl Source {
    fn of(args: &FetchArgs) -> anyhow::Result<Source> {
        if let Some(rest) = args.url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                bail!("--url {}: s3://BUCKET/PREFIX", args.url);
            }
            let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
            let region =
                env("AWS_REGION").or_else(|| env("AWS_DEFAULT_REGION")).unwrap_or("us-east-1".into());
            let custom = args
                .s3_endpoint
                .clone()
                .or_else(|| env("AWS_ENDPOINT_URL_S3"))
                .or_else(|| env("AWS_ENDPOINT_URL"));
            let (endpoint, style) = match custom {
                Some(e) => (e, rusty_s3::UrlStyle::Path),
                None => (format!("https://s3.{region}.amazonaws.com"), rusty_s3::UrlStyle::VirtualHost),
            };
            let endpoint: url::Url = endpoint.parse().with_context(|| format!("S3 endpoint {endpoint}"))?;
            let bucket = rusty_s3::Bucket::new(endpoint, style, bucket.to_string(), region)
                .map_err(|e| anyhow::anyhow!("--url {}: {e:?}", args.url))?;
            let prefix = prefix.trim_matches('/').to_string();
            let credentials = rusty_s3::Credentials::from_env();
            return Ok(Source::S3(Box::new(S3Source { bucket, credentials, prefix })));
        }
        if !(args.url.starts_with("http://") || args.url.starts_with("https://")) {
            bail!("--url {}: an http(s):// or s3:// URL", args.url);
        }
        Ok(Source::Http(args.url.clone()))
    }

    /// The URL of the directory's file `name`, and how errors show it (a signed URL is a
    /// credential while it lasts: errors name the object instead).
    fn url(&self, name: &str) -> (String, String) {
        use rusty_s3::S3Action;
        match self {
            Source::Http(base) => (join(base, name), join(base, name)),
            Source::S3(s) => {
                let key = if s.prefix.is_empty() { name.to_string() } else { format!("{}/{name}", s.prefix) };
                let url = s.bucket.get_object(s.credentials.as_ref(), &key).sign(SIGNED_FOR).to_string();
                (url, format!("s3://{}/{key}", s.bucket.name()))
            }
        }
    }
}

fn get(agent: &ureq::Agent, (url, shown): &(String, String)) -> anyhow::Result<ureq::Body> {
    let response = agent.get(url).call().map_err(|e| match e {
        ureq::Error::StatusCode(code) => anyhow::anyhow!("GET {shown}: HTTP status {code}"),
        other => anyhow::anyhow!("GET {shown}: {}", other.to_string().replace(url.as_str(), shown)),
    })?;
    Ok(response.into_body())
}

/// How long connecting to the model server may take.
const FETCH_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
pub fn fetch(args: FetchArgs) -> anyhow::Result<()> {
    let source = Source::of(&args)?;
    let max_bytes = strata_common::config::parse_memory(&args.max_bytes).context("--max-bytes")? as u64;
    // A server that stops answering is an error, not a hang: connecting, the response's
    // head, and every read of a body (however long the whole file takes) are bounded.
    if !(args.read_timeout.is_finite() && args.read_timeout > 0.0 && args.read_timeout < 1e9) {
        anyhow::bail!("--read-timeout {}: give a positive number of seconds", args.read_timeout);
    }
    let read_timeout = std::time::Duration::from_secs_f64(args.read_timeout);
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(true)
        .timeout_connect(Some(FETCH_CONNECT_TIMEOUT))
        .timeout_recv_response(Some(read_timeout))
        .timeout_per_read(Some(read_timeout))
        .timeout_per_write(Some(read_timeout))
        .build()
        .into();
    let manifest = source.url(&args.manifest);
    let shown = manifest.1.clone();
    let mut text = String::new();
    get(&agent, &manifest)?
        .into_reader()
        .take(MAX_MANIFEST + 1)
        .read_to_string(&mut text)
        .with_context(|| format!("GET {shown}"))?;
    if text.len() as u64 > MAX_MANIFEST {
        bail!("{shown}: larger than {MAX_MANIFEST} bytes");
    }
    let entries = parse_manifest(&text).with_context(|| shown.clone())?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("--out {}", args.out.display()))?;
    let mut budget = max_bytes;
    let (mut fetched, mut kept) = (0usize, 0usize);
    for e in &entries {
        let path = args.out.join(&e.name);
        if file_sum(&path)? == Some(e.sha256) {
            kept += 1;
            continue;
        }
        let bytes = fetch_file(&agent, source.url(&e.name), &path, e, budget)?;
        budget -= bytes;
        fetched += 1;
    }
    tracing::info!(fetched, kept, out = %args.out.display(), "model directory fetched and checked");
    Ok(())
}

/// Fetches one file to `path` through a `.part` beside it, at most `budget` bytes, and
/// renames it into place once its sum is `e.sha256`; returns its size.
fn fetch_file(
    agent: &ureq::Agent,
    url: (String, String),
    path: &Path,
    e: &Entry,
    budget: u64,
) -> anyhow::Result<u64> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
    }
    let part = path.with_file_name(format!(
        ".{}.part",
        path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default()
    ));
    let started = Instant::now();
    let result = (|| -> anyhow::Result<u64> {
        let mut body = get(agent, &url)?.into_reader().take(budget + 1);
        let mut out = std::fs::File::create(&part).with_context(|| part.display().to_string())?;
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        loop {
            let n = body.read(&mut buf).with_context(|| format!("GET {}", url.1))?;
            if n == 0 {
                break;
            }
            total += n as u64;
            if total > budget {
                bail!("{}: more than --max-bytes allows in all", e.name);
            }
            h.update(&buf[..n]);
            out.write_all(&buf[..n]).with_context(|| part.display().to_string())?;
        }
        out.sync_all().with_context(|| part.display().to_string())?;
        let got: [u8; 32] = h.finalize().into();
        if got != e.sha256 {
            bail!("{}: sha256 {} where the manifest says {}", e.name, hex(&got), hex(&e.sha256));
        }
        Ok(total)
    })();
    match result {
        Ok(total) => {
            std::fs::rename(&part, path).with_context(|| path.display().to_string())?;
            let secs = started.elapsed().as_secs_f64().max(1e-6);
            tracing::info!(file = %e.name, bytes = total, mb_per_s = total as f64 / secs / 1e6, "fetched");
            Ok(total)
        }
        Err(err) => {
            let _ = std::fs::remove_file(&part);
            Err(err)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SUM: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn manifests_parse_as_sha256sum_writes_them_and_names_stay_inside() {
        let m = parse_manifest(&format!("{SUM}  config.json\n{SUM} *sub/model.safetensors\n\n")).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!((m[0].name.as_str(), m[1].name.as_str()), ("config.json", "sub/model.safetensors"));
        assert_eq!(hex(&m[0].sha256), SUM);
        for bad in [
            format!("{SUM}  ../etc/passwd"),
            format!("{SUM}  /etc/passwd"),
            format!("{SUM}  a/../../b"),
            format!("{SUM} x"),
            format!("zz{}  config.json", &SUM[2..]),
            "short  config.json".to_string(),
            String::new(),
        ] {
            assert!(parse_manifest(&bad).is_err(), "{bad:?}");
        }
    }
}
