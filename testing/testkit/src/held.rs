//! A client process a test keeps running across its steps (a connection
//! held open while the test changes what it goes through), talking by lines.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdout};

/// A spawned process with piped stdin and stdout (stderr piped too, for
/// [`HeldClient::rest`]); killed on drop.
pub struct HeldClient {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl HeldClient {
    pub fn new(mut child: Child) -> HeldClient {
        let out = BufReader::new(child.stdout.take().expect("the client's stdout piped"));
        HeldClient { child, out }
    }

    /// Its next line (empty once it ended).
    pub fn line(&mut self) -> String {
        let mut l = String::new();
        let _ = self.out.read_line(&mut l);
        l.trim_end().to_string()
    }

    /// Writes a line to it, then reads its next one.
    pub fn line_after_input(&mut self) -> String {
        if let Some(stdin) = self.child.stdin.as_mut() {
            let _ = stdin.write_all(b"\n");
        }
        self.line()
    }

    /// Ends it and returns what it wrote to stderr (for a failed
    /// assertion's message).
    pub fn rest(&mut self) -> String {
        let _ = self.child.kill();
        let mut e = String::new();
        if let Some(mut err) = self.child.stderr.take() {
            let _ = err.read_to_string(&mut e);
        }
        e
    }
}

impl Drop for HeldClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut rest = String::new();
        let _ = self.out.read_to_string(&mut rest);
    }
}
