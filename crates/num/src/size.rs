//! Byte sizes as people write and read them: [`parse_size`] reads `8GiB`, `512 MiB`, `2k`,
//! `1.5GiB` or a raw byte count; [`format_size`] writes `8 GiB`, `1.75 GiB`, `64 KiB`,
//! `512 B`. Units are binary (KiB = 1024 B); the one-letter forms `k`, `m`, `g`, `t` mean the
//! same. Decimal units (`KB`, `MB`, `GB`) are refused rather than guessed.

use thiserror::Error;

/// Why a text is not a byte size.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SizeError {
    /// Empty text.
    #[error("empty size (write a byte count such as 8589934592, or 8GiB, 512MiB)")]
    Empty,
    /// A leading minus sign.
    #[error("{0:?} is negative; a size is a byte count >= 0")]
    Negative(String),
    /// Not a number followed by an optional unit.
    #[error("{0:?} is not a size (write a byte count such as 8589934592, or 8GiB, 512MiB)")]
    NotANumber(String),
    /// A unit that is not one of B, KiB, MiB, GiB, TiB, PiB.
    #[error("{text:?}: unknown unit {unit:?} (use B, KiB, MiB, GiB, TiB or PiB; K, M, G, T, P are the same)")]
    UnknownUnit {
        /// The whole text.
        text: String,
        /// The unit as written.
        unit: String,
    },
    /// A number written with an exponent (`1e9`, `2.5E3`): sizes are written out, or with
    /// a binary unit.
    #[error("{0:?}: exponents are not accepted in a size (write a byte count such as 8589934592, or 8GiB, 512MiB)")]
    Exponent(String),
    /// A fraction that does not come out as whole bytes.
    #[error("{0:?} is not a whole number of bytes")]
    Fractional(String),
    /// More than `u64::MAX` bytes.
    #[error("{0:?} does not fit in 64 bits")]
    TooLarge(String),
}

const UNITS: [(&str, u32); 6] = [
    ("B", 0),
    ("KiB", 10),
    ("MiB", 20),
    ("GiB", 30),
    ("TiB", 40),
    ("PiB", 50),
];

fn shift_of(unit: &str) -> Option<u32> {
    match unit.to_ascii_lowercase().as_str() {
        "" | "b" => Some(0),
        "k" | "kib" => Some(10),
        "m" | "mib" => Some(20),
        "g" | "gib" => Some(30),
        "t" | "tib" => Some(40),
        "p" | "pib" => Some(50),
        _ => None,
    }
}

/// Parses a byte size: digits, an optional fraction, an optional binary unit.
///
/// ```
/// use kvvm_num::parse_size;
/// assert_eq!(parse_size("8GiB"), Ok(8 << 30));
/// assert_eq!(parse_size("512 MiB"), Ok(512 << 20));
/// assert_eq!(parse_size("1.5k"), Ok(1536));
/// assert_eq!(parse_size("4096"), Ok(4096));
/// assert!(parse_size("-1").is_err());
/// assert!(parse_size("8GB").is_err());
/// ```
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let s = text.trim();
    if s.is_empty() {
        return Err(SizeError::Empty);
    }
    if s.starts_with('-') {
        return Err(SizeError::Negative(s.to_owned()));
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let unit = unit.trim();
    let exponent = unit
        .strip_prefix(['e', 'E'])
        .map(|e| e.trim_start_matches(['+', '-']))
        .is_some_and(|e| !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()));
    if exponent && !number.is_empty() {
        return Err(SizeError::Exponent(s.to_owned()));
    }
    let shift = shift_of(unit).ok_or_else(|| SizeError::UnknownUnit {
        text: s.to_owned(),
        unit: unit.to_owned(),
    })?;
    let (int, frac) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    let all_digits = |p: &str| p.chars().all(|c| c.is_ascii_digit());
    if int.is_empty() || !all_digits(int) || !all_digits(frac) {
        return Err(SizeError::NotANumber(s.to_owned()));
    }
    let too_large = || SizeError::TooLarge(s.to_owned());
    let whole: u64 = int.parse().map_err(|_| too_large())?;
    let bytes_whole = whole.checked_mul(1u64 << shift).ok_or_else(too_large)?;
    // The fraction, exactly: frac / 10^len scaled by 2^shift must be a whole number.
    let frac = frac.trim_end_matches('0');
    if frac.is_empty() {
        return Ok(bytes_whole);
    }
    if frac.len() > 18 {
        return Err(SizeError::Fractional(s.to_owned()));
    }
    let numerator: u128 = frac
        .parse()
        .map_err(|_| SizeError::NotANumber(s.to_owned()))?;
    let denominator = 10u128.pow(u32::try_from(frac.len()).unwrap_or(18));
    let scaled = numerator << shift;
    if !scaled.is_multiple_of(denominator) {
        return Err(SizeError::Fractional(s.to_owned()));
    }
    let extra = u64::try_from(scaled / denominator).map_err(|_| too_large())?;
    bytes_whole.checked_add(extra).ok_or_else(too_large)
}

