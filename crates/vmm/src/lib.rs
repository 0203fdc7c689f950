//! kvvm-vmm (work in progress).
