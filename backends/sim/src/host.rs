//! What the host can hold. The simulated device's memory is the host's: the bytes written into
//! it are stored in host memory (`store.rs`), so a budget on the simulator that promises more
//! than the host has lets any client have the host killed for memory. A server's default
//! budget on the simulator is therefore bounded by [`host_memory_budget`].

use kvvm_hal::{DeviceId, VirtualMemoryBackend};

use crate::config::GIB;

/// The share of the host's available memory a default budget on the simulator may take: one
/// half (the rest is the host's and the server's own).
pub const HOST_BUDGET_DIVISOR: u64 = 2;

/// The bound when the host's available memory cannot be read (no `/proc/meminfo`): 4 GiB.
pub const HOST_BUDGET_FALLBACK: u64 = 4 * GIB;

/// The most a default budget on the simulator may promise: half of the host's available
/// memory (`MemAvailable` in `/proc/meminfo`, read now), or [`HOST_BUDGET_FALLBACK`] when it
/// cannot be read.
pub fn host_memory_budget() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| host_memory_budget_from(&text))
        .unwrap_or(HOST_BUDGET_FALLBACK)
}

/// The budget a server takes for `device` of `backend` when it is given none: the device's
/// free memory as the driver reports it (`None` when it cannot say), and on the simulator
/// (`backend.name() == "sim"`), whose device memory is the host's, at most
/// [`host_memory_budget`], whatever the simulated device's size.
pub fn default_budget(backend: &dyn VirtualMemoryBackend, device: DeviceId) -> Option<u64> {
    let free = backend.memory_info(device).ok().map(|m| m.free);
    if backend.name() != "sim" {
        return free;
    }
    Some(bounded_by_host(free, host_memory_budget()))
}

/// A simulated device's budget: its free memory (when the driver says), at most `host`.
pub fn bounded_by_host(free: Option<u64>, host: u64) -> u64 {
    free.map_or(host, |f| f.min(host))
}

/// Half of the host's total memory (`MemTotal`; it does not move while the host runs): what
/// [`host_memory_budget`] can never exceed. `None` where `/proc/meminfo` cannot be read.
pub fn host_memory_ceiling() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find_map(|l| l.strip_prefix("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().next()?.parse().ok()?;
    Some(kb.saturating_mul(1024) / HOST_BUDGET_DIVISOR)
}

/// [`host_memory_budget`] from the text of `/proc/meminfo`: half of its `MemAvailable` line
/// (in kB); `None` without one.
pub fn host_memory_budget_from(meminfo: &str) -> Option<u64> {
    let line = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let mut words = line.split_whitespace();
    let value: u64 = words.next()?.parse().ok()?;
    let unit = match words.next() {
        None => 1,
        Some(u) if u.eq_ignore_ascii_case("kb") => 1024,
        Some(_) => return None,
    };
    Some(value.saturating_mul(unit) / HOST_BUDGET_DIVISOR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_of_mem_available() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   23000000 kB\n";
        assert_eq!(host_memory_budget_from(text), Some(23_000_000 * 1024 / 2));
        assert_eq!(host_memory_budget_from("MemTotal: 5 kB\n"), None);
        assert_eq!(host_memory_budget_from("MemAvailable: x kB\n"), None);
        assert_eq!(host_memory_budget_from("MemAvailable: 7 MB\n"), None);
        assert!(host_memory_budget() > 0);
    }

    #[test]
    fn the_default_budget_on_the_simulator_is_bounded_by_the_host() {
        // The rule, on fixed figures (the host's available memory moves between two reads).
        let h200 = crate::H200_GRANULE * crate::H200_GRANULES;
        assert_eq!(bounded_by_host(Some(h200), 11 * GIB), 11 * GIB);
        assert_eq!(bounded_by_host(Some(1 << 25), 11 * GIB), 1 << 25);
        assert_eq!(bounded_by_host(None, 11 * GIB), 11 * GIB);
        // On this host: a simulated H200 reports 139 GiB free, the budget is the host's
        // bound, never above half of the host's total memory.
        let sim = crate::SimBackend::h200();
        assert_eq!(
            sim.memory_info(DeviceId(0)).map(|m| m.free).ok(),
            Some(h200)
        );
        let budget = default_budget(&sim, DeviceId(0)).unwrap_or(0);
        assert!(budget > 0 && budget <= h200);
        if let Some(ceiling) = host_memory_ceiling() {
            assert!(
                budget <= ceiling,
                "{budget} over half the host's memory {ceiling}"
            );
        }
        // A small simulated device: its free memory is the tighter bound.
        let small = crate::SimBackend::new(crate::SimConfig::single(1 << 21, 1 << 25));
        assert_eq!(default_budget(&small, DeviceId(0)), Some(1 << 25));
    }
}
