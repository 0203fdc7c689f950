//! Parsers of flag values, one per kind of number, shared by every subcommand. Each refuses a
//! value outside its range with a message that gives the range; clap puts the flag's name in
//! front (`invalid value '0' for '--iterations <N>': 0 is out of range: allowed 1..=100000`).
//! Nothing is clamped: a value the command cannot honour is an error, never a silent change.
//! Sizes take one syntax everywhere: a byte count or a binary unit (`8GiB`, `512MiB`, `2k`),
//! read by [`kvvm::num::parse_size`]; durations one too: whole `ms`, `s` (the default), `m`
//! or `h` (`500ms`, `10s`, `2m`).

use std::time::Duration;

use kvvm::num::{format_size, parse_size};

/// The largest context, in tokens, a flag accepts (16 Mi tokens).
pub const MAX_CONTEXT_TOKENS: u64 = 1 << 24;

/// The smallest and largest mapping granule a flag accepts (4 KiB, 1 GiB).
pub const GRANULE_RANGE: (u64, u64) = (4 << 10, 1 << 30);

fn range_text(min: u64, max: u64) -> String {
    if max == u64::MAX {
        format!("at least {min}")
    } else {
        format!("{min}..={max}")
    }
}

fn parse_int(s: &str, min: u64, max: u64) -> Result<u64, String> {
    let t = s.trim().replace('_', "");
    if t.starts_with('-') {
        return Err(format!("{s} is negative: allowed {}", range_text(min, max)));
    }
    let n: u64 = t.parse().map_err(|_| {
        format!(
            "{s:?} is not a whole number: allowed {}",
            range_text(min, max)
        )
    })?;
    if n < min || n > max {
        return Err(format!(
            "{n} is out of range: allowed {}",
            range_text(min, max)
        ));
    }
    Ok(n)
}

/// A whole number in `min..=max`, as the field's integer type.
pub fn int_in<T>(min: u64, max: u64) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync
where
    T: TryFrom<u64>,
{
    move |s: &str| {
        let n = parse_int(s, min, max)?;
        T::try_from(n).map_err(|_| format!("{n} is too large for this flag"))
    }
}

/// A finite number in `min..=max` (`min` itself refused when `min_exclusive`).
pub fn float_in(
    min: f64,
    max: f64,
    min_exclusive: bool,
) -> impl Fn(&str) -> Result<f64, String> + Clone + Send + Sync {
    move |s: &str| {
        let allowed = if min_exclusive {
            format!("greater than {min} and at most {max}")
        } else {
            format!("{min}..={max}")
        };
        let x: f64 = s
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not a number: allowed {allowed}"))?;
        let low_ok = if min_exclusive { x > min } else { x >= min };
        if !x.is_finite() || !low_ok || x > max {
            return Err(format!("{s} is out of range: allowed {allowed}"));
        }
        Ok(x)
    }
}

/// A byte size (`8GiB`, `512MiB`, a raw count) in `min..=max`.
pub fn size_in(min: u64, max: u64) -> impl Fn(&str) -> Result<u64, String> + Clone + Send + Sync {
    move |s: &str| {
        let allowed = if max == u64::MAX {
            format!("at least {}", format_size(min))
        } else {
            format!("{}..={}", format_size(min), format_size(max))
        };
        let n = parse_size(s).map_err(|e| format!("{e}; allowed {allowed}"))?;
        if n < min || n > max {
            return Err(format!(
                "{s} ({n} bytes) is out of range: allowed {allowed}"
            ));
        }
        Ok(n)
    }
}

/// The longest duration a flag accepts (7 days): a timeout longer than that is no timeout,
/// and deadlines computed from it stay far from overflowing.
pub const MAX_DURATION: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// `d` in the largest unit that writes it whole (`500ms`, `10s`, `2m`, `168h`).
fn duration_text(d: Duration) -> String {
    let ms = d.as_millis();
    match ms {
        0 => "0s".to_owned(),
        ms if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
        ms if ms % 1000 == 0 => format!("{}s", ms / 1000),
        ms => format!("{ms}ms"),
    }
}

/// Whole milliseconds, seconds (no unit, or `s`), minutes or hours.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!("{s} is negative"));
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (e.g. 500ms, 10s, 2m, 1h)"))?;
    let scale = match unit.trim() {
        "ms" => return Ok(Duration::from_millis(n)),
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        other => return Err(format!("{s:?}: unknown unit {other:?} (use ms, s, m or h)")),
    };
    n.checked_mul(scale)
        .map(Duration::from_secs)
        .ok_or_else(|| format!("{s:?} is too long"))
}

