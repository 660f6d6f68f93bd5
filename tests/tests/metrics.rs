//! The metrics a server exposes agree with what a client observed: requests by finish
//! reason and errors by status code, the time-to-first-token histogram's count, tokens.

use std::io::{Read, Write};
use std::time::Duration;

use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_tests::{fixtures_dir, token_request, Server};

/// `GET /metrics` over plain HTTP/1.1.
fn scrape(address: &str) -> String {
    let mut s = std::net::TcpStream::connect(address).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    body
}

/// The value of the sample named `name` whose labels include every pair in `labels`.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
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

#[tokio::test(flavor = "multi_thread")]
async fn request_metrics_agree_with_the_client() {
    let model = fixtures_dir().join("llama_gqa").to_string_lossy().to_string();
    let mut server = Server::spawn(&["--model", &model, "--name", "m", "--metrics-listen", "127.0.0.1:0"]);
    let metrics = server.out.wait_event("metrics", Duration::from_secs(60), "strata serve");
    let metrics = metrics["address"].as_str().unwrap().to_string();
    server.addr = server.wait_ready();
    let mut c = InferenceClient::connect(server.endpoint()).await.unwrap();
    for i in 0..5 {
        let r = c.generate(token_request("m", vec![1, 2 + i, 3], 4)).await.unwrap().into_inner();
        assert_eq!(r.token_ids.len(), 4);
    }
    let mut s = c.generate_stream(token_request("m", vec![1, 9], 3)).await.unwrap().into_inner();
    while s.message().await.unwrap().is_some() {}
    let bad = strata_proto::inference::v1::GenerateRequest {
        max_tokens: Some(0),
        ..token_request("m", vec![1], 1)
    };
    assert!(c.generate(bad).await.is_err());

    let text = scrape(&metrics);
    let m = [("model", "m")];
    assert_eq!(
        sample(&text, "strata_requests_total", &[("model", "m"), ("finish_reason", "length")]),
        Some(6.0),
        "{text}"
    );
    assert_eq!(sample(&text, "strata_time_to_first_token_seconds_count", &m), Some(6.0));
    assert_eq!(sample(&text, "strata_e2e_request_latency_seconds_count", &m), Some(6.0));
    assert_eq!(sample(&text, "strata_inter_token_latency_seconds_count", &m), Some(5.0 * 3.0 + 2.0));
    assert_eq!(sample(&text, "strata_generation_tokens_total", &m), Some(23.0));
    assert_eq!(sample(&text, "strata_prompt_tokens_total", &m), Some(5.0 * 3.0 + 2.0));
    assert_eq!(
        sample(&text, "strata_request_errors_total", &[("model", "m"), ("code", "INVALID_ARGUMENT")]),
        Some(1.0)
    );
    assert!(text.trim_end().ends_with("# EOF"), "OpenMetrics exposition");
}
