//! Examples live in `examples/*.rs`: `cargo run -p kvevent-examples --example router_view`.
