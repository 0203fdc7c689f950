//! How to read the timings of a run: on the simulated driver they are not GPU figures, and
//! every table that prints them says so.

/// The line a report prints under its title when its timings are not a GPU's: on `sim`,
/// whose driver calls cost what its in-process bookkeeping costs (or, with a spent latency
/// model, the model's medians). `None` on a real device (a GPU, or the host's memory).
pub fn simulated_timing_note(backend: &str, latency_spent: bool) -> Option<String> {
    if backend != "sim" {
        return None;
    }
    Some(if latency_spent {
        "simulated timings: backend sim spends the H200 latency model's cost for each driver call; \
         the figures follow the model, they are not measured on a GPU"
            .to_owned()
    } else {
        "simulated timings: backend sim is an in-process simulated driver; the times are its \
         bookkeeping, not a GPU's (run on a GPU for real figures)"
            .to_owned()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_simulator_is_labelled() {
        assert!(simulated_timing_note("cuda", false).is_none());
        assert!(simulated_timing_note("host", false).is_none());
        let n = simulated_timing_note("sim", false).unwrap_or_default();
        assert!(n.starts_with("simulated timings"), "{n}");
        assert!(simulated_timing_note("sim", true)
            .unwrap_or_default()
            .contains("latency model"));
    }
}
