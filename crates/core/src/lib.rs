//! The pure core of converger: state machines that take events and time as values and return
//! decisions, with no I/O, no clock reads and no randomness, so they can be tested exhaustively.
#![forbid(unsafe_code)]

pub mod channel;
pub mod groups;
pub mod http_agents;
pub mod policies;
pub mod recent;
pub mod replay;
pub mod runtimes;
pub mod streams;
pub mod transcript;