/// The largest binary unit (name, shift) of which `bytes` holds at least one; `None` below
/// one KiB (plain bytes).
fn binary_unit(bytes: u64) -> Option<(&'static str, u32)> {
    UNITS
        .iter()
        .rev()
        .find(|(_, shift)| *shift > 0 && bytes >> shift > 0)
        .copied()
}

/// A size in the largest binary unit it reaches, with up to two decimals (trailing zeros
/// dropped): `8 GiB`, `1.75 GiB`, `64 KiB`, `512 B`. Exact figures belong in JSON, as bytes.
///
/// ```
/// use kvvm_num::format_size;
/// assert_eq!(format_size(8 << 30), "8 GiB");
/// assert_eq!(format_size(1_879_048_192), "1.75 GiB");
/// assert_eq!(format_size(65536), "64 KiB");
/// assert_eq!(format_size(1000), "1000 B");
/// ```
pub fn format_size(bytes: u64) -> String {
    let Some((name, shift)) = binary_unit(bytes) else {
        return format!("{bytes} B");
    };
    let value = bytes as f64 / (1u64 << shift) as f64;
    let text = format!("{value:.2}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text} {name}")
}

/// Like [`format_size`] but always with two decimals (`8.00 GiB`, `5.20 GiB`, `512 B`), so
/// that the figures of a table column line up.
///
/// ```
/// use kvvm_num::format_size_fixed;
/// assert_eq!(format_size_fixed(5_583_457_485), "5.20 GiB");
/// assert_eq!(format_size_fixed(40 << 30), "40.00 GiB");
/// ```
pub fn format_size_fixed(bytes: u64) -> String {
    let Some((name, shift)) = binary_unit(bytes) else {
        return format!("{bytes} B");
    };
    format!("{:.2} {name}", bytes as f64 / (1u64 << shift) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_fractions_and_raw_counts() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("1024"), Ok(1024));
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size("8 gib"), Ok(8 << 30));
        assert_eq!(parse_size("2k"), Ok(2048));
        assert_eq!(parse_size("2M"), Ok(2 << 20));
        assert_eq!(parse_size("1TiB"), Ok(1 << 40));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("0.5KiB"), Ok(512));
        assert_eq!(parse_size("3.0"), Ok(3));
        assert_eq!(parse_size("16383PiB"), Ok(16383 << 50));
    }

    #[test]
    fn refusals_say_why() {
        assert_eq!(parse_size(""), Err(SizeError::Empty));
        assert!(matches!(parse_size("-5"), Err(SizeError::Negative(_))));
        assert!(matches!(
            parse_size("lots"),
            Err(SizeError::UnknownUnit { .. })
        ));
        assert!(matches!(
            parse_size("8GB"),
            Err(SizeError::UnknownUnit { .. })
        ));
        assert!(matches!(
            parse_size("1XB"),
            Err(SizeError::UnknownUnit { .. })
        ));
        assert!(matches!(parse_size("1.2.3"), Err(SizeError::NotANumber(_))));
        assert!(matches!(parse_size(".5k"), Err(SizeError::NotANumber(_))));
        assert!(matches!(parse_size("1.3"), Err(SizeError::Fractional(_))));
        assert!(matches!(
            parse_size("0.1KiB"),
            Err(SizeError::Fractional(_))
        ));
        assert!(matches!(
            parse_size("99999999TiB"),
            Err(SizeError::TooLarge(_))
        ));
        assert!(matches!(
            parse_size("18446744073709551616"),
            Err(SizeError::TooLarge(_))
        ));
        assert!(parse_size("-5")
            .unwrap_err()
            .to_string()
            .contains("negative"));
        for text in ["1e99", "2.5E3", "8e+9", "1e-3"] {
            let e = parse_size(text).unwrap_err();
            assert!(matches!(e, SizeError::Exponent(_)), "{text}: {e:?}");
            assert!(e.to_string().contains("exponents are not accepted"), "{e}");
        }
        // A unit that merely starts with an e is still an unknown unit.
        assert!(matches!(
            parse_size("1exa"),
            Err(SizeError::UnknownUnit { .. })
        ));
    }

    #[test]
    fn formatting_picks_the_largest_unit() {
        assert_eq!(format_size(0), "0 B");
        assert_eq!(format_size(1), "1 B");
        assert_eq!(format_size(1023), "1023 B");
        assert_eq!(format_size(1024), "1 KiB");
        assert_eq!(format_size(2 << 20), "2 MiB");
        assert_eq!(format_size(40 << 30), "40 GiB");
        assert_eq!(format_size(7_441_743_872), "6.93 GiB");
        assert_eq!(format_size(1_874_997_760), "1.75 GiB");
        assert_eq!(format_size(3 << 40), "3 TiB");
        assert_eq!(format_size(u64::MAX), "16384 PiB");
    }

    #[test]
    fn formatting_and_parsing_round_trip_on_exact_units() {
        for b in [0u64, 1, 512, 4096, 2 << 20, 1536 << 20, 8 << 30, 5 << 40] {
            assert_eq!(parse_size(&format_size(b)), Ok(b), "{b}");
        }
    }
}
