//! Checked arithmetic and conversions that fail with the name of the quantity.

/// An arithmetic result or a conversion did not fit its type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("size arithmetic overflowed while computing {what}")]
pub struct Overflow {
    /// What was being computed.
    pub what: &'static str,
}

/// The unsigned integers the helpers work on.
pub trait CheckedInt: Copy {
    /// `self * rhs`, `None` on overflow.
    fn checked_mul_(self, rhs: Self) -> Option<Self>;
    /// `self + rhs`, `None` on overflow.
    fn checked_add_(self, rhs: Self) -> Option<Self>;
}

macro_rules! checked_int {
    ($($t:ty),*) => {$(
        impl CheckedInt for $t {
            fn checked_mul_(self, rhs: Self) -> Option<Self> {
                self.checked_mul(rhs)
            }
            fn checked_add_(self, rhs: Self) -> Option<Self> {
                self.checked_add(rhs)
            }
        }
    )*};
}
checked_int!(u32, u64, usize);

/// `a * b`, or [`Overflow`] naming `what`.
pub fn mul<T: CheckedInt>(a: T, b: T, what: &'static str) -> Result<T, Overflow> {
    a.checked_mul_(b).ok_or(Overflow { what })
}

/// `a + b`, or [`Overflow`] naming `what`.
pub fn add<T: CheckedInt>(a: T, b: T, what: &'static str) -> Result<T, Overflow> {
    a.checked_add_(b).ok_or(Overflow { what })
}

/// `value` as `usize`, or [`Overflow`] naming `what` (on a 32-bit target).
pub fn to_usize(value: u64, what: &'static str) -> Result<usize, Overflow> {
    usize::try_from(value).map_err(|_| Overflow { what })
}

/// `value` as `u64` (a `usize` is at most 64 bits on every supported target; saturates
/// otherwise).
pub fn to_u64(value: usize) -> u64 {
    u64::try_from(value).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_names_what() {
        assert_eq!(mul(u64::MAX, 2, "x"), Err(Overflow { what: "x" }));
        assert_eq!(add(usize::MAX, 1, "y"), Err(Overflow { what: "y" }));
        assert_eq!(mul(3u64, 4, "z"), Ok(12));
        assert_eq!(to_usize(7, "w"), Ok(7));
        assert_eq!(to_u64(9), 9);
    }
}
