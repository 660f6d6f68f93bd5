//! Machine-readable announcements on standard output.
//!
//! Logs are for people and go to standard error. What a supervisor, a script or a test
//! needs to act on — "this process is ready, at this address" — is one JSON object per
//! line on standard output, a contract like an API's:
//!
//! ```text
//! {"event":"ready","role":"serve","address":"127.0.0.1:50051","id":"serve"}
//! ```
//!
//! `event` is `ready` (the role serves at `address`) or `rendezvous` (static mode waits
//! for its ranks at `address`); `role` is `serve`, `coordinator` or `worker`.

use std::io::Write;

use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct Announcement<'a> {
    pub event: &'a str,
    pub role: &'a str,
    pub address: &'a str,
    pub id: &'a str,
}

/// Writes `a` as one line on standard output and flushes it. A closed stdout is not an
/// error for the process: nobody was listening.
pub fn announce(a: &Announcement<'_>) {
    let Ok(line) = serde_json::to_string(a) else { return };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}
