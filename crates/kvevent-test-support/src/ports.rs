//! Loopback ports held for a test's whole life, never bound and released.
//!
//! A port found by binding `127.0.0.1:0` and closing the listener is free only until someone
//! else takes it. A [`HeldPort`] keeps its socket bound, not listening, until it is dropped:
//!
//! - a connection to it is refused (nothing listens there, and nothing else can start to);
//! - no other socket can bind it, and the kernel never hands it out for port 0;
//! - a listener that sets `SO_REUSEADDR` can still bind it and listen: libzmq, Rust's std and
//!   tokio all do, as this socket does, and Linux lets a listener share a port with bound
//!   sockets that are not listening. So an engine, a sidecar or a router can be told its port
//!   before it starts.

use std::net::{Ipv4Addr, SocketAddr};

use socket2::{Domain, Socket, Type};

/// A loopback TCP port bound (not listening) until dropped.
#[derive(Debug)]
pub struct HeldPort {
    _socket: Socket,
    port: u16,
}

impl HeldPort {
    /// Holds a port the kernel picks.
    pub fn new() -> Self {
        Self::bind(0).expect("hold a loopback port")
    }

    /// Holds `port`, or fails if anything has it.
    pub fn bind(port: u16) -> std::io::Result<Self> {
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None)?;
        socket.set_reuse_address(true)?;
        socket.bind(&SocketAddr::from((Ipv4Addr::LOCALHOST, port)).into())?;
        let port = socket
            .local_addr()?
            .as_socket()
            .expect("an inet address")
            .port();
        Ok(Self {
            _socket: socket,
            port,
        })
    }

    /// Holds `n` consecutive ports (`p`, `p + 1`, …), as SGLang places its DP ranks.
    pub fn consecutive(n: u16) -> Vec<Self> {
        for _ in 0..100 {
            let first = Self::new();
            let base = first.port;
            if u32::from(base) + u32::from(n) > 65_536 {
                continue;
            }
            let rest: Result<Vec<Self>, _> = (1..n).map(|i| Self::bind(base + i)).collect();
            if let Ok(rest) = rest {
                return std::iter::once(first).chain(rest).collect();
            }
        }
        panic!("no {n} consecutive loopback ports free in 100 tries");
    }

    /// The port number.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// `tcp://127.0.0.1:PORT`, a ZeroMQ endpoint.
    pub fn tcp(&self) -> String {
        format!("tcp://{}", self.addr())
    }
}

impl Default for HeldPort {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_port_refuses_connections_and_other_binds() {
        let held = HeldPort::new();
        let err = std::net::TcpStream::connect(held.addr()).expect_err("nothing listens");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
        let plain = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
        assert!(plain.bind(&held.addr().into()).is_err(), "taken");
    }

    #[test]
    fn a_listener_with_reuse_address_can_still_take_it() {
        let held = HeldPort::new();
        // std sets SO_REUSEADDR on Unix, as libzmq does.
        let listener = std::net::TcpListener::bind(held.addr()).expect("listen on the held port");
        std::net::TcpStream::connect(held.addr()).expect("now it answers");
        drop(listener);
    }

    #[test]
    fn consecutive_ports_are_consecutive() {
        let ports = HeldPort::consecutive(3);
        assert_eq!(ports[1].port(), ports[0].port() + 1);
        assert_eq!(ports[2].port(), ports[0].port() + 2);
    }
}
