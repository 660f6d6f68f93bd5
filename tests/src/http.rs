//! A minimal HTTP/1.0 client for the OpenAI-style API (one request per connection; the
//! server closes it after the response, so the body is everything until EOF). The tests
//! that matter use OpenAI's own Python client; this one is for the Rust-side checks.

use std::io::{Read, Write};
use std::time::Duration;

/// Sends `method path` with an optional bearer key and JSON body; returns the status and
/// the body.
pub fn request(
    address: &str,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<&serde_json::Value>,
) -> std::io::Result<(u16, String)> {
    let mut s = std::net::TcpStream::connect(address)?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let mut head =
        format!("{method} {path} HTTP/1.0\r\nHost: {address}\r\nContent-Length: {}\r\n", body.len());
    if !body.is_empty() {
        head.push_str("Content-Type: application/json\r\n");
    }
    if let Some(k) = key {
        head.push_str(&format!("Authorization: Bearer {k}\r\n"));
    }
    write!(s, "{head}\r\n{body}")?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let raw = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((status, body.to_string()))
}

/// POST with a JSON body; panics on a transport error. Returns the status and parsed body
/// (or the text as a JSON string when it is not JSON).
pub fn post(
    address: &str,
    path: &str,
    key: Option<&str>,
    body: &serde_json::Value,
) -> (u16, serde_json::Value) {
    let (status, text) = request(address, "POST", path, key, Some(body)).expect("HTTP request");
    (status, serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)))
}

/// The `data:` payloads of a server-sent-events body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|event| {
            event.lines().find_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        })
        .map(str::to_string)
        .collect()
}

/// Uploads `content` as a batch input file (`POST /v1/files`, multipart/form-data);
/// returns the file object.
pub fn upload(address: &str, key: Option<&str>, filename: &str, content: &str) -> serde_json::Value {
    let (status, body) = try_upload(address, key, filename, content);
    assert_eq!(status, 200, "{body}");
    body
}

/// [`upload`], returning the status and the body whatever they are.
pub fn try_upload(
    address: &str,
    key: Option<&str>,
    filename: &str,
    content: &str,
) -> (u16, serde_json::Value) {
    let boundary = "strata-test-boundary-7d1c";
    let body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n\
         Content-Type: application/jsonl\r\n\r\n{content}\r\n--{boundary}--\r\n"
    );
    let mut s = std::net::TcpStream::connect(address).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut head = format!(
        "POST /v1/files HTTP/1.0\r\nHost: {address}\r\nContent-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(k) = key {
        head.push_str(&format!("Authorization: Bearer {k}\r\n"));
    }
    write!(s, "{head}\r\n{body}").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, serde_json::from_str(body).unwrap_or(serde_json::Value::String(body.to_string())))
}

/// `GET /metrics` over plain HTTP/1.1.
pub fn scrape(address: &str) -> String {
    let mut s = std::net::TcpStream::connect(address).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    body
}

/// The value of the sample named `name` whose labels include every pair in `labels`.
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let (labelset, value) = match rest.strip_prefix('{') {
            Some(r) => r.split_once("} ")?,
            None => ("", rest.strip_prefix(' ')?),
        };
        let all = labels.iter().all(|(k, v)| labelset.split(',').any(|p| p == format!("{k}=\"{v}\"")));
        all.then(|| value.split_whitespace().next()?.parse().ok()).flatten()
    })
}
