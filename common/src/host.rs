//! Facts about this machine that several roles need.

/// Memory the kernel says is available (`MemAvailable`), in bytes; None where it cannot
/// tell (no /proc/meminfo).
pub fn available_memory() -> Option<u64> {
    meminfo("MemAvailable:")
}

/// The machine's memory (`MemTotal`), in bytes; None where it cannot tell.
pub fn total_memory() -> Option<u64> {
    meminfo("MemTotal:")
}

fn meminfo(field: &str) -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok())
        .map(|kib| kib * 1024)
}

/// This machine's host name ("worker" when it cannot tell).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "worker".into())
}
