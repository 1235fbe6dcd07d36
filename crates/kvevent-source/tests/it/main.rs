//! The per-source state machine (pure) and the subscriber over real sockets.

mod interop;
mod sockets;
mod state;
