//! The cost policy's weights learned from a router's own flights ([`Router::learning`]).
//!
//! Each request sent on a cost decision is one observation once its first token comes: its
//! time to first token against the prompt tokens it and this router's earlier requests there
//! had to compute when it was chosen (`x`) and the requests ahead of it (`q`). The weights are
//! the least-squares fit of `ttft = c + a·x + b·q` (an intercept `c` takes what the transport
//! adds), over observations that fade (each weighs half after [`HALF_LIFE`] more), pulled
//! towards the weights it started from as [`PRIOR`] observations would (so that a term the
//! flights do not vary, `q` in an idle fleet, keeps its start), and kept within [`BOUND`]
//! times the start either way. Memory and time per observation are constant.
//!
//! [`Router::learning`]: super::Router::learning

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::Weights;
use crate::lock;

/// Observations after which one weighs half.
const HALF_LIFE: f64 = 1_000.0;
/// How many observations the start weights count as.
const PRIOR: f64 = 16.0;
/// The factor the learned weights stay within, from the start either way.
const BOUND: f64 = 1_000.0;
/// A time to first token longer than this is taken as this (one stuck request must not
/// swing the fit), in microseconds.
const LONGEST_US: f64 = 60e6;

/// The weights as a router weighs now ([`super::Router::weights`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weighing {
    /// The weights the next choice uses.
    pub weights: Weights,
    /// Whether they are learned from flights (else given, fixed).
    pub learned: bool,
    /// Flights learned from so far (0 when fixed).
    pub flights: u64,
}

/// Decayed sums of `z zᵀ` and `z·y`, `z = (1, x, q)`, `y` the time to first token.
#[derive(Debug, Default)]
struct Sums {
    zz: [[f64; 3]; 3],
    zy: [f64; 3],
}

/// What a learning router keeps.
#[derive(Debug)]
pub(super) struct Learner {
    start: Weights,
    sums: Mutex<Sums>,
    prefill: AtomicU64,
    queue: AtomicU64,
    flights: AtomicU64,
}

impl Learner {
    pub(super) fn new(start: Weights) -> Self {
        Self {
            start,
            sums: Mutex::default(),
            prefill: AtomicU64::new(start.prefill_us_per_token.to_bits()),
            queue: AtomicU64::new(start.queue_us_per_request.to_bits()),
            flights: AtomicU64::new(0),
        }
    }

    /// The weights now.
    pub(super) fn weights(&self) -> Weights {
        Weights {
            prefill_us_per_token: f64::from_bits(self.prefill.load(Relaxed)),
            queue_us_per_request: f64::from_bits(self.queue.load(Relaxed)),
        }
    }

    pub(super) fn flights(&self) -> u64 {
        self.flights.load(Relaxed)
    }

    /// One flight: `ttft_us` after it was sent, with `x` prompt tokens to compute (its own and
    /// this router's earlier ones there) and `q` requests ahead.
    pub(super) fn observe(&self, x: f64, q: f64, ttft_us: f64) {
        if !(x.is_finite() && q.is_finite() && ttft_us.is_finite()) {
            return;
        }
        let z = [1.0, x, q];
        let y = ttft_us.clamp(0.0, LONGEST_US);
        let fade = 0.5_f64.powf(1.0 / HALF_LIFE);
        let w = {
            let mut s = lock(&self.sums);
            for i in 0..3 {
                for j in 0..3 {
                    s.zz[i][j] = s.zz[i][j] * fade + z[i] * z[j];
                }
                s.zy[i] = s.zy[i] * fade + z[i] * y;
            }
            fit(&s, self.start)
        };
        if let Some(w) = w {
            self.prefill
                .store(w.prefill_us_per_token.to_bits(), Relaxed);
            self.queue.store(w.queue_us_per_request.to_bits(), Relaxed);
        }
        self.flights.fetch_add(1, Relaxed);
    }
}

