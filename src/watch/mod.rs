//! Background work (DESIGN.md §3): pull-failure recovery and re-verification,
//! run by the replica that holds the Lease.
