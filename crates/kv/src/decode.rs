//! Synthetic decode loop (placeholder, filled in below).