/// The weights the sums say, pulled towards `start`, within [`BOUND`] of it; `None` when the
/// system cannot be solved.
fn fit(s: &Sums, start: Weights) -> Option<Weights> {
    let n = s.zz[0][0].max(f64::MIN_POSITIVE);
    // The prior's precision on each slope is PRIOR observations at the data's own spread (the
    // term's variance, at least 1), so that it means the same in tokens and requests; the
    // intercept is free (a vanishing precision keeps the system solvable).
    let spread = |i: usize| (s.zz[i][i] / n - (s.zz[0][i] / n).powi(2)).max(1.0);
    let p = [1e-9, PRIOR * spread(1), PRIOR * spread(2)];
    let centre = [0.0, start.prefill_us_per_token, start.queue_us_per_request];
    let mut a = s.zz;
    let mut b = s.zy;
    for i in 0..3 {
        a[i][i] += p[i];
        b[i] += p[i] * centre[i];
    }
    let theta = solve3(a, b)?;
    let within = |v: f64, from: f64| {
        let (lo, hi) = (from / BOUND, from.max(f64::MIN_POSITIVE) * BOUND);
        if v.is_finite() { v.clamp(lo, hi) } else { from }
    };
    Some(Weights {
        prefill_us_per_token: within(theta[1], start.prefill_us_per_token),
        queue_us_per_request: within(theta[2], start.queue_us_per_request),
    })
}

/// `a·θ = b` by elimination with partial pivoting; `None` when `a` is singular.
fn solve3(mut a: [[f64; 3]; 3], mut b: [f64; 3]) -> Option<[f64; 3]> {
    for col in 0..3 {
        let pivot = (col..3).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        let top = a[col];
        for row in col + 1..3 {
            let f = a[row][col] / top[col];
            for (v, t) in a[row].iter_mut().zip(top).skip(col) {
                *v -= f * t;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; 3];
    for row in (0..3).rev() {
        let rest: f64 = (row + 1..3).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - rest) / a[row][row];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start() -> Weights {
        Weights::default()
    }

    #[test]
    fn solves_a_system() {
        let x = solve3(
            [[2.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 4.0]],
            [3.0, 5.0, 5.0],
        )
        .expect("solvable");
        for (v, want) in x.iter().zip([1.0, 1.0, 1.0]) {
            assert!((v - want).abs() < 1e-12, "{x:?}");
        }
        assert_eq!(solve3([[0.0; 3]; 3], [1.0; 3]), None);
    }

    #[test]
    fn starts_from_the_start_and_learns_the_truth() {
        let l = Learner::new(start());
        assert_eq!(l.weights(), start());
        // The engine: 50 µs a token, 2 ms a request ahead, 3 ms of transport.
        let mut r = 1u64;
        for _ in 0..4_000 {
            r = r.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let x = (r >> 40) as f64 % 4_000.0;
            let q = (r >> 20) as f64 % 30.0;
            l.observe(x, q, 3_000.0 + 50.0 * x + 2_000.0 * q);
        }
        // Near the truth: the start still pulls as 16 flights against the ~1,440 that count.
        let w = l.weights();
        assert!((w.prefill_us_per_token - 50.0).abs() < 2.0, "{w:?}");
        assert!((w.queue_us_per_request - 2_000.0).abs() < 300.0, "{w:?}");
        assert_eq!(l.flights(), 4_000);
    }

    #[test]
    fn a_term_the_flights_do_not_vary_keeps_its_start() {
        let l = Learner::new(start());
        for i in 0..500 {
            let x = f64::from(i % 50) * 40.0;
            l.observe(x, 0.0, 1_000.0 + 30.0 * x);
        }
        let w = l.weights();
        assert!((w.prefill_us_per_token - 30.0).abs() < 4.0, "{w:?}");
        assert_eq!(w.queue_us_per_request, start().queue_us_per_request);
    }

    #[test]
    fn stays_within_its_bound_and_ignores_what_is_not_a_number() {
        let l = Learner::new(start());
        for i in 0..2_000 {
            let q = f64::from(i % 7);
            // Time falls as requests are ahead: a negative weight, kept at the bound.
            l.observe(100.0, q, 1e6 - 1e5 * q);
            l.observe(f64::NAN, q, 1.0);
        }
        let w = l.weights();
        assert_eq!(w.queue_us_per_request, start().queue_us_per_request / BOUND);
        assert_eq!(l.flights(), 2_000);
    }

    #[test]
    fn old_flights_fade() {
        let l = Learner::new(start());
        let feed = |per_token: f64| {
            for i in 0..3_000 {
                let x = f64::from(i % 100) * 20.0;
                let q = f64::from(i % 9);
                l.observe(x, q, 500.0 + per_token * x + 1_000.0 * q);
            }
        };
        feed(200.0);
        feed(20.0);
        // Three half-lives on, the old engine's speed weighs an eighth.
        let w = l.weights();
        assert!(w.prefill_us_per_token < 50.0, "{w:?}");
    }
}
