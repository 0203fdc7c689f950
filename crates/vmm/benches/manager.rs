//! Manager CPU-cost benchmark (work in progress).
fn main() {}
