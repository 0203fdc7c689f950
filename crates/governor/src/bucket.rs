//! [`Bucket`]: where a byte of physical memory is accounted.

use std::fmt;

/// Where a byte of physical memory is accounted (see the crate docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bucket {
    /// Mapped in a reservation and owned by it.
    Committed,
    /// Unmapped, held by a handle pool for reuse.
    Pooled,
    /// Held once for several mappings (a shared prefix).
    Shared,
    /// Could not be proven idle or could not be released; never reused, never free.
    Quarantined,
}

impl Bucket {
    /// A short lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Bucket::Committed => "committed",
            Bucket::Pooled => "pooled",
            Bucket::Shared => "shared",
            Bucket::Quarantined => "quarantined",
        }
    }
}

impl fmt::Display for Bucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
