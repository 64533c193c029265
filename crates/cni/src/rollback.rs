//! ADD's undo stack: each step that changes the system registers how to
//! undo itself; unless [`Rollback::commit`] is reached, dropping the stack
//! (an early `?` return or a panic unwinding) undoes in reverse order.

type Step<'a> = (
    String,
    Box<dyn FnOnce() -> Result<(), crate::CniError> + 'a>,
);

#[derive(Default)]
pub struct Rollback<'a> {
    steps: Vec<Step<'a>>,
}

impl<'a> Rollback<'a> {
    pub fn new() -> Self {
        Rollback { steps: Vec::new() }
    }

    /// Registers the undo of something just done; `what` names it in the log
    /// line written if undoing fails.
    pub fn push(
        &mut self,
        what: impl Into<String>,
        undo: impl FnOnce() -> Result<(), crate::CniError> + 'a,
    ) {
        self.steps.push((what.into(), Box::new(undo)));
    }

    /// Everything succeeded: keep it.
    pub fn commit(mut self) {
        self.steps.clear();
    }

    /// Undo now, in reverse; every step runs even if one fails. Returns the
    /// failures' descriptions.
    pub fn undo(&mut self) -> Vec<String> {
        let mut failed = Vec::new();
        while let Some((what, f)) = self.steps.pop() {
            if let Err(e) = f() {
                failed.push(format!("undo {what}: {e}"));
            }
        }
        failed
    }
}

impl Drop for Rollback<'_> {
    fn drop(&mut self) {
        // stderr is the runtime's log; stdout carries the error JSON.
        for f in self.undo() {
            eprintln!("rcni: {f}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CniError;
    use std::cell::RefCell;

    #[test]
    fn undoes_in_reverse_unless_committed() {
        let log = RefCell::new(Vec::new());
        {
            let mut rb = Rollback::new();
            rb.push("a", || {
                log.borrow_mut().push("a");
                Ok(())
            });
            rb.push("b", || Err(CniError::internal("b failed")));
            rb.push("c", || {
                log.borrow_mut().push("c");
                Ok(())
            });
        }
        // c, then b fails, and a still runs.
        assert_eq!(*log.borrow(), ["c", "a"]);
        log.borrow_mut().clear();
        let mut rb = Rollback::new();
        rb.push("x", || {
            log.borrow_mut().push("x");
            Ok(())
        });
        rb.commit();
        assert!(log.borrow().is_empty());
    }

    #[test]
    fn undoes_on_panic() {
        let log = RefCell::new(Vec::new());
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut rb = Rollback::new();
            rb.push("p", || {
                log.borrow_mut().push("p");
                Ok(())
            });
            panic!("boom");
        }));
        assert!(r.is_err());
        assert_eq!(*log.borrow(), ["p"]);
    }
}
