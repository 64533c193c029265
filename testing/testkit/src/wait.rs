//! Waiting for state whose timing a test does not control: the kernel's
//! (carrier, DAD, neighbours), a daemon's start, an agent's next pass.
//! Always bounded, so a test that waits in vain fails naming what it waited
//! for instead of hanging.

use std::future::Future;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// Between two looks: short next to the bounds (seconds), so a test goes on
/// soon after the state is there.
const POLL: Duration = Duration::from_millis(20);

/// Polls `f` until it holds; panics naming `what` once `limit` has passed.
pub fn wait_for(limit: Duration, what: &str, mut f: impl FnMut() -> bool) {
    wait_for_value(limit, what, || f().then_some(()))
}

/// Polls `f` until it gives a value; panics naming `what` once `limit` has
/// passed.
pub fn wait_for_value<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let until = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < until,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(POLL);
    }
}

/// Whether `f` holds within `limit` (polled): for a test that checks either
/// outcome, or adds its own context to the failure.
pub fn poll(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + limit;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

/// [`wait_for_value`] for a tokio test: sleeps without blocking the
/// runtime that serves `f`'s netlink requests.
pub async fn wait_for_async<T, Fut>(limit: Duration, what: &str, mut f: impl FnMut() -> Fut) -> T
where
    Fut: Future<Output = Option<T>>,
{
    let until = Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < until,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// Polls `f` until it gives a value while `child` (a daemon starting, a
/// script) runs: gives up as soon as it ends, or once `limit` has passed,
/// for the caller to panic with the process's own words (its log, its
/// stderr).
pub fn wait_while_running<T>(
    child: &mut Child,
    limit: Duration,
    mut f: impl FnMut() -> Option<T>,
) -> Result<T, NotReady> {
    let until = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(NotReady::Exited(status));
        }
        if Instant::now() >= until {
            return Err(NotReady::TimedOut(limit));
        }
        std::thread::sleep(POLL);
    }
}

/// Why [`wait_while_running`] gave up.
#[derive(Debug)]
pub enum NotReady {
    Exited(ExitStatus),
    TimedOut(Duration),
}

impl std::fmt::Display for NotReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotReady::Exited(status) => write!(f, "exited ({status}) before it was ready"),
            NotReady::TimedOut(limit) => write!(f, "not ready in {limit:?}"),
        }
    }
}
