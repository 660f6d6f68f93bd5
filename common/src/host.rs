//! Facts about this machine that several roles need.

/// Memory the kernel says is available (`MemAvailable`), in bytes; None where it cannot
/// tell (no /proc/meminfo).
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok())
        .map(|kib| kib * 1024)
}
