//! Facts about the machine a figure was measured on.

use serde_json::{Value, json};

/// CPU count, memory and kernel, as printed with every result.
pub fn describe() -> Value {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let memory_kib = read_field("/proc/meminfo", "MemTotal:");
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_owned();
    let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|line| line.starts_with("model name"))
                .map(str::to_owned)
        })
        .and_then(|line| line.split(':').nth(1).map(|model| model.trim().to_owned()))
        .unwrap_or_default();
    json!({"cpus": cpus, "cpu_model": cpu_model, "memory_kib": memory_kib, "kernel": kernel})
}

/// The first number after `field` in a `/proc` key-value file.
pub fn read_field(path: &str, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|line| line.starts_with(field))?;
    line[field.len()..].split_whitespace().next()?.parse().ok()
}

/// Resident set size of a process, in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    read_field(&format!("/proc/{pid}/status"), "VmRSS:")
}

/// User plus system CPU time of a process, in clock ticks.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    process_times(pid).map(|times| times.own_ticks)
}

/// A process's command name, parent and CPU time, from `/proc/<pid>/stat`.
#[derive(Debug, Clone)]
pub struct ProcessTimes {
    /// The command name (at most 15 characters).
    pub command: String,
    /// The parent's pid.
    pub parent: u32,
    /// User plus system time of the process itself (all its threads), in clock ticks.
    pub own_ticks: u64,
    /// User plus system time of its children that exited and were reaped, in clock ticks.
    pub children_ticks: u64,
}

/// The command name, parent and CPU times of a process.
pub fn process_times(pid: u32) -> Option<ProcessTimes> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces) start after the last ')'.
    let (head, after) = stat.rsplit_once(')')?;
    let command = head.split_once('(')?.1.to_owned();
    let fields: Vec<&str> = after.split_whitespace().collect();
    let number = |index: usize| fields.get(index)?.parse::<u64>().ok();
    Some(ProcessTimes {
        command,
        parent: u32::try_from(number(1)?).ok()?,
        own_ticks: number(11)? + number(12)?,
        children_ticks: number(13)? + number(14)?,
    })
}

/// Clock ticks per second of `/proc/<pid>/stat` (USER_HZ, 100 on Linux).
pub fn ticks_per_second() -> f64 {
    100.0
}
