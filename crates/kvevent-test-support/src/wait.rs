//! Bounded waits: a test polls until what it waits for holds, and a failure says what it
//! waited for, how long, and the last value it saw.

use std::future::Future;
use std::time::{Duration, Instant};

/// How often a wait looks again.
const EVERY: Duration = Duration::from_millis(20);

/// Polls `probe` (every 20 ms) until it returns `Ok`, and returns that; after `timeout`,
/// panics with `what`, the time waited and the last `Err` (what was seen instead).
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use std::time::Duration;
/// let mut n = 0;
/// let got = kvevent_test_support::eventually("three calls", Duration::from_secs(1), || {
///     n += 1;
///     let seen = n;
///     async move { if seen >= 3 { Ok(seen) } else { Err(format!("{seen} calls")) } }
/// })
/// .await;
/// assert_eq!(got, 3);
/// # });
/// ```
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let last = match probe().await {
            Ok(value) => return value,
            Err(seen) => seen,
        };
        assert!(
            Instant::now() < deadline,
            "{what}: not within {timeout:?}; last seen: {last}"
        );
        tokio::time::sleep(EVERY).await;
    }
}

/// [`eventually`] for a test without a runtime: the thread sleeps between looks.
pub fn eventually_blocking<T>(
    what: &str,
    timeout: Duration,
    mut probe: impl FnMut() -> Result<T, String>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        let last = match probe() {
            Ok(value) => return value,
            Err(seen) => seen,
        };
        assert!(
            Instant::now() < deadline,
            "{what}: not within {timeout:?}; last seen: {last}"
        );
        std::thread::sleep(EVERY);
    }
}

/// `Ok(value)` when `holds`, else `Err` naming the value: the usual probe of a counter.
///
/// ```
/// assert_eq!(kvevent_test_support::when(3, |n| *n >= 2), Ok(3));
/// assert_eq!(kvevent_test_support::when(1, |n| *n >= 2), Err("1".to_owned()));
/// ```
pub fn when<T: std::fmt::Debug>(value: T, holds: impl FnOnce(&T) -> bool) -> Result<T, String> {
    if holds(&value) {
        Ok(value)
    } else {
        Err(format!("{value:?}"))
    }
}
