//! Granule windows as arithmetic: sets of windows as sorted runs (`spans.rs`) and how a run is
//! cut into handles (`cut.rs`). Pure functions, no driver and no state.

pub(crate) mod cut;
pub(crate) mod spans;