/// A duration (`500ms`, `10s`, `2m`, `1h`) in `min..=max`.
pub fn duration_in(
    min: Duration,
    max: Duration,
) -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync {
    move |s: &str| {
        let allowed = format!("{}..={}", duration_text(min), duration_text(max));
        let d = parse_duration(s).map_err(|e| format!("{e}: allowed {allowed}"))?;
        if d < min || d > max {
            return Err(format!("{s} is out of range: allowed {allowed}"));
        }
        Ok(d)
    }
}

/// A mapping granule: a size that is a power of two in [`GRANULE_RANGE`].
pub fn granule(s: &str) -> Result<u64, String> {
    let (min, max) = GRANULE_RANGE;
    let n = size_in(min, max)(s)?;
    if !n.is_power_of_two() {
        return Err(format!(
            "{s} ({n} bytes) is not a power of two: a granule is one of 4KiB, 8KiB, ..., 2MiB, ..., 1GiB (query yours with `kvvm info`)"
        ));
    }
    Ok(n)
}

/// A device ordinal that the backend has (`count` devices), or an error naming the flag.
pub fn check_device(flag: &str, device: u32, backend: &str, count: usize) -> Result<(), String> {
    if (device as usize) < count {
        return Ok(());
    }
    let have = match count {
        0 => "no device".to_owned(),
        1 => "1 device (0)".to_owned(),
        n => format!("{n} devices (0..={})", n - 1),
    };
    Err(format!("{flag} {device}: backend {backend} has {have}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_in_range_and_out() {
        let p = int_in::<u64>(1, 100);
        assert_eq!(p("1"), Ok(1));
        assert_eq!(p("1_0"), Ok(10));
        assert!(p("0").unwrap_err().contains("allowed 1..=100"));
        assert!(p("101").unwrap_err().contains("out of range"));
        assert!(p("-5").unwrap_err().contains("negative"));
        assert!(p("x").unwrap_err().contains("not a whole number"));
        let any = int_in::<u32>(0, u64::from(u32::MAX));
        assert!(any("4294967296").is_err());
        assert!(int_in::<u64>(1, u64::MAX)("0")
            .unwrap_err()
            .contains("at least 1"));
    }

    #[test]
    fn floats_and_sizes() {
        let rate = float_in(0.0, 1e6, true);
        assert_eq!(rate("4"), Ok(4.0));
        assert!(rate("0").is_err());
        assert!(rate("nan").is_err());
        assert!(rate("inf").is_err());
        let share = float_in(0.0, 1.0, false);
        assert_eq!(share("0"), Ok(0.0));
        assert!(share("1.5").unwrap_err().contains("0..=1"));
        let budget = size_in(1, 1 << 50);
        assert_eq!(budget("8GiB"), Ok(8 << 30));
        assert!(budget("0").unwrap_err().contains("allowed 1 B..=1 PiB"));
        assert!(budget("-1").unwrap_err().contains("negative"));
        assert!(budget("2048PiB").unwrap_err().contains("out of range"));
    }

    #[test]
    fn durations_with_units_and_ranges() {
        let any = duration_in(Duration::ZERO, MAX_DURATION);
        assert_eq!(any("10"), Ok(Duration::from_secs(10)));
        assert_eq!(any("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(any("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(any("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(any("0"), Ok(Duration::ZERO));
        assert!(any("soon").unwrap_err().contains("allowed 0s..=168h"));
        assert!(any("3d").unwrap_err().contains("unknown unit"));
        assert!(any("-5s").unwrap_err().contains("negative"));
        assert!(any("169h").unwrap_err().contains("out of range"));
        assert!(any("99999999999999999999h").is_err());
        assert!(any("18446744073709551615h").is_err());
        let positive = duration_in(Duration::from_millis(1), MAX_DURATION);
        assert!(positive("0").unwrap_err().contains("allowed 1ms..=168h"));
    }

    #[test]
    fn granules_are_powers_of_two() {
        assert_eq!(granule("2MiB"), Ok(2 << 20));
        assert_eq!(granule("65536"), Ok(64 << 10));
        assert!(granule("3").unwrap_err().contains("allowed 4 KiB..=1 GiB"));
        assert!(granule("3MiB").unwrap_err().contains("power of two"));
    }

    #[test]
    fn devices_are_checked_against_the_backend() {
        assert!(check_device("--device", 0, "sim", 1).is_ok());
        let e = check_device("--device", 5, "sim", 1).unwrap_err();
        assert_eq!(e, "--device 5: backend sim has 1 device (0)");
    }
}
