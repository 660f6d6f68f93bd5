//! The process's own metrics, read from `/proc` on each scrape under the names every
//! Prometheus client library uses (`process_cpu_seconds_total`, `process_resident_memory_bytes`,
//! `process_open_fds`, …), so the usual dashboards and alerts work unchanged. Elsewhere
//! than Linux there is nothing to read and nothing is reported.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// What `/proc/self` says now.
#[derive(Debug, Default, PartialEq)]
pub struct Sample {
    pub cpu_seconds: f64,
    pub resident_bytes: i64,
    pub virtual_bytes: i64,
    pub open_fds: i64,
    pub max_fds: i64,
    pub start_time_seconds: f64,
    pub threads: i64,
}

/// Clock ticks per second of `/proc/*/stat`'s times (Linux has fixed it at 100 for every
/// architecture it runs on).
const TICKS: f64 = 100.0;

/// The fields of `/proc/self/stat` after the command name, which may hold spaces and
/// parentheses: everything after its last `)`.
fn stat_fields(stat: &str) -> Option<Vec<&str>> {
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().collect())
}

/// Parses `/proc/self/stat`, `/proc/self/limits` and the boot time of `/proc/stat` into a
/// sample (fds are counted by the caller).
pub fn parse(stat: &str, limits: &str, proc_stat: &str, page_size: i64) -> Option<Sample> {
    // After the name: state is field 3 of the man page, so field N is index N - 3.
    let f = stat_fields(stat)?;
    let num = |n: usize| f.get(n - 3).and_then(|v| v.parse::<f64>().ok());
    let boot =
        proc_stat.lines().find_map(|l| l.strip_prefix("btime ")).and_then(|v| v.trim().parse::<f64>().ok());
    let max_fds = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|v| v.parse::<i64>().ok())
        .unwrap_or(0);
    Some(Sample {
        cpu_seconds: (num(14)? + num(15)?) / TICKS,
        threads: num(20)? as i64,
        start_time_seconds: boot.unwrap_or(0.0) + num(22)? / TICKS,
        virtual_bytes: num(23)? as i64,
        resident_bytes: num(24)? as i64 * page_size,
        open_fds: 0,
        max_fds,
    })
}

/// The sample of this process, when `/proc` has it.
pub fn sample() -> Option<Sample> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    // 4 KiB pages: every architecture Strata builds for uses them by default.
    let mut s = parse(&read("/proc/self/stat")?, &read("/proc/self/limits")?, &read("/proc/stat")?, 4096)?;
    s.open_fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count() as i64).unwrap_or(0);
    Some(s)
}

/// Reports [`sample`] on each scrape.
#[derive(Debug)]
pub struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(s) = sample() else { return Ok(()) };
        let cpu = ConstCounter::new(s.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        let gauges: [(&str, &str, f64); 6] = [
            ("process_resident_memory_bytes", "Resident memory size in bytes", s.resident_bytes as f64),
            ("process_virtual_memory_bytes", "Virtual memory size in bytes", s.virtual_bytes as f64),
            ("process_open_fds", "Number of open file descriptors", s.open_fds as f64),
            ("process_max_fds", "Maximum number of open file descriptors", s.max_fds as f64),
            (
                "process_start_time_seconds",
                "Start time of the process since the Unix epoch in seconds",
                s.start_time_seconds,
            ),
            ("process_threads", "Number of OS threads in the process", s.threads as f64),
        ];
        for (name, help, value) in gauges {
            let g = ConstGauge::new(value);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_files_parse_into_a_sample() {
        // A command name with spaces and a parenthesis, as a process may have.
        let stat = "4242 (strata (x) y) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 50 0 0 20 0 17 0 12345 \
                    987654321 2500 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0";
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            1048576              1048576              files\n";
        let proc_stat = "cpu  1 2 3\nbtime 1700000000\nprocesses 9\n";
        let s = parse(stat, limits, proc_stat, 4096).unwrap();
        assert_eq!(s.cpu_seconds, 3.0);
        assert_eq!(s.threads, 17);
        assert_eq!(s.start_time_seconds, 1_700_000_000.0 + 123.45);
        assert_eq!((s.virtual_bytes, s.resident_bytes), (987_654_321, 2500 * 4096));
        assert_eq!(s.max_fds, 1_048_576);
        assert!(parse("garbage", limits, proc_stat, 4096).is_none());
    }

    #[test]
    fn this_process_has_a_sample() {
        let s = sample().expect("/proc/self on Linux");
        assert!(s.resident_bytes > 0 && s.open_fds > 0 && s.max_fds > 0 && s.threads > 0, "{s:?}");
    }
}
